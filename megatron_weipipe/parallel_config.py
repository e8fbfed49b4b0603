"""The parallel layout's flags: model-parallel sizes, the data-parallel mode and its communication.

Part of the typed run configuration (megatron_weipipe/config.py composes it into
``PretrainConfig``); plain Python, like the rest of the configuration. The rules that read
only these flags are here; those that need the model or the world size are
``PretrainConfig.validate``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option

# --cp-comm-type: Megatron-LM's values; a2a is this package's Ulysses/FPDT.
CP_COMM_TYPES = ("a2a", "p2p", "allgather", "a2a+p2p")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = option(1, help="tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = option(1, help="pipeline-parallel size (PP): the 1F1B pipeline or the "
                                                       "WeiPipe ring")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, help="layers per virtual stage (interleaved 1F1B)")
    context_parallel_size: int = option(1, help="context-parallel size (CP): Ulysses/FPDT over the sequence, or "
                                                 "megatron-core's context parallelism (--cp-comm-type)")
    cp_comm_type: list[str] = option(
        help="context parallelism's communication, Megatron-LM's values, one or one per layer: a2a (the default "
             "here) is this package's Ulysses all-to-all, chunked by --fpdt, on every host; p2p (ring attention), "
             "allgather and a2a+p2p are megatron-core's own context parallelism inside Transformer Engine's "
             "attention, on GPU hosts with TE", choices=CP_COMM_TYPES, default_factory=lambda: ["a2a"])
    hierarchical_context_parallel_sizes: list[int] = option(
        help="with --cp-comm-type a2a+p2p: the sizes of the a2a and p2p levels (their product is "
             "--context-parallel-size)", default_factory=list)
    pipeline_schedule: Optional[str] = option(
        None, help="pipeline schedule, one of those listed at the end of --help (default: none at PP=1, "
                   "interleaved with virtual stages, else 1f1b)")
    sequence_parallel: bool = option(False, help="Megatron sequence parallelism; turned off with a warning at "
                                                 "--tensor-model-parallel-size 1, as Megatron-LM does")
    use_distributed_optimizer: bool = option(False, help="shard optimizer state over data-parallel ranks")
    num_distributed_optimizer_instances: int = option(
        1, help="with --use-distributed-optimizer: shard the optimizer state inside this many groups of "
                "data-parallel ranks and replicate it across them (megatron-core's partial distributed "
                "optimizer: reduce-scatter inside a group, all-reduce across groups); with --use-torch-fsdp2: "
                "HSDP, FSDP2 over a (groups x data x context / groups) mesh, each group holding the whole "
                "model sharded over its ranks")
    use_torch_fsdp2: bool = option(False, help="torch FSDP2 (fully_shard per transformer layer, then the model): "
                                              "parameters, gradients and optimizer state sharded over data x "
                                              "context parallel ranks (docs/how-it-works/fsdp.md)")
    torch_fsdp2_no_reshard_after_forward: bool = option(
        False, help="with --use-torch-fsdp2: keep each unit's gathered weights from its forward to its backward "
             "(ZeRO-2 style: one all-gather per microbatch instead of two, the whole model's weights held "
             "at the start of the backward)")
    torch_fsdp2_no_grad_sync_per_microbatch: bool = option(
        False, help="with --use-torch-fsdp2: reduce-scatter the gradients once per iteration, after the last "
             "microbatch, instead of after every microbatch (the unsharded gradients of the whole model are "
             "accumulated until then)")
    overlap_grad_reduce: bool = option(False, help="overlap the gradient all-reduce with backward")
    use_nccl_ub: bool = option(False, help="allocate megatron-core DDP's gradient and parameter buffers from NCCL's "
                                           "registered memory pool (user buffers: fewer GPU SMs spent on "
                                           "data-parallel communication); NCCL hosts only")
    disable_symmetric_registration: bool = option(False, help="with --use-nccl-ub, register the buffers locally, "
                                                              "not as symmetric windows")
    overlap_param_gather: bool = option(
        False, help="with --use-distributed-optimizer and --overlap-grad-reduce: start the all-gather of the "
                    "updated parameters after the optimizer step and wait for each bucket in the next forward "
                    "(megatron-core DDP's forward pre-hooks)")
    overlap_p2p_comm: bool = option(
        False, help="interleaved 1F1B: overlap the point-to-point sends and receives with the next "
                    "microbatch's compute (megatron-core's overlap_p2p_comm; turned off with a warning "
                    "without virtual stages, as Megatron-LM does)")
    tp_comm_overlap: bool = option(
        False, help="overlap the sequence-parallel all-gathers and reduce-scatters with the linear layers' "
                    "GEMMs (Transformer Engine's userbuffers, on Transformer Engine layers; a notice and no "
                    "effect elsewhere)")
    distributed_backend: Optional[str] = option(None, choices=("nccl", "gloo"),
                                                help="process-group backend (default: nccl on GPU hosts, gloo "
                                                     "on CPU hosts)")
    distributed_timeout_minutes: int = option(10, help="timeout of collectives")
    weipipe_grad_dtype: str = option("fp32", choices=("fp32", "bf16"),
                                     help="dtype of WeiPipe's circulating gradients")

    def resolved(self, schedule_name: str) -> "ParallelConfig":
        """The schedule filled in, and what Megatron-LM turns off where it cannot apply
        (arguments.resolve_defaults warns): --sequence-parallel at TP 1, --overlap-p2p-comm
        without virtual stages."""
        virtual = self.num_layers_per_virtual_pipeline_stage is not None
        return replace(self, pipeline_schedule=schedule_name,
                       sequence_parallel=self.sequence_parallel and self.tensor_model_parallel_size > 1,
                       overlap_p2p_comm=self.overlap_p2p_comm and virtual)

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "num_distributed_optimizer_instances"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        self._validate_data_parallel_communication()
        self._validate_cp_comm_type()
        require(not self.tp_comm_overlap or self.sequence_parallel,
                "--tp-comm-overlap needs --sequence-parallel (and --tensor-model-parallel-size > 1), as in "
                "Megatron-LM: it overlaps the sequence-parallel all-gathers and reduce-scatters with the GEMMs")

    def _validate_cp_comm_type(self) -> None:
        require(len(self.cp_comm_type) > 0, "--cp-comm-type needs a value")
        if "a2a+p2p" in self.cp_comm_type:
            sizes = self.hierarchical_context_parallel_sizes
            require(len(sizes) > 1 and math.prod(sizes) == self.context_parallel_size,
                    f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes whose product is "
                    f"--context-parallel-size ({self.context_parallel_size}), not {sizes}")
        else:
            require(not self.hierarchical_context_parallel_sizes,
                    "--hierarchical-context-parallel-sizes needs --cp-comm-type a2a+p2p")

    @property
    def megatron_context_parallel(self) -> bool:
        """megatron-core's own context parallelism (Transformer Engine's attention), not Ulysses/FPDT."""
        return self.context_parallel_size > 1 and any(t != "a2a" for t in self.cp_comm_type)

    def _validate_data_parallel_communication(self) -> None:
        """Megatron-LM's rules of the distributed optimizer's overlaps and instances."""
        if self.use_torch_fsdp2:
            require(not self.overlap_param_gather, "--overlap-param-gather cannot be combined with "
                                                   "--use-torch-fsdp2 (FSDP2 prefetches its own parameter "
                                                   "all-gathers)")
        require(not self.overlap_param_gather or self.use_distributed_optimizer,
                "--overlap-param-gather needs --use-distributed-optimizer (it defers the distributed optimizer's "
                "parameter all-gather), as in Megatron-LM")
        require(not self.overlap_param_gather or self.overlap_grad_reduce,
                "--overlap-param-gather needs --overlap-grad-reduce, as in Megatron-LM")
        require(self.num_distributed_optimizer_instances == 1 or self.use_distributed_optimizer
                or self.use_torch_fsdp2,
                "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer (it replicates the "
                "distributed optimizer's shards) or --use-torch-fsdp2 (HSDP)")
        for name in ("torch_fsdp2_no_reshard_after_forward", "torch_fsdp2_no_grad_sync_per_microbatch"):
            require(not getattr(self, name) or self.use_torch_fsdp2,
                    f"--{name.replace('_', '-')} needs --use-torch-fsdp2")

    def validate_data_parallel_size(self, data_parallel_size: int) -> None:
        n = self.num_distributed_optimizer_instances
        require(data_parallel_size * self.context_parallel_size % n == 0,
                f"--num-distributed-optimizer-instances ({n}) must divide data x context parallel size "
                f"({data_parallel_size} x {self.context_parallel_size})")

    def virtual_pipeline_size(self, num_layers: int) -> Optional[int]:
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
