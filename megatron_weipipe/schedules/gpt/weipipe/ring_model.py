"""One GPTModel per ring rank: its decoder layers are the owned chunk, the rest is replicated.

Ring rank r builds the model with pre_process and post_process both set while
megatron-core's parallel_state says pipeline rank r, so its decoder holds exactly the
layers (global numbers and checkpoint keys) of stage r of a PP=P pipeline. The
embedding, final norm and output layer exist on every ring rank; their gradients are
summed over the ring. For the optimizer's gradient norm and for the checkpoint only
ring rank 0's copy counts: the others are marked `shared` and saved as non-main replicas.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

DECODER_LAYERS = "decoder.layers."


class DecoderChunk(nn.Module):
    """The chunk template: a decoder chunk's TransformerLayers, hidden [s, b, h] -> hidden.

    It holds the owned layers themselves (no copy); the runtime only ever calls it
    through torch.func.functional_call with views of a circulating flat buffer, so the
    same module computes any chunk. The attention mask (None: causal) and the rotary
    embedding come in per call.
    """

    def __init__(self, layers: nn.ModuleList, sequence_parallel: bool, selective_recompute: bool = False):
        super().__init__()
        self.layers = layers
        self.sequence_parallel = sequence_parallel
        # megatron-core's selective-recompute checkpoints in forms the runtime's
        # torch.autograd.grad backward runs (model/selective_recompute.py)
        self.selective_recompute = selective_recompute

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:
        from contextlib import nullcontext

        from megatron.core import tensor_parallel

        from megatron_weipipe.model.selective_recompute import for_autograd_grad

        # As TransformerBlock: dropout in sequence-parallel regions draws from the TP tracker.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel else nullcontext()
        with rng, for_autograd_grad(self.selective_recompute):
            for layer in self.layers:
                hidden, _ = layer(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return hidden


def replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside the decoder layers: embedding, final norm, output layer."""
    return [(n, p) for n, p in model.named_parameters() if not n.startswith(DECODER_LAYERS)]


@torch.no_grad()
def make_ring_replicas(model: nn.Module, ring_rank: int, ring_group, ring_src: int,
                       embedding_summed: bool = False) -> None:
    """Give every ring rank ring rank 0's replicated parameters and mark the copies.

    With layout-invariant initialisation the copies are already equal; the broadcast
    makes that hold for megatron-core's per-stage initialisation too. There, with tied
    embeddings, megatron-core's constructor has all-reduced the word embedding between
    the first and last stage, assuming the last stage's copy was zero; here both were
    drawn, so (`embedding_summed`) the sum of two independent draws is scaled by 1/sqrt(2)
    to keep the initialisation's distribution. Must run before the optimizer is built:
    the optimizer copies `shared`.
    """
    if embedding_summed and ring_rank == 0:
        model.shared_embedding_or_output_weight().data.mul_(0.5 ** 0.5)
    for _, p in replicated_parameters(model):
        dist.broadcast(p.data, src=ring_src, group=ring_group)
        if ring_rank != 0:
            p.shared = True  # megatron-core's grad norm counts a shared parameter once
    _mark_checkpoint_replicas(model, ring_rank)


def _mark_checkpoint_replicas(model: nn.Module, ring_rank: int) -> None:
    """Ring rank r > 0 saves its replicated tensors as replicas, not main copies:
    dist_checkpointing refuses two main replicas of one shard."""
    if ring_rank == 0:
        return
    original = model.sharded_state_dict

    def sharded_state_dict(prefix: str = "", *args, **kwargs):
        state = original(prefix, *args, **kwargs)
        for key, value in state.items():
            if not key.startswith(prefix + DECODER_LAYERS):
                _set_ring_replica(value, ring_rank)
        return state

    model.sharded_state_dict = sharded_state_dict


def _set_ring_replica(obj, ring_rank: int) -> None:
    if isinstance(obj, dict):
        for v in obj.values():
            _set_ring_replica(v, ring_rank)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _set_ring_replica(v, ring_rank)
    elif hasattr(obj, "replica_id"):
        rid = obj.replica_id
        # megatron-core's replica ids are (pipeline, tensor, data); the first axis is
        # the one megatron itself uses for the tied embedding copy of the last stage.
        if isinstance(rid, tuple):
            obj.replica_id = (ring_rank, *rid[1:])
        else:
            obj.replica_id = (ring_rank, rid)
