"""Re-export for simulator/calibrate.py; the module is schedules/runtime/flat.py."""

from megatron_weipipe.schedules.runtime.flat import FlatLayout, ParamSlot  # noqa: F401
