"""WeiPipe: weight-pipeline schedules as data, their validator, metrics and runtime."""

from .actions import Action, Buffer, Flow, Kind, Schedule, ScheduleError
from .generate import SCHEDULES, generate
from .validate import validate

__all__ = [
    "Action",
    "Buffer",
    "Flow",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "generate",
    "validate",
]
