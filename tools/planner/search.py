"""The search: every structure the trainer accepts, climbed up the memory ladder to its
first rung that fits, simulated once, ranked by tokens per second."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_weipipe.simulator.hardware import Cluster

from .evaluate import Evaluated, Evaluator
from .space import (DATA_PARALLEL_MODES, DEFAULT_FPDT_CHUNKS, DataParallelMode, Rejections, accepted,
                    memory_ladder, structures)


@dataclass
class Plan:
    ranked: list[Evaluated]  # fastest first
    structures: int = 0  # structures proposed
    refused: int = 0  # structures the trainer refused
    too_big: int = 0  # accepted structures with no rung that fits
    simulations: int = 0
    seconds: float = 0.0
    rejections: Rejections = field(default_factory=Rejections)
    smallest_misfit: Optional[tuple[float, str]] = None  # (device bytes, layout) of the closest miss


def plan(base: Sequence[str], cluster: Cluster, nodes: int, *, schedules: Optional[Sequence[str]] = None,
         modes: Sequence[DataParallelMode] = DATA_PARALLEL_MODES, fpdt_chunks: Sequence[int] = DEFAULT_FPDT_CHUNKS,
         usable_fraction: float = 1.0, evaluator: Optional[Evaluator] = None) -> Plan:
    """Rank every layout of ``base`` (pretrain_gpt.py's flags without layout flags) on
    ``nodes`` nodes of ``cluster``."""
    from .space import trainer_config

    started = time.time()
    world = nodes * cluster.gpus_per_node
    ev = evaluator or Evaluator(cluster, usable_fraction)
    base_cfg = trainer_config(base, 1)
    ladder = memory_ladder(base_cfg.data.seq_length, fpdt_chunks)
    out = Plan(ranked=[])
    for st in structures(world, cluster.gpus_per_node, base_cfg.model.num_layers, schedules, modes):
        out.structures += 1
        if accepted(base, st, ladder[0], world, out.rejections) is None and st.cp >= 1:
            # the bare structure refused: its rungs only add memory savings to it
            bare_refused = True
        else:
            bare_refused = False
        if bare_refused:
            out.refused += 1
            continue
        for rung in ladder:
            cand = accepted(base, st, rung, world)
            if cand is None:
                continue
            mem = ev.memory(cand)
            if ev.fits(mem, world):
                out.ranked.append(ev.evaluate(cand, mem))
                break
            if out.smallest_misfit is None or mem.device < out.smallest_misfit[0]:
                out.smallest_misfit = (mem.device, cand.describe())
        else:
            out.too_big += 1
    out.ranked.sort(key=lambda e: -e.tokens_per_s)
    out.simulations = ev.simulations
    out.seconds = time.time() - started
    return out
