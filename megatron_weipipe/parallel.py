"""Process groups of a run, gathered once after initialisation and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state as ps


@dataclass(frozen=True)
class ParallelGroups:
    """Handles to every group this package talks over; built from megatron-core's layout."""

    world: dist.ProcessGroup
    tensor: dist.ProcessGroup
    pipeline: dist.ProcessGroup
    data: dist.ProcessGroup
    context: dist.ProcessGroup
    data_context: dist.ProcessGroup  # data x context: where gradients are averaged
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline group (the WeiPipe ring), in stage order."""
        return dist.get_process_group_ranks(self.pipeline)

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        return cls(
            world=dist.group.WORLD,
            tensor=ps.get_tensor_model_parallel_group(),
            pipeline=ps.get_pipeline_model_parallel_group(),
            data=ps.get_data_parallel_group(),
            context=ps.get_context_parallel_group(),
            data_context=ps.get_data_parallel_group(with_context_parallel=True),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_size=ps.get_context_parallel_world_size(),
        )
