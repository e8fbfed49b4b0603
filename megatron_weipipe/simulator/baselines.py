"""Baselines WeiPipe is measured against that are not a list replay: FSDP and the floor.

- ``fsdp``: FSDP / ZeRO-3 over the same GPUs, no pipeline (PP = 1, every GPU a data-
  parallel rank holding 1/n of every parameter). Each decoder layer is one FSDP unit:
  its weights are all-gathered before its forward and again before its backward
  (resharded after the forward, FSDP2's default), its gradient reduce-scattered in fp32
  right after its backward, every microbatch (no gradient accumulation without sync).
  The root unit (embedding, final norm, output layer) is gathered once per microbatch
  before the first layer and reduce-scattered after the last backward. Communication
  runs on its own stream, one collective at a time in issue order, overlapped with
  compute the way FSDP prefetches: the gather of layer j + 1 is issued when layer j's
  forward starts (j - 1 when j's backward starts), a reduce-scatter when its backward
  ends; a layer computes once its weights are there.
- ``floor``: N microbatches x the slowest stage's compute per microbatch, the time no
  activation pipeline of these stages can beat (no bubble, no wire), plus what 1F1B runs
  after its lists (gradient reductions, optimizer step).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_weipipe.schedules.plan.actions import Action, Kind
from megatron_weipipe.schedules.plan.events import TimedAction, Trace

from . import collectives
from .costs import CostModel
from .hardware import Cluster
from .run_spec import RunSpec

FSDP_GRAD_BYTES = 4  # gradients reduce-scattered in fp32 (Megatron's main-grad dtype)


def layer_collectives(spec: RunSpec, cluster: Cluster):
    """(all-gather, reduce-scatter) of one decoder layer and of the root unit, on the data-parallel ring."""
    lay, s = spec.layout, spec.shape
    group = lay.data_cp_ranks()
    n, link = len(group), cluster.slowest_link(group)
    layer = s.layer_params(lay.tp)
    root = spec.replicated_params()
    ag = collectives.all_gather(layer * spec.compute_bytes, n, link)
    rs = collectives.reduce_scatter(layer * FSDP_GRAD_BYTES, n, link)
    root_ag = collectives.all_gather(root * spec.compute_bytes, n, link)
    root_rs = collectives.reduce_scatter(root * FSDP_GRAD_BYTES, n, link)
    return ag, rs, root_ag, root_rs, link


def simulate_fsdp(spec: RunSpec, cluster: Cluster, costs: CostModel, base):
    """FSDP's iteration on one rank (all ranks alike); ``base`` is the PP=1 replay of the same
    spec (memory, counters), whose times this replaces."""
    s, lay = spec.shape, spec.layout
    L, N, eff = s.num_layers, spec.num_microbatches, spec.kernel_efficiency
    t = costs.for_layers(1).module
    f = t.forward / eff
    b = (t.backward + (t.forward if spec.recompute else 0.0)) / eff
    ag, rs, root_ag, root_rs, link = layer_collectives(spec, cluster)
    comm_free = 0.0
    exposed = 0.0

    def issue(at: float, seconds: float) -> float:
        nonlocal comm_free
        start = max(at, comm_free)
        comm_free = start + seconds
        return comm_free

    timed: list[TimedAction] = []
    now = 0.0
    for m in range(N):
        root_ready = issue(now, root_ag.seconds)
        ready = issue(now, ag.seconds)  # layer 0, prefetched with the root
        wait = max(root_ready, ready) - now
        exposed += wait
        now += wait + costs.embed_forward / eff
        for j in range(L):
            start = max(now, ready)
            exposed += start - now
            if j + 1 < L:
                ready = issue(start, ag.seconds)
            now = start + f
            timed.append(TimedAction(Action(Kind.FORWARD, 0, 0, mb=m, chunk=j), start, now))
        head = (costs.head_forward + costs.head_backward) / eff
        timed.append(TimedAction(Action(Kind.LOSS, 0, 0, mb=m, chunk=L - 1), now, now + head))
        ready = issue(now, ag.seconds)  # the last layer, gathered again for its backward
        now += head
        for j in reversed(range(L)):
            start = max(now, ready)
            exposed += start - now
            if j > 0:
                ready = issue(start, ag.seconds)
            now = start + b
            timed.append(TimedAction(Action(Kind.BACKWARD, 0, 0, mb=m, chunk=j), start, now))
            issue(now, rs.seconds)
        now += costs.embed_backward / eff
        issue(now, root_rs.seconds)
    pipeline = max(now, comm_free)
    exposed += pipeline - now
    params = spec.rank_params(0) / (lay.dp * lay.cp)
    opt = params * costs.optimizer_per_param
    iteration = pipeline + opt
    compute = sum(a.end - a.start for a in timed)
    wire = N * (2 * L * ag.wire_bytes + L * rs.wire_bytes + root_ag.wire_bytes + root_rs.wire_bytes)
    payload = N * (2 * L * ag.payload_bytes + L * rs.payload_bytes + root_ag.payload_bytes + root_rs.payload_bytes)
    phases = {"FSDP gathers and reduce-scatters not hidden by compute": exposed, "optimizer step (1/n shard)": opt}
    tokens = spec.global_batch_size * s.seq_length
    peak = cluster.device.peak_tflops * 1e12 if cluster.device.peak_tflops else None
    flops = s.model_flops_per_microbatch() * N * lay.dp
    trace = Trace(per_rank=(tuple(timed),), transfers=(), finish=(pipeline,), work=(compute,))
    mem = tuple(replace(m, transient=m.transient + 2 * s.layer_params(lay.tp) * (spec.compute_bytes + FSDP_GRAD_BYTES))
                for m in base.memory)  # two gathered layers (the one computing, the prefetched) and a gradient
    return replace(base, iteration_s=iteration, pipeline_s=pipeline, tokens_per_s=tokens / iteration,
                   mfu=flops / (iteration * lay.world * peak) if peak else None,
                   bubble=1.0 - compute / pipeline if pipeline > 0 else 0.0,
                   bytes_per_link=({link.name: wire},), counter=({"collectives": int(payload)},), memory=mem,
                   trace=trace, phases=phases, work=(compute / 1.0 + opt,))


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
