"""Predict a row of the link testbed (tools/simulator_validation/link_testbed.py) from host microbenchmarks.

The testbed runs the trainer on two ranks, each pinned to its own core with one thread, over
a veth link shaped by tc to an emulated rate and latency, in float32 with torch's SDPA
attention, rope, no dropout, micro-batch 1. Its rows are PP = 2 pipelines (1f1b, interleaved
with 2 virtual stages, weipipe-interleave, weipipe-zb) and FSDP (PP = 1, DP = 2), this last
under each of FSDP2's options (no reshard after forward, one gradient sync per iteration,
both): ``TESTBED_ROWS`` is the one map from a row's name to what the trainer runs and what
the simulator replays. The prediction replays the same schedule with the costs of a
HostCalibration of the same shape (layer forward / backward, embedding, head, optimizer
step, timed by training/host_calibration.py), the trainer's fixed costs
(tools/simulator_validation/fsdp2_overhead.py: FSDP2's per unit, the training loop's per
iteration) and the emulated link as tc shapes it: its rate, its latency where netem applies
it, its token bucket where tbf shapes the rate alone, plus what a gloo message costs on this
host (training/host_calibration.py's link probe: CPU per byte;
tools/simulator_validation/message_delay.py: fixed seconds per message).
Nothing is fitted to the testbed's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron_weipipe.weight_pass import WeightPass
from megatron_weipipe.schedules import registry
from megatron_weipipe.shape import ModelShape

from .calibration import Fsdp2Overhead, HostCalibration
from .costs import from_calibration
from megatron_weipipe.errors import SimulatorError, require_simulable
from .hardware import CPU_HOST, Cluster, LinkSpec
from megatron_weipipe.simulator.rank_order import Layout
from .project import ScheduleResult, simulate_run
from .run_spec import RunSpec
from . import sharding
from .sharding import FsdpSharding

BYTE_LEVEL_VOCAB = 259  # ByteLevelTokenizer: 256 bytes, EOD, PAD, BOS (the testbed's --tokenizer-type)


@dataclass(frozen=True)
class TestbedRow:
    """One kind of testbed row: a pipeline of the two ranks under ``schedule``, or FSDP2
    over both (the registry's FSDP projection) with the options of ``sharding``."""

    name: str
    schedule: str  # the registry's name: what the trainer runs and the simulator replays
    sharding: FsdpSharding = FsdpSharding()

    @property
    def is_fsdp(self) -> bool:
        return registry.simulated(self.schedule).projection == registry.FSDP

    @property
    def virtual_stages(self) -> bool:
        return bool(registry.simulated(self.schedule).virtual_stages)

    def trainer_flags(self, layers: int) -> list[str]:
        """pretrain_gpt.py's flags of this row on two ranks (besides the model's)."""
        if self.is_fsdp:
            return ["--pipeline-model-parallel-size", "1", *sharding.trainer_flags(self.sharding)]
        extra = ["--num-layers-per-virtual-pipeline-stage", str(layers // 4)] if self.virtual_stages else []
        return ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", self.schedule, *extra]


TESTBED_ROWS = {r.name: r for r in (
    TestbedRow("1f1b", "1f1b"), TestbedRow("interleaved", "interleaved"),
    TestbedRow("weipipe-interleave", "weipipe-interleave"), TestbedRow("weipipe-zb", "weipipe-zb"),
    TestbedRow("fsdp", "fsdp"),
    TestbedRow("fsdp-no-reshard", "fsdp", FsdpSharding(reshard_after_forward=False)),
    TestbedRow("fsdp-sync-once", "fsdp", FsdpSharding(grad_sync_per_microbatch=False)),
    TestbedRow("fsdp-no-reshard-sync-once", "fsdp", FsdpSharding(reshard_after_forward=False,
                                                                 grad_sync_per_microbatch=False)),
)}
TESTBED_SCHEDULES = tuple(TESTBED_ROWS)  # the rows' names, in the tables' order
# HSDP shards inside a group and replicates across groups: on the testbed's two ranks a group
# of one rank is DDP over FSDP2, so HSDP has no row (it needs four ranks, the testbed has two cores)


def testbed_row(name: str) -> TestbedRow:
    require_simulable(name in TESTBED_ROWS, f"testbed row {name!r} is not one of {', '.join(TESTBED_ROWS)}")
    return TESTBED_ROWS[name]


@dataclass(frozen=True)
class TestbedShape:
    """The testbed's model (tools/simulator_validation/link_testbed.py's defaults)."""

    layers: int = 2
    hidden: int = 32
    heads: int = 2
    microbatches: int = 4  # per iteration, micro-batch 1 (the global batch)
    vocab_size: int = BYTE_LEVEL_VOCAB

    def model(self, seq: int) -> ModelShape:
        return ModelShape(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                          seq_length=seq, micro_batch_size=1, vocab_size=self.vocab_size,
                          position_embedding_type="rope", max_position_embeddings=seq,
                          untie_embeddings_and_output_weights=True)


def testbed_spec(schedule: str, seq: int, shape: TestbedShape = TestbedShape()) -> RunSpec:
    """The RunSpec of one testbed row (``schedule``: a name of ``TESTBED_ROWS``), validated
    by the training rules."""
    row = testbed_row(schedule)
    layout = Layout(pp=1, dp=2) if row.is_fsdp else Layout(pp=2)
    return RunSpec(shape=shape.model(seq), layout=layout, global_batch_size=shape.microbatches,
                   schedule=row.schedule, virtual_stages=2, compute_bytes=4, attention_impl="unfused+flash",
                   dropout=False, zero3=row.is_fsdp, fsdp=row.sharding).validate()


def testbed_cluster(rate_bytes_s: float, latency_s: float, cpu_s_per_byte: float = 0.0,
                    burst_bytes: float = 0.0) -> Cluster:
    """Two ranks with a core each, joined by the emulated link (``latency_s``: per message,
    the emulated latency and gloo's own fixed cost; ``burst_bytes``: tc tbf's bucket)."""
    require_simulable(rate_bytes_s > 0 and latency_s >= 0, "the emulated link needs a positive rate and a latency >= 0")
    link = LinkSpec("emulated", rate_bytes_s / 1e9, latency_s * 1e6, cpu_s_per_byte, burst_bytes)
    return Cluster(device=CPU_HOST, intra=link, inter=link, gpus_per_node=2).validate()


def predict_testbed_row(schedule: str, seq: int, rate_bytes_s: float, latency_s: float,
                        calibration: HostCalibration, shape: TestbedShape = TestbedShape(),
                        cpu_s_per_byte: Optional[float] = None, burst_bytes: float = 0.0,
                        fsdp2: Optional[Fsdp2Overhead] = None, message_s: float = 0.0,
                        loop_s: float = 0.0) -> ScheduleResult:
    """Predicted iteration (tokens/s, bytes) of one testbed row. ``calibration``: this host's
    timings of the same model shape and sequence (any chunk size; chunks scale per layer);
    ``fsdp2``: FSDP2's fixed costs of the same shape (the FSDP row without them counts its
    compute and bytes alone); ``message_s``: what a gloo message waits on this host beyond
    its bytes (tools/simulator_validation/message_delay.py), added to ``latency_s`` except where FSDP2's measured
    fixed costs already hold it; ``loop_s``: the training loop's own seconds per iteration
    outside the schedule and the optimizer step (tools/simulator_validation/fsdp2_overhead.py's DDP runs), added
    likewise (FSDP2's measured step holds it)."""
    spec = testbed_spec(schedule, seq, shape)
    c = calibration.shape
    if (c.hidden_size, c.num_attention_heads, c.seq_length) != (shape.hidden, shape.heads, seq):
        raise SimulatorError(f"the calibration is of h={c.hidden_size} heads={c.num_attention_heads} "
                             f"seq={c.seq_length}, the row of h={shape.hidden} heads={shape.heads} seq={seq}")
    if cpu_s_per_byte is None:
        cpu_s_per_byte = calibration.gloo_cpu_s_per_byte
    costs = from_calibration(calibration, spec.layers_per_chunk, recompute=False, weight_pass=WeightPass.STORED)
    if calibration.optimizer_per_param <= 0:
        costs = replace(costs, optimizer_per_param=0.0)
    fsdp_measured = testbed_row(schedule).is_fsdp and fsdp2 is not None
    if fsdp_measured:
        costs = replace(costs, fsdp_unit_forward=fsdp2.unit_forward_s, fsdp_unit_backward=fsdp2.unit_backward_s,
                        fsdp_step=fsdp2.step_s)
    else:
        latency_s += message_s
    res = simulate_run(spec, testbed_cluster(rate_bytes_s, latency_s, cpu_s_per_byte, burst_bytes), costs)
    if fsdp_measured or not loop_s:
        return res
    iteration = res.iteration_s + loop_s
    return replace(res, iteration_s=iteration, tokens_per_s=res.tokens_per_s * res.iteration_s / iteration,
                   phases={**res.phases, "training loop besides the schedule and the step": loop_s})


def order(values: dict) -> list:
    """Schedules from fastest to slowest."""
    return sorted(values, key=lambda k: -values[k])


def separated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two measured [min, max] ranges over rounds do not overlap: only then does
    the measurement order the two schedules."""
    return a[1] < b[0] or b[1] < a[0]


def ordered_pairs(measured: dict, predicted: dict) -> tuple[int, int]:
    """(pairs of schedules that both the measurement and the prediction order, of those the
    ones ordered alike). ``measured``: name -> (median, min, max) tokens/s over rounds;
    ``predicted``: name -> tokens/s, or (value, min, max) over the calibration sets it was
    predicted from. A pair whose measured rounds overlap is a tie the measurement cannot
    break, one whose predictions overlap a tie the calibrations cannot."""
    pred = {k: v if isinstance(v, tuple) else (v, v, v) for k, v in predicted.items()}
    names = list(measured)
    checked = alike = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if separated(measured[a][1:], measured[b][1:]) and separated(pred[a][1:], pred[b][1:]):
                checked += 1
                alike += (measured[a][0] > measured[b][0]) == (pred[a][0] > pred[b][0])
    return checked, alike


def order_matches(measured: dict, predicted: dict) -> bool:
    """Every pair that both sides order (`ordered_pairs`) is ordered alike; either order
    agrees with a tie."""
    checked, alike = ordered_pairs(measured, predicted)
    return checked == alike


def row_key(r: dict) -> tuple:
    """(preset, seq, microbatches, schedule) of a measured row: a group is one preset,
    sequence and batch (a row from before the testbed took several batches ran the default)."""
    return r["preset"], r["seq"], r.get("microbatches", TestbedShape.microbatches), r["schedule"]


def compare_rows(rows: list[dict], predicted: dict) -> list[dict]:
    """Measured vs predicted per row, and per (preset, seq, microbatches) whether the
    schedules' order (fastest first) is the same where the measurement and the prediction
    order them (`order_matches`). ``predicted``: `row_key` -> tokens/s, or (tokens/s, min,
    max) over calibration sets. The row's compute seconds per iteration (``busy_s_per_rank``,
    slowest rank) ride along."""
    groups: dict = {}
    for r in rows:
        key = row_key(r)
        if r.get("tokens_per_s") and key in predicted:
            busy = max(r["busy_s_per_rank"]) if r.get("busy_s_per_rank") else None
            rounds = r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]
            p = predicted[key] if isinstance(predicted[key], tuple) else (predicted[key],) * 3
            groups.setdefault(key[:3], {})[key[3]] = ((r["tokens_per_s"], min(rounds), max(rounds)), p,
                                                      r.get("bytes_sent"), busy)
    out = []
    for (preset, seq, mb), got in groups.items():
        checked, alike = ordered_pairs({k: v[0] for k, v in got.items()}, {k: v[1] for k, v in got.items()})
        for name, ((measured, _, _), pred, sent, busy) in got.items():
            out.append({"preset": preset, "seq": seq, "microbatches": mb, "schedule": name, "measured": measured,
                        "predicted": pred[0], "predicted_range": pred[1:], "error": pred[0] / measured - 1,
                        "bytes_sent": sent, "order_matches": checked == alike, "pairs": (checked, alike),
                        "computing_s": busy})
    return out
