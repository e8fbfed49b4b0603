"""tools/simulator_validation/fsdp2_overhead.py on loopback: the trainer with and without --use-torch-fsdp2.

Two rank processes (gloo, one core and one thread each) train the link testbed's model as
PP = 1, DP = 2, with FSDP2 and with megatron-core's DDP; FSDP2's fixed cost per unit is
what it adds to a microbatch's forward and backward. Checked: both runs trained (their
traces gave forward and backward times), FSDP2 costs more than DDP on the same model and
data, and the numbers come back as the simulator's Fsdp2Overhead. The DDP runs also give
the training loop's own time per iteration, between one iteration and the next.
"""

import pytest


@pytest.mark.timeout(240)
def test_fsdp2_adds_a_fixed_cost_per_unit():
    from tools.simulator_validation import fsdp2_overhead

    a = fsdp2_overhead.parse_args(["--seq", "128", "--rounds", "1", "--microbatches", "4", "--iters", "3",
                                   "--timeout", "200"])
    over, res = fsdp2_overhead.fsdp2_overhead(a)
    for kind in ("forward", "backward"):
        assert res[kind]["ddp_s"] > 0 and res[kind]["fsdp_s"] > res[kind]["ddp_s"], res
    assert over.unit_forward_s == pytest.approx((res["forward"]["fsdp_s"] - res["forward"]["ddp_s"]) / 4)
    assert over.unit_backward_s > 0 and over.step_s > 0
    # one round: its costs are the medians themselves
    assert over.rounds == ((over.unit_forward_s, over.unit_backward_s, over.step_s),)
    assert fsdp2_overhead.units(a.layers) == 4  # embedding, two layers, root
    # reading data, the flag all-reduce, logging: more than nothing, less than an iteration
    assert 0 < res["loop_s"] < res["iteration"]["ddp_s"], res
