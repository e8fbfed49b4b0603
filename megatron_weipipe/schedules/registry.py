"""Every pipeline schedule, declared once (``--pipeline-schedule NAME``).

One entry per schedule says its name, its family (``megatron``: activations move stage
to stage; ``weipipe``: weights move around a ring), where its plan lives, where the
class that trains the GPT model lives and where its start-up rules live. All three are
import paths ("package.module:attribute"), loaded only when asked for, so this module
imports no torch, no megatron and nothing of megatron_weipipe at import time (the
simulator and the start-up checks read it without building a model). Every other list
of schedule names (the simulator's, the timeline tool's, the tests') derives from
``SCHEDULES``.

A new WeiPipe variant is one module with a ``plan(P, G)`` function (see
generate/weipipe_zb.py) plus one ``weipipe(...)`` line below; docs/weipipe.md has the recipe.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from megatron_weipipe.config import PretrainConfig

MEGATRON = "megatron"
WEIPIPE = "weipipe"

_GENERATE = "megatron_weipipe.schedules.generate"
_CHECK = "megatron_weipipe.schedules.check"
_TRAIN = "megatron_weipipe.schedules.gpt"


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule. ``plan``: for the weipipe family a ``plan(P, G) -> Plan`` compute
    plan (generate/builder.py derives the messages); for the megatron family the timeline
    builder ``(name, P, N, V) -> Schedule`` used to draw and time it (None: nothing to
    draw). ``train``: the TrainSchedule class pretrain() runs. ``rules``: a pure
    ``(cfg, name) -> None`` that raises ConfigError for flags the schedule cannot run."""

    name: str
    family: str
    plan: Optional[str]
    train: str
    rules: str


def megatron(name: str, timeline: Optional[str], rules: str) -> ScheduleEntry:
    """A schedule megatron-core runs (its forward_backward function)."""
    return ScheduleEntry(name, MEGATRON, timeline, f"{_TRAIN}.megatron_schedules:MegatronSchedule",
                         f"{_CHECK}.rules:{rules}")


def weipipe(name: str, plan: str) -> ScheduleEntry:
    """A WeiPipe variant: its compute plan; generation, validation, the runtime and the
    GPT training class are shared by every variant."""
    return ScheduleEntry(name, WEIPIPE, plan, f"{_TRAIN}.weipipe:WeiPipeSchedule", f"{_CHECK}.rules:check_weipipe")


SCHEDULES: dict[str, ScheduleEntry] = {e.name: e for e in (
    megatron("none", None, "check_no_pipelining"),
    megatron("1f1b", f"{_GENERATE}.megatron_timeline:megatron_timeline", "check_1f1b"),
    megatron("interleaved", f"{_GENERATE}.megatron_timeline:megatron_timeline", "check_interleaved"),
    weipipe("weipipe-naive", f"{_GENERATE}.weipipe_naive:plan"),
    weipipe("weipipe-interleave", f"{_GENERATE}.weipipe_interleave:plan"),
    weipipe("weipipe-zb", f"{_GENERATE}.weipipe_zb:plan"),
)}


# ------------------------------------------------------------------ names

def names() -> tuple[str, ...]:
    """Every schedule, in table order."""
    return tuple(SCHEDULES)


def megatron_names() -> tuple[str, ...]:
    return tuple(n for n, e in SCHEDULES.items() if e.family == MEGATRON)


def weipipe_names() -> tuple[str, ...]:
    return tuple(n for n, e in SCHEDULES.items() if e.family == WEIPIPE)


def plan_names() -> tuple[str, ...]:
    """Schedules with action lists to validate, time and draw (all but ``none``)."""
    return tuple(n for n, e in SCHEDULES.items() if e.plan is not None)


# ------------------------------------------------------------------ entries

def find(name: str) -> Optional[ScheduleEntry]:
    return SCHEDULES.get(name)


def entry(name: str) -> ScheduleEntry:
    """The entry of ``name``; ConfigError naming the flag if there is none."""
    found = SCHEDULES.get(name)
    if found is None:
        from megatron_weipipe.config import ConfigError

        raise ConfigError(
            f"--pipeline-schedule {name!r} is unknown; choose one of: {', '.join(sorted(SCHEDULES))}"
        )
    return found


def load(target: str) -> Any:
    """The object an import path 'package.module:attribute' names."""
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def plan_function(name: str) -> Callable:
    e = entry(name)
    if e.plan is None:
        raise ValueError(f"schedule {name!r} has no plan")
    return load(e.plan)


def train_class(name: str):
    """The TrainSchedule class of ``name`` (imports torch and megatron-core)."""
    return load(entry(name).train)


def rules(name: str) -> Callable[[Any, str], None]:
    return load(entry(name).rules)


# ------------------------------------------------------------------ configuration

def default_schedule_name(cfg: "PretrainConfig") -> str:
    if cfg.parallel.pipeline_model_parallel_size == 1:
        return "none"
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        return "interleaved"
    return "1f1b"


def schedule_name(cfg: "PretrainConfig") -> str:
    """--pipeline-schedule, or the default for the parallel layout."""
    return cfg.parallel.pipeline_schedule or default_schedule_name(cfg)


def check_config(cfg: "PretrainConfig") -> None:
    """Run the start-up rules of the configured schedule: ConfigError with one sentence
    for an unknown name or a flag combination the schedule cannot run."""
    name = schedule_name(cfg)
    rules(name)(cfg, name)
