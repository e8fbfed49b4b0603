"""A host calibration: measured seconds of a run's pieces on this machine, as data.

The measuring itself runs real megatron-core layers, so it lives with the tool that calls
it (training/host_calibration.py); the simulator only reads what it measured (costs.py) and
how busy the host was (``background_tasks``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from megatron_weipipe.shape import ModelShape


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds per microbatch for one chunk of `layers` decoder layers."""

    layers: int
    forward: float
    backward: float  # input and weight gradients in one pass
    backward_input: float  # input gradient only (graph kept)
    backward_weight: float  # weight gradient pass after backward_input


@dataclass(frozen=True)
class HostCalibration:
    shape: ModelShape
    module: ChunkTimes
    flat: ChunkTimes
    embed_forward: float
    embed_backward: float
    head_forward: float
    head_backward: float
    optimizer_per_param: float  # seconds per parameter for norm + clip + Adam step + zeroing
    repeats: int
    spread: dict = field(default_factory=dict)  # name -> (max - min) / median over repeats
    cpu_share: float = 1.0  # CPU seconds / wall seconds of the calibrating process (1: it had a core to itself)
    others_cores: float = 0.0  # cores other processes kept busy meanwhile, sibling calibrators included (/proc/stat)
    host_cores: int = 1
    gloo_gbs: Optional[float] = None  # gloo send/recv between two processes here, when measured
    gloo_latency_us: Optional[float] = None
    gloo_cpu_s_per_byte: float = 0.0
    clock: str = "cpu"  # what the structured fields hold: "cpu" seconds or "wall" seconds
    ranks: int = 1  # processes that calibrated at the same time (wall times then include their contention)
    medians: dict = field(default_factory=dict)  # name -> {"cpu": s, "wall": s}

    def in_clock(self, clock: str) -> "HostCalibration":
        """The same calibration with its times in CPU or in wall seconds."""
        med = {k: v[clock] for k, v in self.medians.items()}
        return replace(self, clock=clock, **calibration_fields(med, self.module.layers, self.optimizer_per_param > 0,
                                                    self.medians.get("params", {}).get(clock, 1.0)))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "HostCalibration":  # noqa: D102
        d = json.loads(text)
        d["shape"] = ModelShape(**d["shape"])
        d["module"] = ChunkTimes(**d["module"])
        d["flat"] = ChunkTimes(**d["flat"])
        return cls(**d)


@dataclass(frozen=True)
class Fsdp2Overhead:
    """FSDP2's fixed costs on this host (tools/simulator_validation/fsdp2_overhead.py: the trainer with and without
    ``--use-torch-fsdp2``, same model and data): seconds per unit and microbatch added to its
    forward and to its backward, and the iteration's seconds besides its microbatches (the
    optimizer over the sharded DTensors, the gradient norm). ``rounds``: the same three of
    each round of the probe (the fields are their medians). A difference of two runs' Python-
    bound costs, they spread by up to 20% within a probe and drift as much over hours, so a
    prediction takes each round as a calibration set of its own (`each_round`)."""

    unit_forward_s: float
    unit_backward_s: float
    step_s: float
    rounds: tuple[tuple[float, float, float], ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Fsdp2Overhead":  # noqa: D102
        d = json.loads(text)
        return cls(**dict(d, rounds=tuple(tuple(r) for r in d.get("rounds", ()))))

    def each_round(self) -> list["Fsdp2Overhead"]:
        """Each round's costs (this one where no round was recorded)."""
        return [Fsdp2Overhead(*r) for r in self.rounds] or [self]

    @classmethod
    def mean_of(cls, runs: list["Fsdp2Overhead"]) -> "Fsdp2Overhead":
        """Several measurements as one (their mean; the rounds of all)."""
        n = len(runs)
        return cls(sum(r.unit_forward_s for r in runs) / n, sum(r.unit_backward_s for r in runs) / n,
                   sum(r.step_s for r in runs) / n, tuple(x for r in runs for x in r.rounds))


def mean_of(cals: list[HostCalibration]) -> HostCalibration:
    """Several calibrations of one shape (timed before and after a run, say) as one: the
    mean of every timed field, the rest from the first."""
    if not cals:
        raise ValueError("no calibration to average")
    first = cals[0]
    if any(c.shape != first.shape or c.module.layers != first.module.layers for c in cals):
        raise ValueError("calibrations of different shapes or chunk sizes cannot be averaged")

    def mean(get):
        return sum(get(c) for c in cals) / len(cals)

    def chunk(get) -> ChunkTimes:
        return ChunkTimes(first.module.layers, *(mean(lambda c, f=f: getattr(get(c), f))
                                                 for f in ("forward", "backward", "backward_input", "backward_weight")))

    return replace(first, module=chunk(lambda c: c.module), flat=chunk(lambda c: c.flat),
                   embed_forward=mean(lambda c: c.embed_forward), embed_backward=mean(lambda c: c.embed_backward),
                   head_forward=mean(lambda c: c.head_forward), head_backward=mean(lambda c: c.head_backward),
                   optimizer_per_param=mean(lambda c: c.optimizer_per_param))


def calibration_fields(med: dict, k: int, optimizer: bool, n_params: float) -> dict:
    def chunk(name: str) -> ChunkTimes:
        return ChunkTimes(k, med[f"{name}.forward"], med[f"{name}.backward"], med[f"{name}.backward_input"],
                          med[f"{name}.backward_weight"])

    return dict(module=chunk("module"), flat=chunk("flat"), embed_forward=med["embed.forward"],
                embed_backward=med["embed.backward"], head_forward=med["head.forward"],
                head_backward=med["head.backward"],
                optimizer_per_param=med["optimizer.step"] / n_params if optimizer else 0.0)


def load(path: str) -> HostCalibration:
    with open(path) as f:
        return HostCalibration.from_json(f.read())


def save(cal: HostCalibration, path: Optional[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write(cal.to_json())


def background_tasks(cpu_share: float, others: float, cores: int, processes: int = 1) -> float:
    """CPU-bound tasks competing with the ranks (fair sharing: each of N runnable tasks gets
    cores / N), from what `processes` calibrating processes saw: each got `cpu_share` of a
    core and saw `others` cores busy besides itself (its sibling calibrators included).
    If they got less than a full core the host was saturated: N = cores / share, of which
    N - processes were others; otherwise the others' measured use is the count."""
    if cpu_share < 0.97:
        return max(0.0, cores / cpu_share - processes)
    return max(0.0, others - (processes - 1) * cpu_share)
