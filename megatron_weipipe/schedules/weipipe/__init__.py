"""Old home of the WeiPipe schedule code, now in schedules/plan and schedules/runtime.

Only `flat` remains here, as a re-export: simulator/calibrate.py (outside the schedules
refactor) still imports it. Drop this package once that import reads
megatron_weipipe.schedules.runtime.flat.
"""
