"""Every pipeline schedule, declared once (``--pipeline-schedule NAME``), and every fact of one.

One entry per schedule says its name, its family (``megatron``: activations move stage
to stage; ``weipipe``: weights move around a ring), where its action lists come from,
the class that trains the GPT model, its start-up rules, and what the simulator and the
tools branch on (whether it is a pipeline, whether it has virtual stages, how its
runtime posts messages, how the simulator projects it). Code paths are import paths
("package.module:attribute"), loaded only when asked for, so this module imports no
torch, no megatron and nothing of megatron_weipipe at import time (the simulator and the
start-up checks read it without building a model). ``BASELINES`` holds the schedules
the simulator compares with but training does not run. Every other list of schedule
names (the simulator's, the timeline tool's, the tests') derives from these two tables.

A new WeiPipe variant is one module with a ``plan(P, G)`` function (see
generate/weipipe_zb.py) plus one ``weipipe(...)`` line below; docs/reference/schedules.md has the recipe.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from megatron_weipipe.config import PretrainConfig

MEGATRON = "megatron"
WEIPIPE = "weipipe"

# How a runtime posts a schedule's messages (the posting rules of timing/replay.py):
# megatron-core's p2p calls, posted together and waited for before the rank computes
# again, or sends and receives posted ahead and waited for only where the data is needed.
BLOCKING = "blocking"
ASYNC = "async"

# How the simulator projects a schedule: the replay of its action lists, N x the
# slowest stage of its base's replay (no bubble, no wire), or FSDP's unit-by-unit model
# on the same GPUs as data-parallel ranks (simulator/baselines.py).
REPLAY = "replay"
FLOOR = "floor"
FSDP = "fsdp"
TAWPIPE = "tawpipe"  # TawPipe's closed-form cost (simulator/topology.py) on its base's replay

_GENERATE = "megatron_weipipe.schedules.generate"
_CHECK = "megatron_weipipe.schedules.check"
_TRAIN = "megatron_weipipe.schedules.gpt"


@dataclass(frozen=True)
class ScheduleEntry:
    """One schedule and its facts.

    ``compute_plan`` (weipipe family): ``plan(P, G) -> Plan``, the compute plan from which
    generate/builder.py derives the messages. ``timeline`` (megatron family):
    ``(name, P, N, V) -> Schedule``, the action lists used to draw and time it.
    ``costed_timeline``: ``(P, N, (F, I, W)) -> Schedule``, lists ordered for one stage's
    costs (zb-h1). ``train``: the TrainSchedule class pretrain() runs, ``rules``: a pure
    ``(cfg, name) -> None`` that raises ConfigError for flags the schedule cannot run
    (both None for a baseline, which ``trained_as``'s rules check). ``replayed_as``: the
    schedule whose lists the simulator replays for this one (``none``: one stage's 1F1B
    list; a floor or FSDP projection: its base)."""

    name: str
    family: str
    train: Optional[str] = None
    rules: Optional[str] = None
    compute_plan: Optional[str] = None
    timeline: Optional[str] = None
    costed_timeline: Optional[str] = None
    pipelined: bool = True  # a pipeline of at least 2 stages (or ring ranks)
    virtual_stages: bool = False  # model chunks per rank > 1 (--num-layers-per-virtual-pipeline-stage)
    posting: str = BLOCKING
    projection: str = REPLAY
    replayed_as: Optional[str] = None
    trained_as: Optional[str] = None  # a baseline: the trained schedule whose rules it obeys
    compared_by_default: bool = True  # among the simulator's default comparison at PP > 1

    @property
    def has_lists(self) -> bool:
        """Whether it has action lists of its own to validate, time and draw."""
        return self.compute_plan is not None or self.timeline is not None

    @property
    def is_weipipe(self) -> bool:
        return self.family == WEIPIPE


_MEGATRON_TIMELINE = f"{_GENERATE}.megatron_timeline:megatron_timeline"


def megatron(name: str, rules: str, **facts: Any) -> ScheduleEntry:
    """A schedule megatron-core runs (its forward_backward function)."""
    return ScheduleEntry(name, MEGATRON, train=f"{_TRAIN}.megatron_schedules:MegatronSchedule",
                         rules=f"{_CHECK}.rules:{rules}", **facts)


def weipipe(name: str, plan: str, **facts: Any) -> ScheduleEntry:
    """A WeiPipe variant: its compute plan; generation, validation, the runtime (sends and
    receives posted ahead around the ring) and the GPT training class are shared by every variant."""
    return ScheduleEntry(name, WEIPIPE, train=f"{_TRAIN}.weipipe:WeiPipeSchedule", rules=f"{_CHECK}.rules:check_weipipe",
                         compute_plan=plan, posting=ASYNC, **facts)


def baseline(name: str, trained_as: str, **facts: Any) -> ScheduleEntry:
    """A schedule the simulator compares with but training does not run."""
    return ScheduleEntry(name, MEGATRON, trained_as=trained_as, compared_by_default=False, **facts)


SCHEDULES: dict[str, ScheduleEntry] = {e.name: e for e in (
    megatron("none", "check_no_pipelining", pipelined=False, replayed_as="1f1b"),
    megatron("1f1b", "check_1f1b", timeline=_MEGATRON_TIMELINE),
    megatron("interleaved", "check_interleaved", timeline=_MEGATRON_TIMELINE, virtual_stages=True),
    # the reference variant (every microbatch group waits for the whole ring), slower by design
    weipipe("weipipe-naive", f"{_GENERATE}.weipipe_naive:plan", compared_by_default=False),
    weipipe("weipipe-interleave", f"{_GENERATE}.weipipe_interleave:plan"),
    weipipe("weipipe-zb", f"{_GENERATE}.weipipe_zb:plan"),
)}

# ZB-H1 (a 1F1B pipeline with a split backward; no runtime runs it, so its sends are
# replayed as posted ahead, the way a zero-bubble runtime overlaps them), the floor of
# any activation pipeline, FSDP / ZeRO-3 (no pipeline: PP = 1, data parallel over the
# same GPUs), each checked by the training rules of the schedule it is closest to.
BASELINES: dict[str, ScheduleEntry] = {e.name: e for e in (
    baseline("zb-h1", "1f1b", costed_timeline=f"{_GENERATE}.zb_h1:zb_h1_timeline", posting=ASYNC),
    baseline("floor", "1f1b", projection=FLOOR, replayed_as="1f1b"),
    baseline("fsdp", "none", projection=FSDP, replayed_as="none", pipelined=False),
    baseline("tawpipe", "weipipe-interleave", projection=TAWPIPE, replayed_as="weipipe-interleave"),
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
    return tuple(n for n, e in SCHEDULES.items() if e.has_lists)


def pipeline_names() -> tuple[str, ...]:
    """Every trained schedule that is a pipeline (all but ``none``)."""
    return tuple(n for n, e in SCHEDULES.items() if e.pipelined)


def simulated_names() -> tuple[str, ...]:
    """Every name the simulator takes: the trained schedules, then the baselines."""
    return names() + tuple(BASELINES)


def compared_by_default() -> tuple[str, ...]:
    """The pipelines the simulator compares when no schedule is named."""
    return tuple(n for n, e in SCHEDULES.items() if e.pipelined and e.compared_by_default)


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


def simulated(name: str) -> Optional[ScheduleEntry]:
    """The entry of a trained schedule or of a simulator baseline; None if neither."""
    return SCHEDULES.get(name) or BASELINES.get(name)


def training_entry(name: str) -> ScheduleEntry:
    """The trained schedule whose rules a simulated schedule obeys (itself unless a baseline)."""
    e = simulated(name)
    return entry(e.trained_as) if e is not None and e.trained_as is not None else entry(name)


def plan_function(name: str) -> Callable:
    e = entry(name)
    if e.compute_plan is None:
        raise ValueError(f"schedule {name!r} has no compute plan")
    return load(e.compute_plan)


def train_class(name: str):
    """The TrainSchedule class of ``name`` (imports torch and megatron-core)."""
    return load(entry(name).train)


def rules(name: str) -> Callable[[Any, str], None]:
    return load(entry(name).rules)


# ------------------------------------------------------------------ configuration

def default_schedule_name(cfg: "PretrainConfig") -> str:
    """Megatron's choice for the layout: no pipeline at PP = 1, the pipeline with virtual
    stages when they are given, else the plain one (1f1b)."""
    p = cfg.parallel
    pipelined = p.pipeline_model_parallel_size > 1
    virtual = p.num_layers_per_virtual_pipeline_stage is not None
    return next(n for n, e in SCHEDULES.items() if e.family == MEGATRON and e.pipelined == pipelined
                and (not pipelined or e.virtual_stages == virtual))


def schedule_name(cfg: "PretrainConfig") -> str:
    """--pipeline-schedule, or the default for the parallel layout."""
    return cfg.parallel.pipeline_schedule or default_schedule_name(cfg)


def check_config(cfg: "PretrainConfig") -> None:
    """Run the start-up rules of the configured schedule: ConfigError with one sentence
    for an unknown name or a flag combination the schedule cannot run."""
    name = schedule_name(cfg)
    rules(name)(cfg, name)
