"""The services a run hands down: process groups, the platform and the byte counter.

Built once by ``initialize.initialize_distributed`` and passed to whatever needs them
(schedules, checkpointing, logging), the way megatron-core's newer code passes a
``ProcessGroupCollection`` instead of reading globals deep inside.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_weipipe.byte_counter import ByteCounter
from megatron_weipipe.parallel import ParallelGroups
from megatron_weipipe.platform import Platform


@dataclass(frozen=True)
class RunContext:
    groups: ParallelGroups
    platform: Platform
    bytes: ByteCounter  # this process's torch.distributed traffic
