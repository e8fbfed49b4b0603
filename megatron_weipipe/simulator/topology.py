"""TawPipe (Wu & Chen, AAAI '26), a topology-aware weight pipeline, as a closed-form cost.

TawPipe keeps WeiPipe's idea (ranks keep their microbatches, weights move) and its layout
(P ranks, rank c owns the c-th chunk of L/P layers for good: fp32 master and optimizer
state), but moves weights by node: the ranks of a node run the same chunk at the same
time on their own microbatches. Before each chunk-step the chunk's weights are fetched
point-to-point from its owner's node when that is another node ((n-1)/n of the chunks
over n nodes, the chunks being dealt round the nodes) and then broadcast inside the
node; after a backward chunk-step its gradient is reduced inside the node and sent to the
owner's node the same way. Weights for the next steps are prefetched (three buffers:
one computing, one being broadcast, one arriving), so a chunk-step lasts as long as the
slowest of its compute, its inter-node transfers (one NIC per node: per direction, the
weights it receives and the gradients it sends carry the same bytes as those it sends
and receives) and its intra-node collectives. Nodes start one chunk-step apart, so an
iteration adds n-1 steps of skew, and the first chunk's fetch is exposed once. After the
microbatches, as in WeiPipe: the all-reduce of the replicated embedding / norm / output
layer gradients over every rank, then the optimizer on each rank's own chunk.

Not replayed from action lists: no runtime here runs TawPipe, so this is the paper's
design as costs, for comparison with the replayed WeiPipe and the FSDP / HSDP model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_weipipe.errors import require_simulable
from megatron_weipipe.schedules.timing.replay import Trace

from . import collectives
from .costs import CostModel
from .hardware import Cluster
from .run_spec import RunSpec


@dataclass(frozen=True)
class TawPipeStep:
    """One chunk-step's seconds: compute, inter-node transfers (per NIC direction), intra-node collectives."""

    compute: float
    inter: float
    intra: float

    @property
    def seconds(self) -> float:
        return max(self.compute, self.inter, self.intra)


@dataclass(frozen=True)
class TawPipeCost:
    forward: TawPipeStep
    backward: TawPipeStep
    steps_per_microbatch: int  # P chunk-steps each way
    microbatches: int  # per rank
    ends: float  # embedding and output layer per microbatch
    fill: float  # the first chunk's fetch, and the nodes' skew
    after: float  # replicated gradients' all-reduce and the optimizer step
    inter_bytes: float  # per node and direction, per iteration
    intra_bytes: float  # per rank, per iteration
    compute: float  # per rank, per iteration

    @property
    def pipeline(self) -> float:
        P = self.steps_per_microbatch
        return self.microbatches * (P * (self.forward.seconds + self.backward.seconds) + self.ends) + self.fill

    @property
    def iteration(self) -> float:
        return self.pipeline + self.after


def nodes_of(spec: RunSpec, cluster: Cluster) -> tuple[int, int]:
    """(ranks per node, nodes) of the ring."""
    P = spec.layout.pp
    g = min(cluster.gpus_per_node, P)
    require_simulable(P % g == 0, f"tawpipe: the {P} ring ranks must fill whole nodes of {cluster.gpus_per_node}")
    return g, P // g


def tawpipe_cost(spec: RunSpec, cluster: Cluster, costs: CostModel) -> TawPipeCost:
    lay, s = spec.layout, spec.shape
    require_simulable(lay.dp * lay.cp == 1, "tawpipe is modelled for one ring (DP = CP = 1)")
    P = lay.pp
    g, n = nodes_of(spec, cluster)
    G = spec.num_microbatches // P
    eff = spec.kernel_efficiency
    t = costs.for_layers(spec.layers_per_chunk).module
    f = t.forward / eff
    b = (t.backward + t.forward * spec.recompute_share) / eff
    w = spec.chunk_params() * spec.compute_bytes
    gr = spec.chunk_params() * spec.weipipe_grad_bytes
    remote = (n - 1) / n  # chunks owned by another node
    inter = cluster.inter
    bcast = collectives.broadcast(w, g, cluster.intra)
    red = collectives.reduce(gr, g, cluster.intra)
    fwd = TawPipeStep(f, remote * inter.time(w) if n > 1 else 0.0, bcast.seconds)
    bwd = TawPipeStep(b, remote * (inter.time(w) + inter.time(gr)) if n > 1 else 0.0, bcast.seconds + red.seconds)
    ends = (costs.embed_forward + costs.head_forward + costs.embed_backward + costs.head_backward) / eff
    first = (remote * inter.time(w) if n > 1 else 0.0) + bcast.seconds
    fill = first + (n - 1) * (fwd.seconds + bwd.seconds) / 2
    ar = collectives.all_reduce(spec.replicated_params() * 4, P, cluster.slowest_link(spec.layout.pipeline_ranks()))
    opt = spec.rank_params(0) * costs.optimizer_per_param
    steps = G * P
    return TawPipeCost(
        forward=fwd, backward=bwd, steps_per_microbatch=P, microbatches=G, ends=ends, fill=fill,
        after=ar.seconds + opt, inter_bytes=steps * remote * (2 * w + gr) if n > 1 else 0.0,
        intra_bytes=steps * (bcast.wire_bytes * 2 + red.wire_bytes), compute=G * (P * (f + b) + ends))


def project_tawpipe(spec: RunSpec, cluster: Cluster, costs: CostModel, base):
    """TawPipe's result: ``base`` (the WeiPipe replay of the same spec: memory, counters) with
    TawPipe's times and bytes."""
    c = tawpipe_cost(spec, cluster, costs)
    s, lay = spec.shape, spec.layout
    g, _ = nodes_of(spec, cluster)
    iteration = c.iteration
    tokens = spec.global_batch_size * s.seq_length
    peak = cluster.device.peak_tflops * 1e12 if cluster.device.peak_tflops else None
    flops = s.model_flops_per_microbatch() * spec.num_microbatches * lay.dp
    wire = {cluster.intra.name: c.intra_bytes}
    if c.inter_bytes:
        wire[cluster.inter.name] = wire.get(cluster.inter.name, 0.0) + c.inter_bytes / g  # the node's, per rank
    P = lay.pp
    phases = {"forward chunk-step (compute)": c.forward.compute,
              "forward chunk-step (inter-node weights)": c.forward.inter,
              "forward chunk-step (intra-node broadcast)": c.forward.intra,
              "backward chunk-step (compute)": c.backward.compute,
              "backward chunk-step (inter-node weights and gradient)": c.backward.inter,
              "backward chunk-step (intra-node broadcast and reduce)": c.backward.intra,
              "first fetch and node skew": c.fill,
              "replicated grads' all-reduce and optimizer step": c.after}
    trace = Trace(per_rank=((),) * P, transfers=(), finish=(c.pipeline,) * P, work=(c.compute,) * P)
    return replace(base, iteration_s=iteration, pipeline_s=c.pipeline, tokens_per_s=tokens / iteration,
                   mfu=flops / (iteration * lay.world * peak) if peak else None,
                   bubble=1.0 - c.compute / c.pipeline if c.pipeline > 0 else 0.0,
                   bytes_per_link=(wire,) * P, trace=trace, phases=phases, work=(c.compute,) * P)
