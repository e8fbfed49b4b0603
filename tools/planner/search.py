"""The search: every structure the trainer accepts, climbed up the memory ladder to its
first rung that fits; the fits simulated in order of a bound on their iteration (the
busiest rank's compute), until the bound of the next is slower than the ``keep``-th fastest
simulated: those cannot reach the top and are not simulated (branch and bound)."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_weipipe.simulator.hardware import Cluster

from .evaluate import Evaluated, Evaluator
from .space import (DEFAULT_FPDT_CHUNKS, DataParallelMode, Rejections, accepted,
                    memory_ladder, structures, trainer_config)


@dataclass
class Plan:
    ranked: list[Evaluated]  # fastest first
    structures: int = 0  # structures proposed
    refused: int = 0  # structures the trainer refused
    too_big: int = 0  # accepted structures with no rung that fits
    bounded: int = 0  # fits not simulated: their bound is slower than the top
    simulations: int = 0
    seconds: float = 0.0
    rejections: Rejections = field(default_factory=Rejections)
    smallest_misfit: Optional[tuple[float, str]] = None  # (device bytes, layout) of the closest miss


def plan(base: Sequence[str], cluster: Cluster, nodes: int, *, keep: int = 5,
         schedules: Optional[Sequence[str]] = None, modes: Optional[Sequence[DataParallelMode]] = None,
         fpdt_chunks: Sequence[int] = DEFAULT_FPDT_CHUNKS, usable_fraction: float = 1.0,
         evaluator: Optional[Evaluator] = None, admit=None) -> Plan:
    """Rank the layouts of ``base`` (pretrain_gpt.py's flags without layout flags) on
    ``nodes`` nodes of ``cluster``: the ``keep`` fastest exactly, fastest first.
    ``admit``: a predicate on candidates (e.g. the layouts a measurement covers)."""
    started = time.time()
    world = nodes * cluster.gpus_per_node
    ev = evaluator or Evaluator(cluster, usable_fraction)
    base_cfg = trainer_config(base, 1)
    ladder = memory_ladder(base_cfg.data.seq_length, fpdt_chunks)
    out = Plan(ranked=[])
    fits = []
    for st in structures(world, cluster.gpus_per_node, base_cfg.model.num_layers, schedules, modes):
        out.structures += 1
        bare = accepted(base, st, ladder[0], world, out.rejections)
        if bare is None:
            out.refused += 1  # the bare structure refused: its rungs only add memory savings to it
            continue
        for rung in ladder:
            cand = bare if rung is ladder[0] else accepted(base, st, rung, world)
            if cand is None or (admit is not None and not admit(cand)):
                continue
            mem = ev.memory(cand)
            if ev.fits(mem, world):
                fits.append((ev.lower_bound(cand), len(fits), cand, mem))
                break
            if out.smallest_misfit is None or mem.device < out.smallest_misfit[0]:
                out.smallest_misfit = (mem.device, cand.describe())
        else:
            out.too_big += 1
    fits.sort(key=lambda f: f[:2])
    slowest_kept: list[float] = []  # max-heap (negated) of the ``keep`` fastest iterations so far
    for i, (bound, _, cand, mem) in enumerate(fits):
        if len(slowest_kept) >= keep and bound > -slowest_kept[0]:
            out.bounded = len(fits) - i
            break
        e = ev.evaluate(cand, mem)
        out.ranked.append(e)
        heapq.heappush(slowest_kept, -e.result.iteration_s)
        if len(slowest_kept) > keep:
            heapq.heappop(slowest_kept)
    out.ranked.sort(key=lambda e: -e.tokens_per_s)
    out.simulations = ev.simulations
    out.seconds = time.time() - started
    return out
