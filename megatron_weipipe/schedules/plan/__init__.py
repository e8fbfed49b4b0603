"""Schedules as data: pure Python, no torch, no process group.

The action IR (actions.py), WeiPipe's message builder (builder.py) and one module per
WeiPipe variant holding its compute plan (weipipe_*.py, dispatched by generate.py
through the registry), Megatron's 1F1B / interleaved timelines (timeline.py), the
execution walker (execution.py), the validator (validate.py), metrics and closed forms
(metrics.py), the event core (events.py) with the tick simulator on it (simulate.py),
and every schedule's start-up rules (rules.py). The torch runtime is in
schedules/runtime, the GPT training adapter in schedules/train.
"""

from .actions import Action, Buffer, Flow, Kind, Schedule, ScheduleError
from .generate import generate
from .simulate import DEFAULT_COSTS, Timing, simulate
from .timeline import build, megatron_timeline, tick_table
from .validate import validate

__all__ = [
    "Action",
    "Buffer",
    "DEFAULT_COSTS",
    "Flow",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Timing",
    "build",
    "generate",
    "megatron_timeline",
    "simulate",
    "tick_table",
    "validate",
]
