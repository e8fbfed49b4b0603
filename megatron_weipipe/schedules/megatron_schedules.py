"""Re-export for simulator/calibrate.py; the module is schedules/train/megatron_schedules.py.
Drop it once that import reads megatron_weipipe.schedules.train.megatron_schedules."""

from megatron_weipipe.schedules.train.megatron_schedules import ddp_config, wrap_ddp  # noqa: F401
