"""Baselines WeiPipe is measured against that are not a list replay: FSDP and the floor.

- ``fsdp``: FSDP / ZeRO-3 over the same GPUs, no pipeline (PP = 1, every GPU a data-
  parallel rank holding 1/n of every parameter), with the units the trainer's
  ``--use-torch-fsdp2`` makes (model/fsdp.py): the embedding, each decoder
  layer, the root (final norm, and the output layer when untied). Every microbatch each
  unit is all-gathered before its forward and again before its backward (resharded after
  the forward: FSDP2's default, root included) and its gradient reduce-scattered in fp32
  right after its backward (no gradient accumulation without sync). Communication runs
  on its own stream, one collective at a time in issue order, overlapped with compute
  the way FSDP2 prefetches: the next unit's gather is issued when a unit's forward starts
  (the previous unit's when its backward starts; the root's backward gather when the
  loss is done), a reduce-scatter when its backward ends; a unit computes once its
  weights are there. A device without streams (a CPU host) overlaps nothing: FSDP2 issues
  each gather in the unit's pre-forward or pre-backward hook and waits for it there, and
  each reduce-scatter after the backward. Each unit's forward and backward also cost FSDP2's fixed CPU
  seconds (``CostModel.fsdp_unit_forward`` / ``_backward``: hooks, DTensor bookkeeping,
  each collective's own cost; measured on a CPU host, 0 for FLOP-based costs), and the
  step after the microbatches is ``CostModel.fsdp_step`` where measured, else the
  optimizer over the 1/n shard.
- ``floor``: N microbatches x the slowest stage's compute per microbatch, the time no
  activation pipeline of these stages can beat (no bubble, no wire), plus what 1F1B runs
  after its lists (gradient reductions, optimizer step).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import Action, Kind
from megatron_weipipe.schedules.timing.replay import TimedAction, TokenBucket, Trace

from . import collectives, sharding
from .costs import CostModel
from .hardware import Cluster
from .run_spec import RunSpec
from .topology import project_tawpipe

FSDP_GRAD_BYTES = sharding.GRAD_BYTES
FSDP_KIND = "fsdp"  # the trainer's byte-counter kind for FSDP2's collectives (model/fsdp.py)


def fsdp_units(spec: RunSpec) -> list[tuple[str, int]]:
    """(name, parameters of one TP shard) of each FSDP unit, in forward order."""
    s, tp = spec.shape, spec.layout.tp
    root = s.norm_params() + (s.word_embedding_params(tp) if s.untie_embeddings_and_output_weights else 0)
    return [("embedding", s.embedding_params(tp)), *((f"layer {j}", s.layer_params(tp)) for j in range(s.num_layers)),
            ("root", root)]


def unit_collectives(spec: RunSpec, cluster: Cluster):
    """Per unit (all-gather of its compute-dtype weights, fp32 reduce-scatter of its gradient)
    on the data-parallel ring (the shard group under HSDP), and that ring's link. gloo
    reduce-scatters by all-reducing the whole tensor (twice a ring's bytes at two ranks,
    measured on a veth pair), NCCL by a ring."""
    comms, link, _ = _unit_comms(spec, cluster)
    return [(c.gather, c.reduce_scatter) for c in comms], link


def _unit_comms(spec: RunSpec, cluster: Cluster):
    group = spec.layout.data_cp_ranks()
    params = [p for _, p in fsdp_units(spec)]
    return sharding.unit_comms(params, group, spec.fsdp.validate(len(group)), cluster, spec.compute_bytes)


class _CommStream:
    """FSDP's communication stream: one collective at a time in issue order, over the
    data-parallel ring's link (its token bucket where the link is tc-shaped)."""

    def __init__(self, link) -> None:
        self.free = 0.0
        self.rate = link.bandwidth_gbs * 1e9
        self.bucket = TokenBucket(self.rate, link.burst_bytes) if link.burst_bytes > 0 else None

    def issue(self, at: float, c: collectives.CollectiveCost) -> float:
        """When collective ``c`` issued at ``at`` is done."""
        start = max(at, self.free)
        seconds = c.seconds
        if self.bucket is not None:  # each rank sends its wire bytes at once: one bucket per direction, alike
            seconds += self.bucket.seconds(start, c.wire_bytes) - c.wire_bytes / self.rate
        self.free = start + seconds
        return self.free


class _FsdpRank:
    """One rank's compute stream: each unit waits for its weights, then computes. Under HSDP
    each unit's gradient shard is all-reduced across the replica groups on a stream of its
    own (the inter-node link) once its reduce-scatter is done."""

    def __init__(self, comms, stream: _CommStream, blocking: bool, replica_stream: Optional[_CommStream] = None,
                 fsdp: sharding.FsdpSharding = sharding.FsdpSharding()) -> None:
        self.comms, self.stream, self.blocking = comms, stream, blocking
        self.replica_stream, self.fsdp = replica_stream, fsdp
        self.now = self.exposed = 0.0
        self.timed: list[TimedAction] = []
        self.ready = [0.0] * len(comms)

    def gather(self, u: int, at: float) -> None:
        self.ready[u] = self.stream.issue(at, self.comms[u].gather)

    def run(self, u: int, seconds: float, action: Action, prefetch: Optional[int]) -> None:
        """Wait for unit ``u``'s weights, issue the prefetch of unit ``prefetch`` as it starts, compute."""
        if self.blocking and prefetch is not None:
            prefetch = None
        start = max(self.now, self.ready[u])
        self.exposed += start - self.now
        if prefetch is not None:
            self.gather(prefetch, start)
        self.now = start + seconds
        self.timed.append(TimedAction(action, start, self.now))

    def microbatch(self, m: int, forward: list[float], backward: list[float], L: int, sync: bool = True) -> None:
        """Forward (embedding, layers, root), the root gathered again, backward in reverse,
        each unit's gradient reduce-scattered after its backward when ``sync``. Without
        resharding after the forward the backward finds every unit's weights there."""
        U = len(self.comms)
        self.ready = [0.0] * U
        self.gather(0, self.now)
        for u in range(U):
            if self.blocking and u > 0:
                self.gather(u, self.now)
            kind = Kind.LOSS if u == U - 1 else Kind.FORWARD
            self.run(u, forward[u], Action(kind, 0, 0, mb=m, chunk=max(0, min(u - 1, L - 1))),
                     u + 1 if u + 1 < U else None)
        reshard = self.fsdp.reshard_after_forward
        if reshard:
            self.gather(U - 1, self.now)
        for u in reversed(range(U)):
            if reshard and self.blocking and u < U - 1:
                self.gather(u, self.now)
            self.run(u, backward[u], Action(Kind.BACKWARD, 0, 0, mb=m, chunk=max(0, min(u - 1, L - 1))),
                     u - 1 if u > 0 and reshard else None)
            if not sync:
                continue
            done = self.stream.issue(self.now, self.comms[u].reduce_scatter)
            if self.replica_stream is not None:
                done = self.replica_stream.issue(done, self.comms[u].all_reduce)
            if self.blocking:
                self.exposed += done - self.now
                self.now = done


def _unit_seconds(spec: RunSpec, costs: CostModel) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of every unit (embedding, layers, root), FSDP2's fixed
    seconds per unit included."""
    L, eff = spec.shape.num_layers, spec.kernel_efficiency
    t = costs.for_layers(1).module
    forward = [costs.embed_forward / eff, *[t.forward / eff] * L, costs.head_forward / eff]
    backward = [costs.embed_backward / eff, *[(t.backward + t.forward * spec.recompute_share) / eff] * L,
                costs.head_backward / eff]
    return ([c + costs.fsdp_unit_forward for c in forward], [c + costs.fsdp_unit_backward for c in backward])


def simulate_fsdp(spec: RunSpec, cluster: Cluster, costs: CostModel, base):
    """FSDP's (or HSDP's) iteration on one rank (all ranks alike); ``base`` is the PP=1 replay
    of the same spec (memory, counters), whose times this replaces."""
    s, lay, fsdp = spec.shape, spec.layout, spec.fsdp
    N = spec.num_microbatches
    forward, backward = _unit_seconds(spec, costs)
    comms, link, replica_link = _unit_comms(spec, cluster)
    stream = _CommStream(link)
    replica_stream = _CommStream(replica_link) if fsdp.is_hsdp else None
    rank = _FsdpRank(comms, stream, blocking=not cluster.device.streams,  # no streams: each collective waited for
                     replica_stream=replica_stream, fsdp=fsdp)
    for m in range(N):
        rank.microbatch(m, forward, backward, s.num_layers, sync=fsdp.grad_sync_per_microbatch or m == N - 1)
    pipeline = max(rank.now, stream.free, replica_stream.free if replica_stream else 0.0)
    exposed = rank.exposed + pipeline - rank.now
    params = spec.rank_params(0) / (lay.dp * lay.cp) * fsdp.replicas  # the shard of one shard group
    step = costs.fsdp_step if costs.fsdp_step is not None else params * costs.optimizer_per_param
    iteration = pipeline + step
    compute = sum(a.end - a.start for a in rank.timed)
    gathers = 2 if fsdp.reshard_after_forward else 1
    syncs = N if fsdp.grad_sync_per_microbatch else 1
    wire = sum(N * gathers * c.gather.wire_bytes + syncs * c.reduce_scatter.wire_bytes for c in comms)
    n = len(lay.data_cp_ranks()) // fsdp.replicas  # the trainer counts a ring's bytes whatever the backend sends
    units = fsdp_units(spec)
    counted = sum(N * gathers * c.gather.wire_bytes + syncs * (n - 1) / n * p * fsdp.grad_bytes
                  for c, (_, p) in zip(comms, units))
    bytes_per_link = {link.name: wire}
    phases = {"FSDP gathers and reduce-scatters not hidden by compute": exposed,
              "step after the microbatches (optimizer on the 1/n shard)": step}
    if fsdp.is_hsdp:
        across = syncs * sum(c.all_reduce.wire_bytes for c in comms)
        bytes_per_link[replica_link.name] = bytes_per_link.get(replica_link.name, 0.0) + across
        counted += across
    tokens = spec.global_batch_size * s.seq_length
    peak = cluster.device.peak_tflops * 1e12 if cluster.device.peak_tflops else None
    flops = s.model_flops_per_microbatch() * N * lay.dp
    trace = Trace(per_rank=(tuple(rank.timed),), transfers=(), finish=(pipeline,), work=(compute,))
    layer = s.layer_params(lay.tp)
    # two gathered layers (the one computing, the prefetched) and a gradient; without
    # resharding every unit's gathered weights from its forward to its backward; without a
    # sync per microbatch the unsharded fp32 gradients of the whole model
    extra = 2 * layer * (spec.compute_bytes + FSDP_GRAD_BYTES)
    if not fsdp.reshard_after_forward:
        extra += sum(p for _, p in units) * spec.compute_bytes
    if not fsdp.grad_sync_per_microbatch:
        extra += sum(p for _, p in units) * FSDP_GRAD_BYTES
    mem = tuple(replace(m, transient=m.transient + extra) for m in base.memory)
    return replace(base, iteration_s=iteration, pipeline_s=pipeline, tokens_per_s=tokens / iteration,
                   mfu=flops / (iteration * lay.world * peak) if peak else None,
                   bubble=1.0 - compute / pipeline if pipeline > 0 else 0.0,
                   bytes_per_link=(bytes_per_link,), counter=({FSDP_KIND: int(counted)},), memory=mem,
                   trace=trace, phases=phases, work=(compute + step,))


def project_floor(spec: RunSpec, cluster: Cluster, costs: CostModel, base):
    """The floor's result: ``base`` (the 1F1B replay of the same spec) with the floor's times."""
    return replace(base, **floor_of(spec, base))


def floor_of(spec: RunSpec, one_f_one_b) -> dict:
    """The floor's times from the 1F1B result of the same spec: N x the slowest stage."""
    pipeline = max(one_f_one_b.trace.work)
    after = one_f_one_b.iteration_s - one_f_one_b.pipeline_s
    iteration = pipeline + after
    tokens = spec.global_batch_size * spec.shape.seq_length
    mfu = None
    if one_f_one_b.mfu is not None:
        mfu = one_f_one_b.mfu * one_f_one_b.iteration_s / iteration
    return dict(iteration_s=iteration, pipeline_s=pipeline, tokens_per_s=tokens / iteration, mfu=mfu, bubble=0.0)


# registry projection -> (spec, cluster, costs, base replay) -> ScheduleResult
PROJECTIONS = {registry.FSDP: simulate_fsdp, registry.FLOOR: project_floor, registry.TAWPIPE: project_tawpipe}
