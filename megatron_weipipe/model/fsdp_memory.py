"""Bytes per rank of ``--use-torch-fsdp2`` and its options, closed form (model/fsdp.py).

What one rank holds, from parameter counts: the fp32 shards (weights, which are the
masters, gradients and Adam's two moments) over the S ranks of its shard group
(S = DP*CP / --num-distributed-optimizer-instances: HSDP holds R times plain FSDP2's
shards); the weights gathered in the compute dtype at the start of the backward (the root
unit, or with --torch-fsdp2-no-reshard-after-forward every unit, plus the flat all-gather
buffer of the last gathered layer); and with --torch-fsdp2-no-grad-sync-per-microbatch
the whole model's unsharded gradients, accumulated in the reduce dtype from the first
microbatch's backward until the last one reduce-scatters them. tools/dry_run.py measures
the same run; tests/test_fsdp2_options.py holds the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FsdpUnits:
    """Parameter counts of the FSDP2 units of a model stage."""

    embedding: int  # word (and learned position) embeddings
    layer: int  # one transformer layer
    layers: int
    root: int  # what the root unit keeps: final norm and (untied) output layer

    @property
    def total(self) -> int:
        return self.embedding + self.layer * self.layers + self.root


@dataclass(frozen=True)
class FsdpRankBytes:
    param_shards: int  # fp32 weight shards (the optimizer's masters)
    grad_shards: int  # fp32 gradient shards
    optimizer_state: int  # Adam's two fp32 moments of the shards
    gathered: int  # compute-dtype weights gathered at the start of the backward
    accumulated_grads: int  # unsharded gradients held across microbatches (no grad sync)

    @property
    def total(self) -> int:
        return (self.param_shards + self.grad_shards + self.optimizer_state + self.gathered
                + self.accumulated_grads)


def fsdp2_rank_bytes(units: FsdpUnits, data_context_size: int, replicas: int = 1, compute_bytes: int = 4,
                     reduce_bytes: int = 4, reshard_after_forward: bool = True,
                     grad_sync_per_microbatch: bool = True, microbatches: int = 1) -> FsdpRankBytes:
    """One rank's FSDP2 bytes (shards rounded down: exact where S divides every unit)."""
    shards = data_context_size // replicas
    shard = 4 * units.total // shards
    held = units.total if not reshard_after_forward else units.root
    accumulate = not grad_sync_per_microbatch and microbatches > 1
    return FsdpRankBytes(param_shards=shard, grad_shards=shard, optimizer_state=2 * shard,
                         gathered=compute_bytes * (held + units.layer),
                         accumulated_grads=reduce_bytes * units.total if accumulate else 0)
