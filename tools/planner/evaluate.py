"""A candidate's bytes per rank (the dry run's estimator) and speed (the simulator).

Memory is ``megatron_weipipe.simulator.project.rank_memory``, what tools/dry_run.py's
estimator reports, for the layers the simulator prices on a GPU (Transformer Engine's, flash
attention). Speed is ``simulate_run``: the replay of the schedule's action lists and what
pretrain() runs after them; an FSDP2 layout is timed by the simulator's FSDP projection
(per-unit gathers and reduce-scatters), its memory by the estimator of
``--use-torch-fsdp2``. Both are memoized: one schedule's action lists per (schedule, P,
microbatches, virtual stages; run_spec's), one cost model and one simulation per distinct run (a RunSpec compares every
field the simulator reads and nothing else).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace
from typing import Optional

from megatron_weipipe.schedules import registry
from megatron_weipipe.simulator.cli import costs_for
from megatron_weipipe.simulator.fpdt import analyse
from megatron_weipipe.simulator.hardware import GB, Cluster
from megatron_weipipe.simulator.project import ScheduleResult, rank_memory, simulate_run
from megatron_weipipe.simulator.run_spec import RunSpec, spec_from_config

from .space import Candidate

_FLOP_COSTS = types.SimpleNamespace(calibrated=False)  # costs from the device preset, as tools/simulate.py's default


@dataclass(frozen=True)
class Memory:
    device: float  # the heaviest rank's accelerator peak, bytes
    host: float  # the heaviest rank's host bytes (offload)
    per_rank_device: tuple[float, ...]


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    memory: Memory
    result: ScheduleResult

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s

    @property
    def mfu(self) -> Optional[float]:
        return self.result.mfu


class Evaluator:
    """Memory and speed of candidates on one cluster, memoized."""

    def __init__(self, cluster: Cluster, usable_fraction: float = 1.0):
        self.cluster = cluster
        self.device_cap = cluster.device.memory_gb * GB * usable_fraction
        self.host_cap = cluster.host_memory_gb * GB
        self._memory: dict = {}
        self._runs: dict = {}
        self.simulations = 0

    # ------------------------------------------------------------ memory
    def spec(self, c: Candidate) -> RunSpec:
        return spec_from_config(c.config, attention_impl="flash")

    def _schedule(self, spec: RunSpec):
        return spec.build_schedule()  # memoized by its sizes (run_spec)

    def memory(self, c: Candidate) -> Memory:
        spec = self.spec(c)
        if spec not in self._memory:
            lay = spec.layout
            fp = None
            if spec.fpdt is not None:
                fp = analyse(spec.shape, spec.fpdt, self.cluster, cp=lay.cp, tp=lay.tp, dtype_bytes=spec.compute_bytes)
            ranks = rank_memory(spec, self._schedule(spec), fp)
            device = tuple(m.total + m.chunk_state for m in ranks)
            self._memory[spec] = Memory(max(device), max(m.host for m in ranks), device)
        return self._memory[spec]

    def fits(self, m: Memory, world: int) -> bool:
        """The heaviest rank within the device's memory, the node's ranks' host bytes within
        the node's host memory."""
        per_node = min(self.cluster.gpus_per_node, world)
        return m.device <= self.device_cap and m.host * per_node <= self.host_cap

    # ------------------------------------------------------------ speed
    def timed_spec(self, c: Candidate) -> RunSpec:
        """The spec the simulator times: an FSDP2 layout through its FSDP projection."""
        spec = self.spec(c)
        if spec.torch_fsdp2:
            fsdp = next(n for n, e in registry.BASELINES.items() if e.projection == registry.FSDP)
            spec = replace(spec, schedule=fsdp)
        return spec

    def _costs(self, spec: RunSpec):
        key = ("costs", spec)
        if key not in self._runs:
            self._runs[key] = costs_for(_FLOP_COSTS, spec, self.cluster)
        return self._runs[key]

    def lower_bound(self, c: Candidate) -> float:
        """Seconds no iteration of the candidate can beat, without replaying it: the busiest
        rank's compute of the action lists (each rank computes one action at a time)."""
        spec = self.timed_spec(c)
        schedule = self._schedule(spec)
        duration = self._costs(spec).duration(schedule)
        return max(sum(duration(a) for a in acts) for acts in schedule.ranks) / spec.kernel_efficiency

    def run(self, c: Candidate) -> ScheduleResult:
        spec = self.timed_spec(c)
        if spec not in self._runs:
            self.simulations += 1
            self._runs[spec] = simulate_run(spec, self.cluster, self._costs(spec))
        return self._runs[spec]

    def evaluate(self, c: Candidate, memory: Optional[Memory] = None) -> Evaluated:
        return Evaluated(c, memory or self.memory(c), self.run(c))
