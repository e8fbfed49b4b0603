"""WeiPipe schedules train the real GPT exactly: losses, every reduced gradient of
every iteration and all parameters after 3 optimizer steps (Adam, clipping) equal a
single-process reference, for each schedule x ring size P in {2, 3, 4} x G in {1, 2, 3}
microbatches per ring rank, plus TP=2 and DP=2 around a ring of 2.

float32, dropout 0, layout-invariant initialisation (every layer drawn from its own
key, so the chunks differ). 2 layers per chunk; full recomputation for G = 2. One
spawned run per world size covers all its configurations.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile

import numpy as np
import pytest

from megatron_weipipe.schedules.ir.actions import Flow
from megatron_weipipe.schedules.timing.closed_forms import expected_messages
from harness import run_distributed
from harness.state import max_relative_difference
from megatron_weipipe.training.metrics import format_bytes

from harness.weipipe_gpt import RTOL, WEIPIPE, argv, assert_matches, merge, train_many

MICRO = 2


def _layers(P: int) -> int:
    return 2 * P


def _weipipe_args(name: str, P: int, G: int, dp: int = 1, recompute: bool = None, **extra) -> list[str]:
    recompute = G == 2 if recompute is None else recompute
    recompute = dict(recompute_granularity="full", recompute_method="uniform") if recompute else {}
    return argv(num_layers=_layers(P), global_batch_size=MICRO * G * P * dp, pipeline_model_parallel_size=P,
                pipeline_schedule=name, log_interval=1, **recompute, **extra)


def _reference_key(P: int, G: int, dp: int = 1, **model_flags) -> tuple:
    return (_layers(P), MICRO * G * P * dp, tuple(sorted(model_flags.items())))


# Llama-style: rotary embedding, RMSNorm, SwiGLU, no biases, untied output layer.
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True)


def _ring_configs(P: int) -> dict:
    configs = {(name, P, G): _weipipe_args(name, P, G) for name in WEIPIPE for G in (1, 2, 3)}
    # weipipe-zb (deferred weight GEMMs) also the other way round: recompute iff G != 2.
    configs.update({("weipipe-zb", P, G, "flip"): _weipipe_args("weipipe-zb", P, G, recompute=G != 2)
                    for G in (1, 2, 3)})
    return configs


EXTRA_WORLD4 = {
    "tp2-ring2-zb-G2": (_weipipe_args("weipipe-zb", 2, 2, tensor_model_parallel_size=2,
                                      make_vocab_size_divisible_by=256), _reference_key(2, 2)),
    "dp2-ring2-interleave-G2": (_weipipe_args("weipipe-interleave", 2, 2, dp=2), _reference_key(2, 2, dp=2)),
    "dp2-ring2-naive-G1": (_weipipe_args("weipipe-naive", 2, 1, dp=2), _reference_key(2, 1, dp=2)),
    "tp2-ring2-zb-G1": (_weipipe_args("weipipe-zb", 2, 1, tensor_model_parallel_size=2,
                                      make_vocab_size_divisible_by=256), _reference_key(2, 1)),
    "dp2-ring2-zb-G1": (_weipipe_args("weipipe-zb", 2, 1, dp=2), _reference_key(2, 1, dp=2)),
}
# The distributed optimizer reduce-scatters: each DP rank holds a gradient shard only,
# so losses and parameters are compared.
DISTOPT_WORLD4 = {
    "distopt-dp2-ring2-zb-G2": (_weipipe_args("weipipe-zb", 2, 2, dp=2, use_distributed_optimizer=True),
                                _reference_key(2, 2, dp=2)),
}


@functools.lru_cache(maxsize=None)
def _references() -> dict:
    keys = sorted({_reference_key(P, G) for P in (2, 3, 4) for G in (1, 2, 3)}
                  | {k for _, k in EXTRA_WORLD4.values()} | {k for _, k in EXTRA_WORLD2.values()}
                  | {k for _, k in DISTOPT_WORLD4.values()})
    per_rank = run_distributed(train_many, 1, [argv(num_layers=L, global_batch_size=g, **dict(flags))
                                               for L, g, flags in keys], timeout=300)
    return {k: merge(per_rank, i) for i, k in enumerate(keys)}


# Two runs also write per-action traces (--schedule-trace): tests/test_schedule_trace.py's
# end-to-end checks read them, sharing the runs.
TRACE_DIR = tempfile.mkdtemp(prefix="weipipe_trace_")
TRACES = {"llama-zb-G3": os.path.join(TRACE_DIR, "zb"), "fp32-1f1b": os.path.join(TRACE_DIR, "1f1b")}
EXTRA_WORLD2 = {
    "llama-interleave-G2": (_weipipe_args("weipipe-interleave", 2, 2, **LLAMA), _reference_key(2, 2, **LLAMA)),
    "llama-zb-G3": (_weipipe_args("weipipe-zb", 2, 3, schedule_trace=TRACES["llama-zb-G3"], **LLAMA),
                    _reference_key(2, 3, **LLAMA)),
}
# Dropout on: recomputation must replay the forward's RNG (same masks), so with and
# without it the run is the same.
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1, num_layers=4, global_batch_size=8,
               pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb")
DROPOUT_WORLD2 = {
    "dropout-recompute": argv(recompute_granularity="full", recompute_method="uniform", **DROPOUT),
    "dropout-plain": argv(**DROPOUT),
}
# bf16 weights and bf16 gradient messages, against the float32 run of the same model.
BF16_WORLD2 = {
    "bf16-zb": argv(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb", bf16=True, train_iters=5,
                    weipipe_grad_dtype="bf16", **LLAMA),
    "fp32-1f1b": argv(pipeline_model_parallel_size=2, train_iters=5, schedule_trace=TRACES["fp32-1f1b"], **LLAMA),
}


@functools.lru_cache(maxsize=None)
def _world(P: int) -> dict:
    configs = _ring_configs(P)
    if P == 2:
        configs.update({name: a for name, (a, _) in EXTRA_WORLD2.items()})
        configs.update(BF16_WORLD2)
        configs.update(DROPOUT_WORLD2)
    if P == 4:
        configs.update({name: a for name, (a, _) in {**EXTRA_WORLD4, **DISTOPT_WORLD4}.items()})
    per_rank = run_distributed(train_many, P, list(configs.values()), timeout=600)
    return {key: merge(per_rank, i) for i, key in enumerate(configs)}


@pytest.mark.distributed
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("G", [1, 2, 3])
@pytest.mark.parametrize("name", WEIPIPE)
def test_weipipe_gpt_matches_reference(name, P, G):
    run = _world(P)[(name, P, G)]
    reference = _references()[_reference_key(P, G)]
    assert len(run["losses"]) == 3
    assert_matches(run, reference, f"{name} P={P} G={G}")


@pytest.mark.distributed
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("G", [1, 2, 3])
def test_weipipe_zb_other_recompute_matches_reference(P, G):
    run = _world(P)[("weipipe-zb", P, G, "flip")]
    assert_matches(run, _references()[_reference_key(P, G)], f"weipipe-zb P={P} G={G} recompute={G != 2}")


@pytest.mark.distributed
@pytest.mark.parametrize("P", [2, 3, 4])
def test_zb_defers_every_linear_weight_gemm(P):
    """weipipe-zb runs the weight GEMMs of QKV, projection, FC1 and FC2 (4 per layer) at W,
    every (microbatch, chunk) of every iteration, with and without recomputation, and
    holds their inputs meanwhile; the other variants defer nothing."""
    for G in (1, 2, 3):
        for key in (("weipipe-zb", P, G), ("weipipe-zb", P, G, "flip")):
            for per_iter in _world(P)[key]["wgrad"]:
                assert len(per_iter) == 3, key
                for deferred, peak, deferrable in per_iter.values():
                    assert deferrable == 4 * 2, key  # 2 layers per chunk
                    assert deferred == deferrable * G * P, (key, deferred)
                    assert peak > 0, key
        for name in ("weipipe-interleave", "weipipe-naive"):
            for per_iter in _world(P)[(name, P, G)]["wgrad"]:
                assert all(d == 0 and b == 0 for d, b, _ in per_iter.values()), name
    for layout, G in (("tp2-ring2-zb-G1", 1), ("dp2-ring2-zb-G1", 1), ("tp2-ring2-zb-G2", 2)):
        for per_iter in _world(4)[layout]["wgrad"]:
            assert all(d == 8 * G * 2 for d, _, _ in per_iter.values()), layout


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(EXTRA_WORLD4))
def test_weipipe_gpt_with_tp_or_dp_matches_reference(layout):
    run = _world(4)[layout]
    assert_matches(run, _references()[EXTRA_WORLD4[layout][1]], layout)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(DISTOPT_WORLD4))
def test_weipipe_gpt_with_distributed_optimizer(layout):
    run, reference = _world(4)[layout], _references()[DISTOPT_WORLD4[layout][1]]
    for losses in run["loss_sets"]:
        np.testing.assert_allclose(losses, reference["losses"], rtol=RTOL)
    rel, where = max_relative_difference(run["params"], reference["params"])
    assert rel < RTOL, f"{layout}: parameter {where} differs by {rel:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(EXTRA_WORLD2))
def test_weipipe_llama_style_matches_reference(layout):
    run = _world(2)[layout]
    assert_matches(run, _references()[EXTRA_WORLD2[layout][1]], layout)


def test_reference_is_not_trivial():
    """Training moves the loss; different G are different references."""
    refs = _references()
    a, b = refs[_reference_key(2, 1)], refs[_reference_key(2, 2)]
    assert a["losses"][-1] < a["losses"][0]
    assert a["losses"] != b["losses"]


def _expected_sent(name: str, P: int, G: int, rank: int, numel: int, weight_bytes: int = 4,
                   grad_bytes: int = 4) -> dict:
    msgs = expected_messages(name, P, G, rank)
    weights = sum(n for f, n in msgs.items() if f is not Flow.GRADS)
    return {"weights": weights * numel * weight_bytes, "gradients": msgs[Flow.GRADS] * numel * grad_bytes}


@pytest.mark.distributed
@pytest.mark.parametrize("P", [2, 3, 4])
def test_bytes_per_rank_equal_the_closed_form(P):
    """Weight and gradient bytes each rank sends, every iteration, are the closed form of
    docs/how-it-works/weipipe.md (float32 chunks); the runtime's point-to-point traffic is counted once."""
    for name in WEIPIPE:
        for G in (1, 2, 3):
            run = _world(P)[(name, P, G)]
            for rank, (per_iter, numel) in enumerate(zip(run["sent"], run["chunk_numel"])):
                want = _expected_sent(name, P, G, rank, numel)
                for it, sent in per_iter.items():
                    got = {k: sent.get(k, 0) for k in want}
                    assert got == want, (name, P, G, rank, it, got, want)
                    assert "p2p" not in sent and "activations" not in sent, sent


@pytest.mark.distributed
def test_log_line_shows_weipipe_bytes():
    run = _world(2)[("weipipe-interleave", 2, 2)]
    want = _expected_sent("weipipe-interleave", 2, 2, 0, run["chunk_numel"][0])
    lines = [ln for ln in run["log"].splitlines() if "sent/rank/iter:" in ln]
    assert len(lines) == 3, run["log"]
    moved = dict(re.findall(r"(\w+)=([\d.]+[KMGT]?B)", lines[-1].split("sent/rank/iter:")[1]))
    assert moved["weights"] == format_bytes(want["weights"]), lines[-1]
    assert moved["gradients"] == format_bytes(want["gradients"]), lines[-1]
    assert "collectives" in moved and "activations" not in moved


@pytest.mark.distributed
def test_recompute_replays_dropout_masks():
    run, plain = _world(2)["dropout-recompute"], _world(2)["dropout-plain"]
    assert_matches(run, plain, "dropout with/without recompute", rtol=1e-6)


@pytest.mark.distributed
def test_bf16_with_bf16_gradient_messages_tracks_float32():
    """bf16 weights and gradients on the ring: not bit-equal to float32, but the same
    training curve; messages are 2 bytes per element."""
    wp, ref = _world(2)["bf16-zb"], _world(2)["fp32-1f1b"]
    np.testing.assert_allclose(wp["losses"], ref["losses"], rtol=2e-2)
    numel = wp["chunk_numel"][0]
    got = wp["sent"][0][1]
    want = _expected_sent("weipipe-zb", 2, 2, 0, numel, weight_bytes=2, grad_bytes=2)
    assert {k: got[k] for k in want} == want


@pytest.mark.distributed
def test_schedule_trace_has_every_action_of_the_plan():
    """--schedule-trace: per rank and iteration, one event per action of the rank's list
    (weipipe-zb P=2 G=3), one forward and one backward per microbatch for 1F1B, the
    optimizer step outside the iteration; the tool measures both."""
    import json
    import subprocess
    import sys
    from collections import Counter

    from megatron_weipipe.schedules.generate.weipipe import generate
    from megatron_weipipe.schedules.timing.measured import load, measure

    _world(2)  # the runs that write the traces
    plan = generate("weipipe-zb", 2, 3)
    for t in load(TRACES["llama-zb-G3"]):
        want = Counter(a.kind.value for a in plan.actions(t.meta["pipeline_rank"]))
        for it in (1, 2, 3):
            got = Counter(e["name"] for e in t.events if e["args"]["iteration"] == it
                          and e["cat"] not in ("iteration", "optimizer"))
            assert got == want, (t.rank, it, got, want)
        assert sum(e["cat"] == "optimizer" for e in t.events) == 3
    for t in load(TRACES["fp32-1f1b"]):
        for it in range(1, 6):
            got = Counter(e["name"] for e in t.events if e["args"]["iteration"] == it and e["cat"] == "compute")
            assert got == {"forward": 4, "backward": 4}, (t.rank, it, got)
    for name, d in TRACES.items():
        m = measure(load(d))
        assert 0 < m.measured_bubble < 1 and all(r.busy_s > 0 and r.idle_s > 0 for r in m.ranks), name
        proc = subprocess.run([sys.executable, "-m", "tools.schedule_timeline", "--from-trace", d, "--json"],
                              capture_output=True, text=True, timeout=120,
                              cwd=os.path.join(os.path.dirname(__file__), os.pardir))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["measured_bubble"] == pytest.approx(m.measured_bubble)
        assert [r["busy_s"] for r in out["ranks"]] == pytest.approx([r.busy_s for r in m.ranks])
        assert 0 < out["planned_bubble"] < 1, name
