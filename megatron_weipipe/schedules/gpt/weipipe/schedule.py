"""`--pipeline-schedule weipipe-*` for pretrain(): every WeiPipe variant of the registry.

Ring = the pipeline-model-parallel group (P ranks). Each ring rank trains G =
num_microbatches / P microbatches of its own per iteration through all P decoder
chunks, the chunks' weights and gradients circulating (schedules/runtime/ring.py).
The variant only decides the action lists (its plan, through the registry); this class
is the same for all of them. A plan is generated and validated for one G: under a
batch-size ramp each G the run reaches gets its own, built when first reached and kept
(the start-up rules refuse a ramp whose microbatch counts the ring does not divide).
At the rank's OPTIMIZER_STEP the owner's summed chunk gradient is copied into
megatron-core DDP's main_grad (and, with --overlap-grad-reduce, its data-parallel
reduction starts); after the schedule the replicated parameters'
gradients are summed over the ring and DDP finishes the data-parallel reduction
(grad_sync.py), so megatron-core's optimizer (fp32 master, clipping, Adam) and
checkpointing run unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.func import functional_call

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.weight_pass import TRAINING_WEIGHT_PASS
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.gpt.base import ForwardStep, ModelProvider, StepResult, TrainSchedule

# Runtime flows -> the kinds the log line's sent/rank/iter shows.
FLOW_KIND = {"fwd_weights": "weights", "bwd_weights": "weights", "placement": "weights", "grads": "gradients"}


class WeiPipeSchedule(TrainSchedule):
    """Any WeiPipe variant (``self.name``, from the configuration); its start-up rules
    are check/rules.py's check_weipipe."""

    def __init__(self, cfg: PretrainConfig, ctx):
        super().__init__(cfg, ctx)
        if registry.entry(self.name).family != registry.WEIPIPE:
            raise ValueError(f"{self.name!r} is not a WeiPipe schedule")
        self.P = self.groups.pp_size
        self.G = cfg.num_microbatches // self.P  # at --global-batch-size
        self.runtime = None  # the runtime of the G of the last iteration (of --global-batch-size before any)
        self.runtimes: dict = {}  # G -> WeiPipeRuntime of that G's validated plan
        self.last_iteration = None

    # ------------------------------------------------------------------ model

    def build_model(self, model_provider: ModelProvider) -> list[torch.nn.Module]:
        from megatron_weipipe.model.gpt import compute_dtype
        from megatron_weipipe.schedules.runtime.flat import FlatViews
        from megatron_weipipe.schedules.gpt.megatron_schedules import ddp_config

        from megatron_weipipe.schedules.gpt.weipipe import deferred
        from megatron_weipipe.schedules.gpt.weipipe.grad_sync import RingGradSync
        from megatron_weipipe.schedules.gpt.weipipe.ring_model import DecoderChunk, make_ring_replicas, replicated_parameters
        from megatron_weipipe.schedules.gpt.weipipe.steps import GPTEnds

        g = self.groups
        model = model_provider(pre_process=True, post_process=True)
        make_ring_replicas(model, g.pp_rank, g.pipeline, dist.get_global_rank(g.pipeline, 0),
                           embedding_summed=model.share_embeddings_and_output_weights
                           and not self.cfg.model.layout_invariant_init)
        self.model = model
        selective = self.cfg.model.recompute_granularity == "selective"
        self.template = DecoderChunk(model.decoder.layers, model.config.sequence_parallel, selective)
        self.layout = FlatViews.from_module(self.template)
        self.deferrable = deferred.install(self.template)  # QKV, projection, FC1, FC2 of every layer
        self.owned = dict(self.template.named_parameters())
        self.replicated = [p for _, p in replicated_parameters(model)]
        # --overlap-grad-reduce: the owned chunk's bucket is reduced from its grad_ready on
        self.grad_sync = RingGradSync.wrap(model, ddp_config(self.cfg), self.owned, self.replicated, g.pipeline)
        self.model_chunks = [self.grad_sync.ddp]
        self.ends = GPTEnds(model, num_microbatches=self.G * self.P, cp_size=g.cp_size)
        self.compute_dtype = compute_dtype(self.cfg)
        self.runtime = self._runtime(self.G)
        return self.model_chunks

    def _runtime(self, G: int):
        """The runtime of G microbatches per ring rank: its plan generated and validated once."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from megatron_weipipe.schedules.check.validate import validate
        from megatron_weipipe.schedules.generate.weipipe import generate
        from megatron_weipipe.schedules.runtime.ring import WeiPipeRuntime

        if G in self.runtimes:
            return self.runtimes[G]
        schedule = generate(self.name, self.P, G)
        validate(schedule)
        model, g = self.model, self.groups
        self.runtimes[G] = WeiPipeRuntime(
            schedule,
            ring_group=g.pipeline,
            chunk_template=self.template,
            compute_dtype=self.compute_dtype,
            grad_dtype=torch.bfloat16 if self.cfg.parallel.weipipe_grad_dtype == "bf16" else torch.float32,
            recompute=self.cfg.model.recompute_granularity == "full",
            comm_scope=lambda flow: self.ctx.bytes.scope(FLOW_KIND[flow.value]),
            # what a recomputed chunk forward replays to draw the same dropout masks
            rng=self.ctx.platform.rng_streams(tracker=get_cuda_rng_tracker()),
            # The split backward of weipipe-zb: the linear layers' weight GEMMs run at W.
            weight_pass=TRAINING_WEIGHT_PASS,
            tracer=self.tracer,
            # --offload-layer-inputs: the chunk inputs kept for recomputation wait on the host
            offload=getattr(model.decoder, "layer_input_store", None),
            # selective recomputation runs the template's modules again inside a backward
            rebind=self.cfg.model.recompute_granularity == "selective",
        )
        return self.runtimes[G]

    def data_shard(self) -> tuple[int, int, int]:
        """Ring rank r of replica d reads global microbatches (d*P + r) + k*DP*P: the
        ring's G*P microbatches are the ones a PP=1 run reads in that iteration."""
        g = self.groups
        return g.dp_rank * self.P + g.pp_rank, g.dp_size * self.P, self.G

    def local_microbatches(self, num_microbatches: int) -> int:
        """G = N / P: each ring rank trains its own G of the replica's N."""
        return num_microbatches // self.P

    def _master(self) -> torch.Tensor:
        """The owned chunk's current (post-step) weights, flat."""
        return self.layout.flatten(self.template, dtype=torch.float32)

    # ------------------------------------------------------------------ step

    def forward_backward(self, forward_step: ForwardStep, microbatches: list[dict],
                         forward_only: bool = False) -> StepResult:
        from megatron_weipipe.schedules.gpt.weipipe.steps import prepare_microbatches

        mbs = prepare_microbatches(forward_step, self.model, microbatches)
        if forward_only:
            self._forward_only(mbs)
        else:
            self.runtime = self._runtime(len(mbs))
            self.ends.num_microbatches = len(mbs) * self.P  # the loss is divided by the replica's N
            with self.trace_iteration():
                with self.grad_sync.schedule_scope():
                    result = self.runtime.run_iteration(
                        self._master(), mbs, pre_fn=self.ends.pre_fn, post_fn=self.ends.post_fn,
                        chunk_kwargs=self.ends.chunk_kwargs, grad_ready=self._grad_ready,
                    )
                self._finish_grads()
                if self.tracer is not None:  # in the trace file's otherData (written as the span ends)
                    meta = self.tracer.meta
                    meta["wgrad_peak_bytes"] = max(meta.get("wgrad_peak_bytes", 0), result.wgrad_peak_bytes)
            self.last_iteration = result  # deferred weight-gradient memory, bytes
        return StepResult(losses=[mb.reported for mb in mbs], has_loss=True)

    def _grad_ready(self, chunk: int, chunk_grad: torch.Tensor) -> None:
        """The runtime's callback at OPTIMIZER_STEP: the owned chunk's gradient is final."""
        self.grad_sync.grad_ready(chunk, self.layout.views(chunk_grad))

    def _finish_grads(self) -> None:
        """Replicas summed over the ring, every data-parallel reduction finished, then the
        sequence-parallel norms' and the query/key norms' TP sum."""
        self.grad_sync.finish()
        if self.model.config.sequence_parallel or self.model.config.qk_layernorm:
            from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

            _allreduce_non_tensor_model_parallel_grads(self.model_chunks, self.model.config, self.groups.tensor)

    @torch.no_grad()
    def _forward_only(self, mbs) -> None:
        """Evaluation: each owner broadcasts its chunk in turn; every rank runs its own
        microbatches through it. One chunk resident at a time, no schedule needed."""
        g = self.groups
        hidden = [None] * len(mbs)
        master = self._master().to(self.compute_dtype)
        for c in range(self.P):
            flat = master if g.pp_rank == c else torch.empty_like(master)
            with self.ctx.bytes.scope("weights"):
                dist.broadcast(flat, src=dist.get_global_rank(g.pipeline, c), group=g.pipeline)
            views = self.layout.views(flat)
            for i, mb in enumerate(mbs):
                x = self.ends.pre_fn(mb).to(self.compute_dtype) if c == 0 else hidden[i]
                hidden[i] = functional_call(self.template, views, (x,), self.ends.chunk_kwargs(mb))
        for i, mb in enumerate(mbs):
            self.ends.post_fn(hidden[i], mb)
