"""The layouts to try: every combination of parallel sizes, schedule, data-parallel mode and
memory saving the trainer itself accepts.

A layout is a set of pretrain_gpt.py flags. Which ones the trainer accepts is decided by
its own start-up code (``megatron_weipipe.arguments.parse_config``, what pretrain_gpt.py
runs on its command line), never by rules copied here: the enumeration proposes, the
trainer refuses. Two tables make the space, so that a new data-parallel mode (HSDP,
optimizer offload) or a new memory saving is one more entry:

- ``DATA_PARALLEL_MODES``: how the model state is kept over data-parallel ranks;
- ``MEMORY_LADDER``: the ways to trade time for device memory, cheapest first. For one
  structure (sizes, schedule, data-parallel mode) the first rung that fits is the fastest
  that fits; later rungs only recompute or move more, so they are never better and are not
  simulated.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from megatron_weipipe.config import ConfigError, PretrainConfig
from megatron_weipipe.schedules import registry

# Flags the planner chooses; a command line that gives one is refused (the planner would
# contradict it).
LAYOUT_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--pipeline-schedule", "--sequence-parallel",
    "--use-distributed-optimizer", "--use-torch-fsdp2", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--recompute-activations", "--recompute-modules", "--offload-layer-inputs",
    "--fpdt", "--fpdt-chunk-size", "--fpdt-offload",
)


@dataclass(frozen=True)
class DataParallelMode:
    """How the model state is kept over the data x context parallel ranks."""

    name: str
    flags: tuple[str, ...]
    sharded: bool  # needs more than one data x context parallel rank to differ from ``ddp``


DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = (
    DataParallelMode("ddp", (), sharded=False),
    DataParallelMode("distopt", ("--use-distributed-optimizer",), sharded=True),
    DataParallelMode("fsdp2", ("--use-torch-fsdp2",), sharded=True),
    # FSDP2's options trade device memory for fewer collectives (the estimator counts both)
    DataParallelMode("fsdp2, no reshard", ("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"),
                     sharded=True),
    DataParallelMode("fsdp2, grad sync once", ("--use-torch-fsdp2", "--torch-fsdp2-no-grad-sync-per-microbatch"),
                     sharded=True),
    DataParallelMode("fsdp2, no reshard, grad sync once",
                     ("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward",
                      "--torch-fsdp2-no-grad-sync-per-microbatch"), sharded=True),
    # weights, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy): differs
    # from ddp even on one rank
    DataParallelMode("fsdp2, state on host", ("--use-torch-fsdp2", "--optimizer-cpu-offload"), sharded=False),
)


def hsdp_mode(nodes: int) -> DataParallelMode:
    """FSDP2 sharded inside a node and replicated across the ``nodes``."""
    return DataParallelMode(f"hsdp x{nodes}", ("--use-torch-fsdp2", "--num-distributed-optimizer-instances",
                                                str(nodes)), sharded=True)


@dataclass(frozen=True)
class Rung:
    """One way of saving device memory; ``chunk`` is FPDT's chunk (None: no FPDT)."""

    name: str
    flags: tuple[str, ...]
    fpdt_chunk: Optional[int] = None


FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform")


def memory_ladder(seq_length: int, chunks: Sequence[int]) -> tuple[Rung, ...]:
    """The rungs, cheapest first: no saving, selective and full recomputation, layer inputs
    on the host, then FPDT (each chunk, largest first; then with its chunks on the host)."""
    rungs = [Rung("none", ()), Rung("selective", ("--recompute-granularity", "selective")),
             Rung("full", FULL), Rung("full+offload-inputs", FULL + ("--offload-layer-inputs",))]
    fitting = [c for c in sorted(set(chunks), reverse=True) if c < seq_length]
    for c in fitting:
        rungs.append(Rung(f"fpdt {c}", FULL + ("--fpdt", "--fpdt-chunk-size", str(c)), c))
    for c in fitting:
        rungs.append(Rung(f"fpdt {c} offload", FULL + ("--fpdt", "--fpdt-chunk-size", str(c), "--fpdt-offload"), c))
    for c in fitting:
        rungs.append(Rung(f"fpdt {c} offload+inputs", FULL + ("--fpdt", "--fpdt-chunk-size", str(c), "--fpdt-offload",
                                                              "--offload-layer-inputs"), c))
    return tuple(rungs)


DEFAULT_FPDT_CHUNKS = (65536, 16384, 8192)


@dataclass(frozen=True)
class Structure:
    """Sizes, schedule and data-parallel mode: what the memory ladder is climbed for."""

    tp: int
    cp: int
    pp: int
    dp: int
    schedule: Optional[str]  # None: no pipeline (PP = 1)
    virtual_layers: Optional[int]  # --num-layers-per-virtual-pipeline-stage
    mode: DataParallelMode

    def flags(self) -> list[str]:
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--context-parallel-size", str(self.cp)]
        if self.tp > 1:
            out.append("--sequence-parallel")
        if self.schedule is not None:
            out += ["--pipeline-schedule", self.schedule]
        if self.virtual_layers is not None:
            out += ["--num-layers-per-virtual-pipeline-stage", str(self.virtual_layers)]
        return out + list(self.mode.flags)

    def describe(self) -> str:
        sched = self.schedule or "no pipeline"
        if self.virtual_layers is not None:
            sched += f" ({self.virtual_layers} layers/virtual stage)"
        return f"TP {self.tp} CP {self.cp} PP {self.pp} DP {self.dp}, {sched}, {self.mode.name}"


@dataclass(frozen=True)
class Candidate:
    """A whole layout: a structure at one rung of the memory ladder, and the trainer's
    configuration of it (``config``: what parse_config made of ``flags``)."""

    structure: Structure
    rung: Rung
    flags: tuple[str, ...]  # the layout's flags alone (the user's come before them)
    config: PretrainConfig = field(compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.structure.describe()}, {self.rung.name}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structures(world: int, gpus_per_node: int, num_layers: int,
               schedules: Optional[Sequence[str]] = None,
               modes: Optional[Sequence[DataParallelMode]] = None,
               virtual_stages: Sequence[int] = (2, 4)) -> Iterator[Structure]:
    """Every combination of sizes, schedule and mode worth asking the trainer about: TP
    within a node (a tensor-parallel group spread over nodes all-reduces every layer over
    the slow link), CP, PP dividing the world; every pipeline schedule at PP > 1 (interleaved
    at each of ``virtual_stages`` model chunks per rank); the sharded modes only where there
    is more than one data x context parallel rank to shard over; HSDP (replicated across
    nodes) where more than one node's data x context parallel ranks shard the model."""
    names = [n for n in (schedules or registry.pipeline_names())]
    nodes = world // gpus_per_node
    if modes is None:
        modes = DATA_PARALLEL_MODES + ((hsdp_mode(nodes),) if nodes > 1 else ())
    for tp in divisors(min(world, gpus_per_node)):
        if gpus_per_node % tp:
            continue
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp == 1:
                    options = [(None, None)]
                else:
                    options = []
                    for n in names:
                        if registry.entry(n).virtual_stages:
                            options += [(n, num_layers // (pp * v)) for v in virtual_stages
                                        if num_layers % (pp * v) == 0]
                        else:
                            options.append((n, None))
                for schedule, virtual in options:
                    for mode in modes:
                        if mode.sharded and dp * cp == 1:
                            continue
                        if mode.name.startswith("hsdp") and (dp * cp % nodes or dp * cp == nodes):
                            continue
                        yield Structure(tp, cp, pp, dp, schedule, virtual, mode)


def trainer_config(argv: Sequence[str], world: int) -> PretrainConfig:
    """What pretrain_gpt.py makes of ``argv`` at ``world`` ranks: its own parse, defaults
    and every start-up rule (raises ConfigError with the trainer's one line)."""
    from megatron_weipipe.arguments import parse_config

    level = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the trainer's notices (flags it turns off) are not the planner's output
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parse_config(list(argv), world)
    except SystemExit:  # argparse: a flag the trainer does not know, or a bad value
        lines = said.getvalue().strip().splitlines() or ["pretrain_gpt.py refuses the flags"]
        raise ConfigError(lines[-1]) from None
    finally:
        logging.disable(level)


@dataclass
class Rejections:
    """Why layouts were refused, by the trainer's message, counted."""

    counts: dict = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def most_common(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]


def accepted(base: Sequence[str], structure: Structure, rung: Rung, world: int,
             rejections: Optional[Rejections] = None) -> Optional[Candidate]:
    """The candidate if the trainer accepts ``base`` + the layout's flags, else None."""
    flags = tuple(structure.flags()) + rung.flags
    try:
        cfg = trainer_config(list(base) + list(flags), world)
    except ConfigError as e:
        if rejections is not None:
            rejections.add(str(e))
        return None
    return Candidate(structure, rung, flags, cfg)


def given_layout_flags(argv: Sequence[str]) -> list[str]:
    """The layout flags a command line gives (the planner chooses those)."""
    return [a.split("=")[0] for a in argv if a.split("=")[0] in LAYOUT_FLAGS]

