"""How FSDP2 shards and synchronises: FSDP over every data-parallel rank, or HSDP.

HSDP (FSDP2's 2-D mesh; Megatron-LM's --num-distributed-optimizer-instances with
--use-torch-fsdp2) shards the model inside a group of consecutive data-parallel ranks (a
node, where the link is fast) and replicates it across ``replicas`` such groups: each
unit is all-gathered and its gradient reduce-scattered inside the group, and the shard's
gradient is then all-reduced across the groups (the slow link, one ring per shard rank,
all at once). Two FSDP2 options change what a microbatch costs:

- no reshard after forward: a unit keeps its gathered weights from its forward to its
  backward, one all-gather per unit and microbatch instead of two, all units' weights held;
- no gradient sync per microbatch: gradients accumulate unsharded (fp32, the whole model)
  and are reduce-scattered (and all-reduced across groups) after the last microbatch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require_simulable

from . import collectives
from .hardware import Cluster

GRAD_BYTES = 4  # FSDP2 reduces gradients in fp32 (Megatron's main-grad dtype)

@dataclass(frozen=True)
class FsdpSharding:
    replicas: int = 1  # groups the model is replicated across (1: sharded over every rank)
    reshard_after_forward: bool = True  # FSDP2's default: gathered again for the backward
    grad_sync_per_microbatch: bool = True  # reduce-scatter (and all-reduce) every microbatch
    grad_bytes: int = GRAD_BYTES  # the gradients' reduce dtype (FSDP2's MixedPrecisionPolicy.reduce_dtype)

    def validate(self, ranks: int) -> "FsdpSharding":
        require_simulable(self.replicas >= 1 and ranks % self.replicas == 0,
                          f"HSDP replicas ({self.replicas}) must divide the data x context parallel ranks ({ranks})")
        return self

    @property
    def is_hsdp(self) -> bool:
        return self.replicas > 1


def sharding_from(cfg, replicas: Optional[int] = None, no_reshard: bool = False,
                  grad_sync_once: bool = False, reduce_dtype: str = "fp32") -> FsdpSharding:
    """The sharding of a run: the simulator's what-if options where given, else the trainer's
    flags (``cfg.parallel``; HSDP replicas only with --use-torch-fsdp2: without it the
    instances are the distributed optimizer's)."""
    p = cfg.parallel
    if replicas is None:
        replicas = p.num_distributed_optimizer_instances if p.use_torch_fsdp2 else 1
    return FsdpSharding(
        replicas=replicas,
        reshard_after_forward=not (no_reshard or p.torch_fsdp2_no_reshard_after_forward),
        grad_sync_per_microbatch=not (grad_sync_once or p.torch_fsdp2_no_grad_sync_per_microbatch),
        grad_bytes=2 if reduce_dtype == "bf16" else GRAD_BYTES)


def trainer_flags(sharding: FsdpSharding) -> list[str]:
    """The FSDP2 flags of ``sharding`` on pretrain_gpt.py's command line: `sharding_from`'s
    inverse (fp32 gradient reduction, the trainer's)."""
    return ["--use-torch-fsdp2",
            *(["--num-distributed-optimizer-instances", str(sharding.replicas)] if sharding.is_hsdp else []),
            *(["--torch-fsdp2-no-reshard-after-forward"] if not sharding.reshard_after_forward else []),
            *(["--torch-fsdp2-no-grad-sync-per-microbatch"] if not sharding.grad_sync_per_microbatch else [])]


def groups(ranks: list[int], replicas: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups: consecutive ranks, replica groups: the same position in each shard group)."""
    size = len(ranks) // replicas
    shards = [ranks[i * size:(i + 1) * size] for i in range(replicas)]
    return shards, [ranks[j::size] for j in range(size)]


@dataclass(frozen=True)
class UnitComms:
    """One unit's collectives per microbatch on one rank."""

    gather: collectives.CollectiveCost  # compute-dtype weights, inside the shard group
    reduce_scatter: collectives.CollectiveCost  # gradient (fp32 unless said), inside the shard group
    all_reduce: collectives.CollectiveCost  # gradient shard, across the replica groups


def unit_comms(params: list[int], ranks: list[int], sharding: FsdpSharding, cluster: Cluster,
               compute_bytes: int):
    """Per unit (parameters of one TP shard) its ``UnitComms``; and the shard group's and the
    replica group's links. gloo reduce-scatters by all-reducing the whole tensor, NCCL by a ring."""
    shards, replicas = groups(ranks, sharding.replicas)
    shard, replica = shards[0], replicas[0]
    n, r = len(shard), len(replica)
    link = cluster.slowest_link(shard)
    replica_link = cluster.crossing_link(replica, replicas)
    rs = collectives.all_reduce if cluster.device.backend == "gloo" else collectives.reduce_scatter
    g = sharding.grad_bytes
    out = [UnitComms(collectives.all_gather(p * compute_bytes, n, link), rs(p * g, n, link),
                     collectives.all_reduce(p * g // n, r, replica_link)) for p in params]
    return out, link, replica_link
