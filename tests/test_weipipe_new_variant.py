"""A new WeiPipe variant is one module with `plan(P, G)` plus one registry entry.

This file is that module: `weipipe-fwd-first` runs the interleave grid with the forward
(and loss) before the backward inside each tick. Registered by inserting one entry into
the registry table (under monkeypatch), it is accepted by generation, the validator,
the tick simulator, the timeline builder, the start-up rules and the training class
lookup, and pretrain() trains the GPT model with it exactly, with no other change anywhere.
"""

from __future__ import annotations


import pytest

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Kind
from megatron_weipipe.schedules.generate.builder import Compute, Plan
from megatron_weipipe.schedules.generate.weipipe_interleave import grid

NAME = "weipipe-fwd-first"


def plan(P: int, G: int) -> Plan:
    out = {}
    for key, (fwd, bwd) in grid(P, G).items():
        steps = []
        if fwd is not None:
            steps.append(Compute(Kind.FORWARD, *fwd))
            if fwd[1] == P - 1:
                steps.append(Compute(Kind.LOSS, fwd[0], P - 1))
        if bwd is not None:
            steps.append(Compute(Kind.BACKWARD, *bwd))
        out[key] = steps
    return out


@pytest.fixture
def variant(monkeypatch):
    monkeypatch.setitem(registry.SCHEDULES, NAME, registry.weipipe(NAME, f"{__name__}:plan"))
    return NAME


def test_unregistered_variant_is_unknown():
    from megatron_weipipe.schedules.ir.actions import ScheduleError
    from megatron_weipipe.schedules.generate.weipipe import generate

    with pytest.raises(ScheduleError, match="unknown WeiPipe schedule"):
        generate(NAME, 2, 1)


@pytest.mark.parametrize("P,G", [(2, 1), (3, 2), (4, 3), (6, 2)])
def test_variant_generates_validates_and_simulates(variant, P, G):
    from megatron_weipipe.schedules.generate.megatron_timeline import build
    from megatron_weipipe.schedules.generate.weipipe import generate
    from megatron_weipipe.schedules.timing.tick_simulator import simulate
    from megatron_weipipe.schedules.check.validate import validate

    assert variant in registry.weipipe_names() and variant in registry.plan_names()
    s = generate(variant, P, G)
    validate(s)
    assert build(variant, P, G).ranks == s.ranks  # the timeline builder dispatches through the registry
    assert s.num_ticks() == G * P + 2 * P - 1  # the interleave grid
    timing = simulate(s)
    assert timing.busy == tuple(3.0 * G * P for _ in range(P))  # F = 1, B = 2 per (mb, chunk)
    assert 0 < timing.bubble_fraction < 1
    # the same compute as weipipe-interleave per tick, forward first
    ref = generate("weipipe-interleave", P, G)
    for ours, theirs in zip(s.ranks, ref.ranks):
        assert _compute(ours) == _compute(theirs)
        order: dict[int, list[Kind]] = {}
        for a in ours:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD):
                order.setdefault(a.tick, []).append(a.kind)
        assert all(kinds[0] is Kind.FORWARD for kinds in order.values() if len(kinds) == 2)


def _compute(actions) -> list:
    """(tick, kind, mb, chunk) of every compute action, sorted."""
    return sorted((a.tick, a.kind.value, a.mb, a.chunk) for a in actions if a.kind in COMPUTE_KINDS)

def test_variant_start_up_rules_and_training_class(variant):
    from megatron_weipipe.config import ConfigError
    from megatron_weipipe.schedules.gpt.weipipe import WeiPipeSchedule

    from test_weipipe_registry import _cfg

    def cfg(pp):
        return _cfg(pp=pp, schedule=variant)

    registry.check_config(cfg(2))
    with pytest.raises(ConfigError, match=f"--pipeline-schedule {variant} needs --pipeline-model-parallel-size >= 2"):
        registry.check_config(cfg(1))
    assert registry.train_class(variant) is WeiPipeSchedule


def _train_with_variant(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """A spawned rank: register the variant the same way (one entry), then pretrain()."""
    from harness.weipipe_gpt import train_many

    registry.SCHEDULES[NAME] = registry.weipipe(NAME, f"{__name__}:plan")
    return train_many(rank, world_size, argvs)


@pytest.mark.distributed
def test_variant_trains_gpt_like_the_reference():
    """pretrain_gpt's model under the new variant (ring of 2, G = 2, recomputation) equals
    the single-process run: losses, reduced gradients, parameters after 3 Adam steps."""
    from harness import run_distributed

    from harness.weipipe_gpt import argv, assert_matches, merge, train_many

    flags = dict(num_layers=4, global_batch_size=8)
    reference = merge(run_distributed(train_many, 1, [argv(**flags)], timeout=300), 0)
    ring = argv(pipeline_model_parallel_size=2, pipeline_schedule=NAME, recompute_granularity="full",
                recompute_method="uniform", log_interval=1, **flags)
    run = merge(run_distributed(_train_with_variant, 2, [ring], timeout=300), 0)
    assert f"> schedule {NAME}:" in run["log"]
    assert len(run["losses"]) == 3
    assert_matches(run, reference, NAME)


def test_variant_is_projected_by_the_cluster_simulator(variant):
    """The simulator reads the registry too: the new entry is simulated beside the built-in
    variants, and at these costs it takes the interleave grid's time (same compute per tick)."""
    from megatron_weipipe.simulator.cli import costs_for, parse_command
    from megatron_weipipe.simulator.project import simulate_run

    argv = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 1024 --global-batch-size 8 "
            f"--pipeline-model-parallel-size 2 --bf16 --schedules {variant},weipipe-interleave").split()
    a, cluster, specs = parse_command(argv)
    results = {s.schedule: simulate_run(s, cluster, costs_for(a, s, cluster)) for s in specs}
    assert set(results) == {variant, "weipipe-interleave"}
    ours, theirs = results[variant], results["weipipe-interleave"]
    assert ours.iteration_s > 0
    assert abs(ours.iteration_s - theirs.iteration_s) <= 0.25 * theirs.iteration_s
