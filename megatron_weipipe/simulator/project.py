"""One schedule, one run configuration: replay, collectives, optimizer, memory, bytes.

The pipeline part is the event replay of the schedule's action lists (cluster_replay.py) for
one pipeline / WeiPipe ring; data-parallel replicas and tensor-parallel peers run the
same lists, so their work shows up as collectives only. After the lists, what
pretrain() runs per iteration follows, in order:
- Megatron schedules: DDP's gradient all-reduce over data x context ranks, the
  all-reduce of the tied word-embedding gradient between the first and the last stage;
- WeiPipe schedules (schedules/gpt/weipipe): the ring all-reduce of the replicated
  embedding / final norm / output layer gradients, then DDP's data-parallel all-reduce;
- then the iteration's flag all-reduce (a barrier), the gradient norm and the
  optimizer step of every rank's own parameters (the slowest rank sets the pace).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from megatron_weipipe.weight_pass import WeightPass
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Flow, Kind, Schedule

from . import collectives, host_state, memory
from .costs import CostModel
from megatron_weipipe.simulator.cluster_replay import EventModel, Trace, replay
from .fpdt import FPDTReport, analyse
from megatron_weipipe.fpdt.config import ulysses_heads_sent
from .hardware import Cluster
from .run_spec import RunSpec

FLAGS_BYTES = 40  # pretrain's per-iteration all-reduce: loss sum, count, bad count, 2 exit flags (fp64)
NORM_BYTES = 4  # megatron-core's gradient-norm all-reduce (one fp32)


@dataclass(frozen=True)
class ScheduleResult:
    spec: RunSpec
    iteration_s: float
    pipeline_s: float  # the replayed lists, slowest rank
    tokens_per_s: float
    mfu: Optional[float]  # None without a device peak (CPU hosts)
    bubble: float
    bytes_per_link: tuple[dict[str, float], ...]  # per ring rank: p2p + collective wire bytes per link
    counter: tuple[dict[str, int], ...]  # per ring rank: what the run's byte counter logs, by kind
    memory: tuple[memory.RankMemory, ...]
    trace: Trace
    phases: dict = field(default_factory=dict)
    fpdt: Optional[FPDTReport] = None
    work: tuple[float, ...] = ()  # per ring rank: compute and optimizer seconds at full speed (CPU time on a host)

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)


def _ring(spec: RunSpec) -> list[int]:
    return spec.layout.pipeline_ranks()


def simulate_run(spec: RunSpec, cluster: Cluster, costs: CostModel) -> ScheduleResult:
    """The iteration of one schedule: the replay of its lists and what pretrain() runs after
    them, or a baseline's projection from the replay of its base (registry.ScheduleEntry)."""
    spec.validate()
    cluster.validate()
    e = spec.entry
    if e.projection != registry.REPLAY:
        from . import baselines

        base = simulate_run(replace(spec, schedule=e.replayed_as), cluster, costs)
        return baselines.PROJECTIONS[e.projection](spec, cluster, costs, replace(base, spec=spec))
    schedule = spec.build_schedule(_stage_costs(spec, costs) if e.costed_timeline else None)
    ring = _ring(spec)
    lay, s = spec.layout, spec.shape
    fp = None
    if spec.fpdt is not None:
        fp = analyse(s, spec.fpdt, cluster, cp=lay.cp, tp=lay.tp, dtype_bytes=spec.compute_bytes)
    model = EventModel(
        duration=_scaled(costs.duration(schedule), spec.kernel_efficiency),
        message_bytes=spec.message_bytes,
        link=lambda a, b: cluster.link(ring[a], ring[b]),
        semantics=e.posting,
        lookahead=spec.lookahead,
        host_of=(lambda r: cluster.node(ring[r])) if cluster.cores_per_node else None,
        cores_per_host=cluster.cores_per_node,
        background=cluster.background_tasks,
    )
    trace = replay(schedule, model)
    after = _after_lists(spec, cluster, costs, trace)
    iteration = after.iteration
    tokens = spec.global_batch_size * s.seq_length
    flops = s.model_flops_per_microbatch() * spec.num_microbatches * lay.dp
    peak = cluster.device.peak_tflops * 1e12 if cluster.device.peak_tflops else None
    mfu = flops / (iteration * lay.world * peak) if peak else None
    return ScheduleResult(
        spec=spec, iteration_s=iteration, pipeline_s=trace.makespan, tokens_per_s=tokens / iteration, mfu=mfu,
        bubble=trace.bubble_fraction, bytes_per_link=tuple(after.wire), counter=counter_bytes(spec, schedule),
        memory=rank_memory(spec, schedule, fp), trace=trace, phases=after.phases, fpdt=fp, work=after.work,
    )


def _stage_costs(spec: RunSpec, costs: CostModel) -> tuple[float, float, float]:
    """(F, I, W) seconds of one stage, which a costed timeline's order is built for."""
    t = costs.for_layers(spec.layers_per_chunk).module
    return t.forward, t.backward_input + t.forward * costs.recompute, t.backward_weight


@dataclass
class _AfterLists:
    """What pretrain() runs after the lists, per ring rank: finish times, wire bytes, phases."""

    end: list[float]
    wire: list[dict[str, float]]
    phases: dict[str, float] = field(default_factory=dict)
    iteration: float = 0.0
    work: tuple[float, ...] = ()

    def add_wire(self, cluster: Cluster, ring: list[int], r: int, group: list[int], nbytes: float) -> None:
        if len(group) > 1:
            g = group.index(ring[r]) if ring[r] in group else 0
            link = cluster.link(group[g], group[(g + 1) % len(group)]).name
            self.wire[r][link] = self.wire[r].get(link, 0.0) + nbytes


def _after_lists(spec: RunSpec, cluster: Cluster, costs: CostModel, trace: Trace) -> _AfterLists:
    """Gradient reductions, the flag barrier, the optimizer step and the distributed
    optimizer's parameter all-gather, after the replayed lists."""
    ring, P, lay = _ring(spec), spec.layout.pp, spec.layout
    out = _AfterLists(end=list(trace.finish), wire=[dict(d) for d in trace.bytes_sent()])
    _reduce_replicated(spec, cluster, ring, out)
    dp_group_size = lay.dp * lay.cp
    dp_costs = []
    for r in range(P):
        group = lay.data_cp_ranks(pp=r)
        link = cluster.slowest_link(group)
        nbytes = spec.rank_params(r) * 4
        c = (collectives.reduce_scatter(nbytes, dp_group_size, link) if spec.distributed_optimizer
             else collectives.all_reduce(nbytes, dp_group_size, link))
        dp_costs.append(c.seconds)
        out.end[r] += c.seconds
        out.add_wire(cluster, ring, r, group, c.wire_bytes)
    out.phases["data-parallel gradient reduction (slowest rank)"] = max(dp_costs)
    barrier = max(out.end)
    shards = spec.optimizer_shards if spec.distributed_optimizer else 1
    opt = max(spec.rank_params(r) / shards * costs.optimizer_per_param for r in range(P))
    out.phases["optimizer step (slowest rank)"] = opt
    out.work = tuple(trace.work[r] + spec.rank_params(r) / shards * costs.optimizer_per_param for r in range(P))
    gather = 0.0
    if spec.distributed_optimizer and dp_group_size > 1:
        for r in range(P):
            group = lay.data_cp_ranks(pp=r)
            c = collectives.all_gather(spec.rank_params(r) * spec.compute_bytes, dp_group_size,
                                       cluster.slowest_link(group))
            gather = max(gather, c.seconds)
            out.add_wire(cluster, ring, r, group, c.wire_bytes)
        out.phases["parameter all-gather (distributed optimizer)"] = gather
    out.iteration = barrier + opt + gather
    return out


def _reduce_replicated(spec: RunSpec, cluster: Cluster, ring: list[int], out: _AfterLists) -> None:
    """WeiPipe: the ring all-reduce of the replicated parameters' gradients; Megatron: the
    tied word embedding's all-reduce between the first and the last stage."""
    P, lay, s = spec.layout.pp, spec.layout, spec.shape
    end = out.end
    if spec.is_weipipe:
        ar = collectives.all_reduce(spec.replicated_params() * 4, P, cluster.slowest_link(ring))
        t = max(end) + ar.seconds
        end[:] = [t] * P
        out.phases["ring all-reduce of replicated grads"] = ar.seconds
        for r in range(P):
            out.add_wire(cluster, ring, r, ring, ar.wire_bytes)
    elif P > 1 and not s.untie_embeddings_and_output_weights:
        emb = collectives.all_reduce(s.word_embedding_params(lay.tp) * 4, 2, cluster.link(ring[0], ring[-1]))
        t = max(end[0], end[-1]) + emb.seconds
        end[0] = end[-1] = t
        out.phases["embedding all-reduce (first, last stage)"] = emb.seconds
        for r in (0, P - 1):
            out.add_wire(cluster, ring, r, [ring[0], ring[-1]], emb.wire_bytes)


def _scaled(duration, efficiency: float):
    """Compute seconds of kernels running at ``efficiency`` x the cost model's speed."""
    if efficiency == 1.0:
        return duration
    return lambda a: duration(a) / efficiency


def counter_bytes(spec: RunSpec, schedule: Schedule) -> tuple[dict[str, int], ...]:
    """Per ring rank (data-parallel rank 0, TP rank 0): bytes the run's BYTE_COUNTER
    records as sent in one training iteration, by the kinds the log line shows.
    Collectives count their payload, except on groups of one rank (which send nothing):
    the data-parallel gradient all-reduce at DP x CP = 1, the cross entropy's at TP = 1."""
    s, lay, P = spec.shape, spec.layout, spec.layout.pp
    # vocab-parallel cross entropy: three fp32 [s, b] all-reduces over the tensor-parallel group
    ce = 3 * s.tokens // lay.cp * 4 if lay.tp > 1 else 0
    grads = lay.dp * lay.cp > 1  # DDP's all-reduce (or the distributed optimizer's) has peers
    out = []
    for r, acts in enumerate(schedule.ranks):
        row: dict[str, int] = {}
        for a in acts:
            if a.kind is not Kind.SEND:
                continue
            if a.flow in (Flow.ACTIVATIONS, Flow.ACTIVATION_GRADS):
                kind = "activations"
            else:
                kind = "gradients" if a.flow is Flow.GRADS else "weights"
            row[kind] = row.get(kind, 0) + spec.message_bytes(a)
        coll = (spec.rank_params(r) * 4 if grads else 0) + FLAGS_BYTES + (NORM_BYTES if lay.tp * P > 1 else 0)
        if spec.is_weipipe:
            coll += spec.replicated_params() * 4 + ce * schedule.microbatches
        else:
            if P > 1 and (r == 0 or r == P - 1) and not s.untie_embeddings_and_output_weights:
                coll += s.word_embedding_params(lay.tp) * 4
            if r == P - 1:
                coll += ce * spec.num_microbatches
        if spec.distributed_optimizer and grads:
            coll += spec.rank_params(r) * spec.compute_bytes // (lay.dp * lay.cp)  # all-gather: this rank's shard
        if lay.cp > 1:
            # Ulysses / FPDT all-to-alls, payload as counted (the whole send buffer): per layer
            # and microbatch q|k|v out and o back in the forward, do out and dq|dk|dv back in
            # the backward; full recomputation runs the forward's pair again. q|k|v carries a KV
            # head once per rank holding its query heads (fewer KV heads than CP x TP: several)
            heads = ulysses_heads_sent(s.num_attention_heads, s.groups, lay.cp, lay.tp) + s.num_attention_heads // lay.tp
            per = s.tokens // lay.cp * heads * s.head_dim * spec.compute_bytes
            layer_passes = (schedule.microbatches * s.num_layers if spec.is_weipipe
                            else spec.num_microbatches * spec.rank_layers(r))
            coll += per * (3 if spec.recompute else 2) * layer_passes
        row["collectives"] = coll
        out.append(row)
    return tuple(out)


def state_bytes(spec: RunSpec) -> memory.StateBytes:
    """Bytes per parameter of the model state and how they shard, for the run's optimizer
    and sharding (distributed optimizer, ZeRO-3, FSDP2)."""
    n = spec.layout.dp * spec.layout.cp
    if spec.torch_fsdp2:
        return memory.fsdp2_state_bytes(n // spec.fsdp.replicas)  # HSDP: sharded inside a replica group
    if spec.zero3:
        return memory.StateBytes(spec.compute_bytes, spec.compute_bytes, 12, optimizer_shards=n, param_shards=n)
    state = memory.state_bytes_for(spec.compute_bytes)
    if spec.distributed_optimizer:
        return memory.StateBytes(state.param, state.grad, state.optimizer, optimizer_shards=spec.optimizer_shards)
    return state


def state_split(spec: RunSpec) -> host_state.StateSplit:
    """The model state's bytes per parameter on the device (by role) and on the host
    (--optimizer-cpu-offload, carried in the spec's config)."""
    cfg = spec.config.offload if spec.config is not None else None
    return host_state.state_split(state_bytes(spec), cfg, spec.torch_fsdp2)


def _activation_options(spec: RunSpec) -> memory.ActivationOptions:
    impl, _, core = spec.attention_impl.partition("+")  # "unfused+flash": local layers, fused attention core
    return memory.ActivationOptions(impl=impl, flash_attention=(core == "flash") or None,
                                    dtype_bytes=spec.compute_bytes, dropout=spec.dropout, tp=spec.layout.tp,
                                    cp=spec.layout.cp, sequence_parallel=spec.sequence_parallel,
                                    recompute=spec.recompute_modules)


def _layer_terms(spec: RunSpec, o: memory.ActivationOptions, fp: Optional[FPDTReport]):
    """(long-context mode or None, FPDT's norm chunks, what one layer saves, what one recomputed
    module of it holds again in its backward (selective recomputation), the loss's transient)."""
    s, lay = spec.shape, spec.layout
    long_mode = None  # model/long_context.py's layers: Ulysses (CP > 1) or FPDT
    if fp is not None:
        long_mode = "offload" if spec.fpdt.offload else "fpdt"
    elif lay.cp > 1:
        long_mode = "ulysses"
    if long_mode is None:
        return None, 1, memory.layer_activation_bytes(s, o), memory.recomputed_bytes(s, o), \
            memory.logits_bytes(s, lay.tp, lay.cp)
    # FPDT runs the norms in chunks (model/long_context.py chunk_norms), WeiPipe's rings aside
    norm_chunks = spec.fpdt.num_chunks(s.seq_length) if fp is not None and not spec.is_weipipe else 1

    def per_layer(shape, opts):
        return memory.long_context_layer_bytes(shape, opts, long_mode, norm_chunks)

    if fp is not None:  # the final norm is chunked under every schedule (model/long_context.py chunk_final_norm)
        logits = memory.chunked_loss_bytes(s, o, spec.fpdt.loss_num_chunks(s.seq_length),
                                           spec.fpdt.num_chunks(s.seq_length))
    else:  # Ulysses: megatron-core's loss, unchunked
        logits = memory.unchunked_loss_bytes(s, o)
    return long_mode, norm_chunks, per_layer(s, o), memory.recomputed_bytes(s, o, per_layer), logits


def rank_memory(spec: RunSpec, schedule: Schedule, fp: Optional[FPDTReport]) -> tuple[memory.RankMemory, ...]:
    s, lay = spec.shape, spec.layout
    state = state_bytes(spec)
    split = state_split(spec)
    gathered = memory.fsdp2_gathered_bytes(s, lay.tp, spec.compute_bytes) if spec.torch_fsdp2 else 0.0
    if spec.torch_fsdp2 and split.host:
        gathered += host_state.fsdp2_offload_transit_bytes(s.layer_params(lay.tp), state.param_shards)
    act_opts = _activation_options(spec)
    k = spec.layers_per_chunk
    per_input = memory.layer_input_bytes(s, act_opts)
    in_flight = memory.peak_in_flight(schedule, freed_at_input=spec.weight_pass == WeightPass.STORED)
    pools = memory.pool_sets(schedule, freed_at_input=spec.weight_pass == WeightPass.STORED)
    buffers = memory.peak_buffers(schedule, spec.lookahead) if spec.is_weipipe else None
    chunk = spec.chunk_params()
    long_mode, norm_chunks, per_layer, redone, logits = _layer_terms(spec, act_opts, fp)
    out = []
    for r in range(lay.pp):
        params = spec.rank_params(r)
        model_state = params * split.device
        if spec.torch_fsdp2:
            model_state += memory.fsdp2_option_bytes(params, memory.fsdp2_root_params(s, lay.tp), spec.compute_bytes,
                                                     spec.fsdp, spec.num_microbatches)
        host = chunk_state = offloaded = 0.0
        if long_mode is not None:
            units, redo = (1, k) if spec.is_weipipe else (k, 1)
            if spec.recompute:
                acts, transient = in_flight[r] * units * per_input, redo * per_layer
                acts, offloaded = _offloaded_inputs(spec, acts, per_input)
            else:
                acts, transient = in_flight[r] * k * per_layer, redone
                if r > 0 and not spec.is_weipipe:
                    acts += in_flight[r] * per_input  # megatron-core keeps each received input tensor
            scratch = memory.long_context_norm_scratch_bytes(s, act_opts, norm_chunks)
            if fp is not None:
                scratch = max(scratch, memory.chunked_mlp_scratch_bytes(s, act_opts, spec.fpdt.mlp_num_chunks(s.seq_length)))
            transient += scratch
            if spec.is_weipipe or r == lay.pp - 1:
                transient = max(transient, logits)  # the loss's backward runs before any layer's
            if fp is not None and spec.fpdt.offload:
                # one HostBufferPool per built model (model/long_context.py), shared by its
                # attention layers: it grows to the most buffers live at once
                host = memory.shared_pool_bytes(fp.pool_forward_buffers, fp.pool_backward_buffers, k,
                                                recompute=spec.recompute,
                                                weipipe=spec.is_weipipe, in_flight=in_flight[r], chunk_sets=pools[r],
                                                models=memory.model_chunks(schedule, r))
                chunk_state = fp.resident_chunk_bytes
        elif spec.recompute:
            # Megatron checkpoints every layer (uniform, one layer per unit) and recomputes one
            # at a time; WeiPipe's runtime keeps each chunk's input and recomputes the chunk
            units, redo = (1, k) if spec.is_weipipe else (k, 1)
            acts, offloaded = _offloaded_inputs(spec, in_flight[r] * units * per_input, per_input)
            transient = redo * per_layer
        else:
            acts = in_flight[r] * k * per_layer
            transient = redone
        if long_mode is None:
            transient += memory.attention_scratch_bytes(s, act_opts)
            if spec.is_weipipe or r == lay.pp - 1:
                transient = max(transient, logits)  # the loss's backward ends before a layer's starts
        buf = 0.0
        if buffers is not None:
            b = buffers[r]
            buf = chunk * (b.weights * spec.compute_bytes + b.grads * spec.weipipe_grad_bytes)
            buf += chunk * 4 * 2  # the runtime's flat fp32 master copy and summed chunk gradient
        out.append(memory.RankMemory(params=params, model_state=model_state, activations=acts, buffers=buf,
                                     transient=transient, host=host + offloaded + params * split.host,
                                     chunk_state=chunk_state,
                                     gathered=gathered))
    return tuple(out)


def _offloaded_inputs(spec: RunSpec, kept: float, per_input: float) -> tuple[float, float]:
    """(device, host) bytes of the inputs full recomputation keeps: all on the device, or
    with --offload-layer-inputs on the host but the one being recomputed and the one
    prefetched for the next recompute (model/layer_offload.py)."""
    if not spec.offload_layer_inputs:
        return kept, 0.0
    return min(kept, 2 * per_input), memory.offloaded_inputs_host_bytes(kept, per_input)
