"""WeiPipe: weight-pipeline schedules as data, their validator, metrics and runtime.

The runtime (torch.distributed) lives in `.runtime`; everything exported here is plain
data and pure functions usable without a process group.
"""

from .actions import Action, Buffer, Flow, Kind, Schedule, ScheduleError
from .generate import SCHEDULES, generate
from .simulate import DEFAULT_COSTS, Timing, simulate
from .validate import validate

__all__ = [
    "Action",
    "Buffer",
    "DEFAULT_COSTS",
    "Flow",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "Timing",
    "generate",
    "simulate",
    "validate",
]
