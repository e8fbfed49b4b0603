"""The data-parallel reduction of a ring rank's gradients, through megatron-core's DDP.

A ring rank's gradients become final at two moments: the owned chunk's at the rank's
OPTIMIZER_STEP action (the runtime's ``grad_ready``; ring rank P-1 still has ticks to
run then), the replicated parameters' (embedding, final norm, output layer) only after
the schedule, once they are summed over the ring. With ``--overlap-grad-reduce`` the
DDP buffer is laid out so that one bucket holds exactly the owned parameters and the
others only replicated ones, and the owned bucket's all-reduce (reduce-scatter with the
distributed optimizer) is started asynchronously at ``grad_ready``; the replicated
buckets start after the ring sum, and ``finish_grad_sync`` waits for all of them.
Without the flag DDP has one bucket, reduced synchronously after the schedule, as
Megatron's schedules do without it.

Two things of megatron-core's DDP construction are steered (both read once, in
``DistributedDataParallel.__init__``, 0.16 to 0.19): the buffer is laid out in reverse
``module.named_parameters()`` order, so the owned parameters are listed last to come
first; and DDP turns bucketing off on pipeline ranks > 0 (a 1F1B heuristic: their
reduction is off the critical path), which on a weight ring would merge everything into
one bucket, so DDP is shown a pipeline group in which this rank is first.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

# megatron-core aligns each parameter's start to 64 elements with the distributed optimizer.
_PARAM_START_ALIGN = 64


class RingGradSync:
    """When and how the owned and the replicated gradients are reduced over data-parallel
    replicas. ``grad_ready`` is the runtime's callback; ``finish`` runs after the schedule."""

    def __init__(self, ddp, owned: dict[str, nn.Parameter], replicated: list[nn.Parameter], ring_group,
                 overlap: bool):
        self.ddp = ddp
        self.owned = owned
        self.replicated = replicated
        self.ring_group = ring_group
        self.overlap = overlap
        self.owned_groups, self.other_groups = _split_bucket_groups(ddp, owned.values())
        self._ready = False

    @classmethod
    def wrap(cls, model: nn.Module, ddp_conf, owned: dict[str, nn.Parameter], replicated: list[nn.Parameter],
             ring_group) -> "RingGradSync":
        """megatron-core DDP around ``model``, its buckets split as the module docstring says."""
        from megatron.core.distributed import DistributedDataParallel

        overlap = bool(ddp_conf.overlap_grad_reduce)
        if not overlap:
            return cls(DistributedDataParallel(config=model.config, ddp_config=ddp_conf, module=model),
                       owned, replicated, ring_group, overlap)
        owned_ids = {id(p) for p in owned.values()}
        in_order = [p for _, p in model.named_parameters() if id(p) in owned_ids and p.requires_grad]
        ddp_conf.bucket_size = owned_bucket_size(in_order, ddp_conf.use_distributed_optimizer)
        with _listed_last(model, owned.values()), _first_pipeline_stage() as pipeline:
            ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_conf, module=model)
        ddp.pp_group = pipeline.group  # the stand-in served the bucketing decision only
        return cls(ddp, owned, replicated, ring_group, overlap)

    # ------------------------------------------------------------------ iteration

    def schedule_scope(self):
        """Around the schedule: DDP's backward hooks of the replicated parameters (which
        run in every microbatch's backward) only accumulate, they never start a bucket."""
        self._ready = False
        return self.ddp.no_sync()

    def grad_ready(self, chunk: int, views: dict[str, torch.Tensor]) -> None:
        """The owned chunk's summed gradient is final: into DDP's main_grad, and (overlap)
        its buckets' data-parallel reduction starts now, asynchronously."""
        with torch.no_grad():
            for name, view in views.items():
                self.owned[name].main_grad.copy_(view)
        self._ready = True
        if self.overlap:
            for group in self.owned_groups:
                group.start_grad_sync()

    def finish(self) -> None:
        """After the schedule: the replicated gradients summed over the ring, their buckets
        started, then DDP waits for (or, without overlap, runs) every reduction."""
        if not self._ready:
            raise RuntimeError("weipipe: the schedule ended without its OPTIMIZER_STEP (grad_ready was not called)")
        with torch.no_grad():
            grads = [p.main_grad for p in self.replicated]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.ring_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.overlap:
            for group in self.other_groups:
                group.start_grad_sync()
        self.ddp.finish_grad_sync()


def owned_bucket_size(owned_in_order: list[nn.Parameter], distributed_optimizer: bool) -> int:
    """The bucket size at which DDP's first bucket closes exactly after the last owned
    parameter: that parameter's end in the buffer (starts aligned as megatron-core aligns them)."""
    end = 0
    for p in reversed(owned_in_order):  # DDP walks the parameters in reverse order
        if distributed_optimizer:
            end = math.ceil(end / _PARAM_START_ALIGN) * _PARAM_START_ALIGN
        end += p.numel()
    return end


def _split_bucket_groups(ddp, owned: Iterable[nn.Parameter]) -> tuple[list, list]:
    """(bucket groups holding only owned parameters, all the others). A group that mixes
    both is reduced after the schedule, with one logged line."""
    owned_ids = {id(p) for p in owned}
    early, late, mixed = [], [], 0
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        kinds = {id(p) in owned_ids for b in group.buckets for p in b.params_list}
        (early if kinds == {True} else late).append(group)
        mixed += kinds == {True, False}
    if mixed and ddp.ddp_config.overlap_grad_reduce:
        log.warning("weipipe: %d data-parallel bucket(s) mix owned and replicated parameters; they are reduced "
                    "after the schedule", mixed)
    return early, late


@contextlib.contextmanager
def _listed_last(module: nn.Module, params: Iterable[nn.Parameter]):
    """``module.named_parameters()`` with ``params`` after all others, while DDP is built
    (DDP lays its buffer out in reverse order: they come first, in one bucket)."""
    last = {id(p) for p in params}
    plain = module.named_parameters

    def named_parameters(*args, **kwargs):
        items = list(plain(*args, **kwargs))
        return iter([x for x in items if id(x[1]) not in last] + [x for x in items if id(x[1]) in last])

    module.named_parameters = named_parameters
    try:
        yield
    finally:
        del module.named_parameters


class _FirstStage:
    """What DDP reads of the pipeline group to decide on bucketing: this rank's place, 0."""

    def __init__(self, group):
        self.group: Optional[dist.ProcessGroup] = group

    @staticmethod
    def rank() -> int:
        return 0

    def size(self) -> int:
        return self.group.size() if self.group is not None else 1


@contextlib.contextmanager
def _first_pipeline_stage():
    """DDP, while built, sees the pipeline group through a ``_FirstStage`` (yielded; its
    ``group`` is the real one)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    name = "setup_process_groups_for_ddp"
    original = ProcessGroupCollection.__dict__[name]
    stand_in = _FirstStage(None)

    def setup(*args, **kwargs):
        groups = dict(original.__func__(*args, **kwargs))
        stand_in.group = groups["pp_group"]
        groups["pp_group"] = stand_in
        return groups

    setattr(ProcessGroupCollection, name, staticmethod(setup))
    try:
        yield stand_in
    finally:
        setattr(ProcessGroupCollection, name, original)
