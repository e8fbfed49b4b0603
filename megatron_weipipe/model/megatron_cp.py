"""megatron-core's own context parallelism (``--cp-comm-type p2p | allgather | a2a+p2p``).

Transformer Engine's attention exchanges keys and values over the context-parallel group
(ring, all-gather, or all-to-all inside and ring across groups); megatron-core's rotary
embedding takes this rank's positions itself. What is left to this package is the batch:
each rank keeps two of the sequence's 2 x CP chunks (i and 2 x CP - 1 - i), megatron-core's
load-balanced split for causal attention, and the loss is reduced over the group as for
Ulysses (model/gpt_step.py). ``--cp-comm-type a2a`` is this package's Ulysses/FPDT instead
(model/long_context.py), on every host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MegatronContextParallel:
    """What the forward step needs: the group, and how to cut a batch for this rank."""

    cp_group: torch.distributed.ProcessGroup
    cp_size: int
    cp_rank: int

    @classmethod
    def from_parallel_state(cls) -> "MegatronContextParallel":
        from megatron.core import parallel_state as ps

        return cls(ps.get_context_parallel_group(), ps.get_context_parallel_world_size(),
                   ps.get_context_parallel_rank())

    def shard(self, batch: dict) -> dict:
        """This rank's chunks of every [b, s] tensor (megatron-core's get_batch_on_this_cp_rank)."""
        from megatron.core.utils import get_batch_on_this_cp_rank

        return get_batch_on_this_cp_rank(dict(batch), cp_group=self.cp_group)
