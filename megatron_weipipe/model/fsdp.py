"""``--use-torch-fsdp2``: torch's FSDP2 (``fully_shard``) over the megatron-core GPT model.

Megatron-LM's torch-FSDP2 data-parallel mode: each transformer layer and the embedding
become one FSDP unit, then the whole model (the rest: final norm, output layer). Every
parameter, its gradient and (through the optimizer) its Adam state is a DTensor sharded
on dim 0 over the data x context parallel group: a context-parallel rank holds the same
weights as its peers, so its gradient is summed over CP as well, which is megatron-core's
dp_cp group. A unit's weights are all-gathered before its forward and again before its
backward (``reshard_after_forward``), and its gradients are reduce-scattered after its
backward, once per microbatch, averaged over the group as megatron-core's DDP averages.

Under ``--bf16`` the sharded parameters stay float32 and are the optimizer's master
weights (no second fp32 copy): FSDP2's ``MixedPrecisionPolicy`` casts each unit's shard to
bfloat16 before the all-gather, so forward and backward run on bfloat16 weights as in the
non-FSDP ``--bf16`` path, and casts the bfloat16 gradients to float32 before the
reduce-scatter, so they are reduced and accumulated in float32 (``grad_reduce_in_fp32``);
with ``--grad-reduce-in-bf16`` the reduce-scatter runs in bfloat16 (half the bytes) and
the reduced shard is accumulated into the fp32 sharded gradient.

Under ``--calculate-per-token-loss`` each rank's loss is an undivided sum of token losses:
the reduce-scatter still averages over the group (FSDP2 runs a divide factor of 1 as
NCCL's PreMulSum, which gloo lacks, unless sum-only reductions are forced, which only
recent torch offers), and ``scale_gradients`` multiplies the training step's factor by
the group size, one multiplication per gradient: the sum over ranks divided by the global
token count, as with megatron-core's DDP.

FSDP2 issues its collectives itself; every unit gets counting all-gather and
reduce-scatter objects, so the bytes appear as ``fsdp`` in the log line (see
``fsdp_bytes``).

HSDP (``--num-distributed-optimizer-instances R``): the mesh is two-dimensional, R
replica groups x S = DP*CP/R ranks (megatron-core's partial data-parallel groups: the
shard group is R's intra-instance group, the replica group its inter-instance group).
Each unit is sharded over its S ranks and replicated across the R groups: gathers stay
inside the shard group, and each reduce-scattered gradient shard is then all-reduced
across the replicas (FSDP2's own ``all_reduce``, counted as ``fsdp`` through the byte
counter's group attribution, see ``hsdp_all_reduce_bytes``). The gradient is averaged
over all S*R ranks as before.

``--torch-fsdp2-no-reshard-after-forward`` keeps each unit's gathered weights from its
forward to its backward (no second all-gather); ``--torch-fsdp2-no-grad-sync-per-microbatch``
turns FSDP2's gradient sync off (``set_requires_gradient_sync(False)``) for every
microbatch but the last, so the unsharded gradients accumulate and are reduced once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_weipipe import residency
from megatron_weipipe.byte_counter import ByteCounter

FSDP_KIND = "fsdp"


def fsdp_bytes(shard_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for one all-gather or reduce-scatter of a unit whose local
    (padded) shard is ``shard_bytes``: a bandwidth-optimal (ring) collective sends
    ``group_size - 1`` shards."""
    return shard_bytes * (group_size - 1)


def hsdp_all_reduce_bytes(shard_bytes: int, replicas: int) -> int:
    """Bytes one rank sends for HSDP's all-reduce of a reduced gradient shard of
    ``shard_bytes`` across ``replicas`` groups: a ring all-reduce (reduce-scatter, then
    all-gather) sends ``2 (R - 1) / R`` of it."""
    return 2 * (replicas - 1) * shard_bytes // replicas


def _counting_comms(counter: ByteCounter, group_size: int):
    """An all-gather and a reduce-scatter that count their bytes, then run FSDP2's default."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def count(shard: torch.Tensor) -> None:  # what this rank sends (and receives) for one collective
        n = fsdp_bytes(shard.numel() * shard.element_size(), group_size)
        counter.add_sent(FSDP_KIND, n)
        counter.add_received(FSDP_KIND, n)

    class CountedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            count(input_tensor)
            with counter.uncounted():
                return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    class CountedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            count(output_tensor)
            with counter.uncounted():
                return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    return CountedAllGather(), CountedReduceScatter()


def _sharded_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules that become their own FSDP unit, in forward order: the embedding and
    each transformer layer (as Megatron-LM's wrapper, which leaves the local output layer
    to the root)."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in module.modules() if isinstance(m, (LanguageModelEmbedding, TransformerLayer))]


@torch.no_grad()
def _masters(module: torch.nn.Module) -> None:
    """fp32 parameters (the masters FSDP shards). The model is built and initialised in the
    compute dtype, as the non-FSDP path builds it, so the masters start from the values that
    path's optimizer copies; buffers keep the compute dtype. Cast one unit at a time, just
    before it is sharded, so that the whole model is never held in fp32."""
    for p in module.parameters():
        if p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)


def _name_host_grads(units: list[torch.nn.Module]) -> None:
    """CPUOffloadPolicy: the reduced gradient shards are host memory (a GPU copies the device
    output there and frees it); named so for the dry run (``residency.host_buffer``) after
    every unit's post-backward, every unit's at once: FSDP2 may set a unit's gradients in a
    later unit's post-backward, and skips the reduce-scatter of a group of one."""
    groups = [g for g in (u._get_fsdp_state()._fsdp_param_group for u in units) if g is not None]

    def name_all() -> None:
        if not residency.observed():  # only the dry run reads the names; training skips the walk
            return
        for group in groups:
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    residency.host_buffer(grad.to_local())

    for group in groups:
        def named(*args, _post_backward=group.post_backward, **kwargs):
            out = _post_backward(*args, **kwargs)
            name_all()
            return out

        group.post_backward = named


def fsdp_mesh(group: dist.ProcessGroup, replicas: int, device_type: str):
    """The data x context parallel ranks as FSDP2's mesh: one dimension, or under HSDP
    (replica, shard) over megatron-core's inter- and intra-instance groups."""
    from torch.distributed import DeviceMesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh is rank bookkeeping, real even in tools/dry_run.py
        if replicas == 1:
            return DeviceMesh.from_group(group, device_type)
        from megatron.core import parallel_state as ps

        shard = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        replicate = ps.get_inter_distributed_optimizer_instance_group()
        ranks = dist.get_process_group_ranks(group)  # lists: tools/dry_run.py traces tensor ops
        size = len(ranks) // replicas
        index = ranks.index(dist.get_rank())
        row, col = ranks[index - index % size:][:size], ranks[index % size::size]
        if row != dist.get_process_group_ranks(shard) or col != dist.get_process_group_ranks(replicate):
            raise RuntimeError("megatron-core's distributed-optimizer instance groups do not tile the data x "
                               "context parallel group as HSDP's (replica, shard) mesh")
        grid = torch.tensor(ranks).view(replicas, size)
        return DeviceMesh.from_group([replicate, shard], device_type, mesh=grid,
                                     mesh_dim_names=("replicate", "shard"))


def shard_group_if_dtensor(tensor, data_parallel_group=None):
    """megatron-core's ``get_data_parallel_group_if_dtensor`` for any FSDP2 mesh: the group a
    DTensor is sharded over (the shard dimension of an HSDP mesh, whose replicas hold the
    same values, so the gradient norm sums each element once)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    dims = [d for d, p in enumerate(tensor.placements) if isinstance(p, Shard)] or [mesh.ndim - 1]
    group = mesh.get_group(dims[0])
    assert data_parallel_group is None or group == data_parallel_group
    return group


def _use_shard_group_for_grad_norm() -> None:
    from megatron.core.optimizer import clip_grads

    clip_grads.get_data_parallel_group_if_dtensor = shard_group_if_dtensor


class FullyShardedModel(torch.nn.Module):
    """A GPT stage under FSDP2, with the surface megatron-core's schedules and optimizer
    expect of a data-parallel wrapper (``module``, ``config``, ``ddp_config``,
    ``zero_grad_buffer``, ``no_sync``)."""

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup, device_type: str, counter: ByteCounter,
                 ddp_config, reshard_after_forward: bool = True, compute_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32, replicas: int = 1,
                 grad_sync_per_microbatch: bool = True, offload_policy=None):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__()
        self.module = module
        self.config = module.config
        self.ddp_config = ddp_config
        self.buffers = []  # megatron-core's optimizer looks for DDP's grad buffers: none here
        self.expert_parallel_buffers = []
        self.group = group
        self.grad_sync_per_microbatch = grad_sync_per_microbatch
        self.mesh = fsdp_mesh(group, replicas, device_type)
        _use_shard_group_for_grad_norm()
        attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}  # fully_shard drops them
        units = _sharded_units(module)
        kwargs = dict(mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        if offload_policy is not None:  # --optimizer-cpu-offload: shards, gradients, Adam state on the host
            kwargs["offload_policy"] = offload_policy
        if compute_dtype != torch.float32:
            # No input casts: the units' floating inputs (hidden states) are already in
            # the compute dtype, and RoPE's fp32 frequencies must stay fp32.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                                       cast_forward_inputs=False)
        previous = None
        for unit in units:
            _masters(unit)
            fully_shard(unit, **kwargs)
            if self.config.recompute_granularity is not None:
                # recomputation would upset the prefetch order FSDP2 records in forward
                unit.set_modules_to_backward_prefetch([previous] if previous is not None else [])
            previous = unit
        _masters(module)
        fully_shard(module, **kwargs)
        for name, p in module.named_parameters():
            for key, value in attrs.get(name, {}).items():
                setattr(p, key, value)
        shard_group = self.mesh.get_group(self.mesh.ndim - 1)
        if replicas > 1:  # FSDP2's own all-reduce across the replicas, with its ring's bytes
            counter.count_group_as(self.mesh.get_group(0), FSDP_KIND, hsdp_all_reduce_bytes)
        if offload_policy is not None:
            for p in module.parameters():
                residency.host_buffer(p.to_local())  # the fp32 shard lives in host memory
        if hasattr(module, "set_custom_all_gather"):  # else (older torch) the process counter sees them
            all_gather, reduce_scatter = _counting_comms(counter, dist.get_world_size(shard_group))
            for unit in [*units, module]:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)

        if offload_policy is not None:
            _name_host_grads([*units, module])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """megatron-core's schedules run every microbatch but the last inside it: with
        --torch-fsdp2-no-grad-sync-per-microbatch FSDP2 then only accumulates gradients."""
        if self.grad_sync_per_microbatch:
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @torch.no_grad()
    def scale_gradients(self, factor: float) -> None:
        """Multiply the summed gradients by ``factor``: the sharded ones hold the group's
        average, hence the group size (see the module docstring)."""
        factor *= dist.get_world_size(self.group)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def start_grad_sync(self) -> None:
        pass

    def finish_grad_sync(self) -> None:
        pass


def wrap_fsdp(ctx, chunks: list[torch.nn.Module], ddp_config, parallel, compute_dtype: torch.dtype = torch.float32,
              reduce_dtype: torch.dtype = torch.float32, offload_policy=None) -> list[FullyShardedModel]:
    """Shard each chunk over the data x context parallel group, or under HSDP over its
    part of it (fp32 shards; all-gathered in ``compute_dtype``, gradients reduce-scattered
    in ``reduce_dtype`` under mixed precision; kept in host memory under ``offload_policy``,
    FSDP2's CPUOffloadPolicy); ``parallel`` is the ParallelConfig."""
    return [FullyShardedModel(chunk, ctx.groups.data_context, ctx.platform.device_type, ctx.bytes, ddp_config,
                              reshard_after_forward=not parallel.torch_fsdp2_no_reshard_after_forward,
                              compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                              replicas=parallel.num_distributed_optimizer_instances,
                              grad_sync_per_microbatch=not parallel.torch_fsdp2_no_grad_sync_per_microbatch,
                              offload_policy=offload_policy)
            for chunk in chunks]
