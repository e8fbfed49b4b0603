"""What the parity checks train: the model sizes, one run per schedule or feature, and the
batches (one world size and environment each) those runs share.

Every run trains 3 iterations on the bundled corpus (dropout off) and is compared with a
reference run of the same batch: ``reference*`` is PP = 1, data-parallel over the world,
same global batch. A ring of P ranks trains 2P layers (interleaved: 2 virtual stages of
one layer per rank) on 4P sequences (tiny) or 2P (big), so every schedule has its G = N/P
microbatches. Sizes:

- tiny (fp32): 2P layers, hidden 64, 8 heads / 4 groups, S 64, micro-batch 2. Messages are
  a few hundred KB: this catches wrong gradients and flows, at the tightest tolerance.
- big (bf16): 2P layers, hidden 1024, 16 heads / 4 groups, FFN 4096, S 4096, micro-batch 1.
  A WeiPipe chunk (2 layers) is 30.4 M parameters: 61 MB in bf16, 122 MB as fp32
  gradients; a 1F1B activation is 8 MiB. Run with ``NCCL_BUFFSIZE`` = 64 KiB, no send of
  them can complete before its receive is posted, so an ordering bug hangs here (and
  ``TORCH_NCCL_BLOCKING_WAIT`` turns the hang into an error at the collective timeout).

The delayed-copy runs (``*-delayed``) sleep on the offload copy stream before each copy
and must be bitwise equal to the same run without the sleeps (``*-again`` is that run
twice: the control that the comparison can decide at all).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_weipipe.schedules import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = registry.pipeline_names()
# Losses and gradient norms of 3 iterations, relative to the reference.
RTOL = {"gloo": 1e-5, "nccl": 1e-4, "te": 1e-3, "bf16": 1e-2}
# The NCCL parity batches: sends larger than NCCL's buffer block until received, a
# collective that hangs raises after --distributed-timeout-minutes, cuBLAS is deterministic
# (the bitwise rows).
NCCL_PARITY_ENV = {"NCCL_BUFFSIZE": "65536", "TORCH_NCCL_BLOCKING_WAIT": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

COMMON = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=512, train_iters=3, lr=1e-3,
              hidden_dropout=0, attention_dropout=0, data_path=os.path.join(ROOT, "data", "sample_text_document"),
              tokenizer_type="ByteLevelTokenizer", log_interval=1, eval_iters=0, seed=1234)
TINY = dict(hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4, seq_length=64,
            micro_batch_size=2)
BIG = dict(hidden_size=1024, num_attention_heads=16, group_query_attention=True, num_query_groups=4,
           ffn_hidden_size=4096, seq_length=4096, micro_batch_size=1, bf16=True)
TE = dict(transformer_impl="transformer_engine", allow_unverified_gpu_paths=True)
# What each feature run adds (at a world of 2); the layer-offload runs recompute every layer.
FEATURES = {
    "fpdt-cp2": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
    "fpdt-offload-cp2": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16, fpdt_offload=True),
    # the padded vocabulary is a multiple of divisible-by x TP: 256 x 2 keeps the reference's 512
    "tp2": dict(tensor_model_parallel_size=2, make_vocab_size_divisible_by=256),
    "fsdp2": dict(use_torch_fsdp2=True),
    "layer-offload-1f1b": dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b",
                               recompute_granularity="full", recompute_method="uniform", offload_layer_inputs=True),
    "layer-offload-weipipe-interleave": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave",
                                             recompute_granularity="full", recompute_method="uniform",
                                             offload_layer_inputs=True),
}
LAYER_OFFLOAD_P1 = dict(recompute_granularity="full", recompute_method="uniform", offload_layer_inputs=True)


@dataclass(frozen=True)
class Run:
    """One pretrain() of a batch and the row it yields (none for a reference)."""

    name: str
    flags: dict
    row: str = ""
    argv: tuple = ()  # pretrain flags verbatim (the example runs), instead of ``flags``
    reference: str = ""  # the run it is compared with
    rtol: float = 0.0  # 0: bitwise
    control: str = ""  # bitwise rows: a repeat of ``reference`` that must be bitwise equal to it
    timeout_s: float = 120.0
    sync_debug: bool = False  # count host syncs inside forward/backward (CUDA)
    delay_copies: bool = False  # sleep on the offload copy stream before each copy
    deterministic: bool = False

    def spec(self) -> dict:
        return dict(name=self.name, flags=list(self.argv) or flag_list(self.flags), sync_debug=self.sync_debug,
                    delay_copies=self.delay_copies, deterministic=self.deterministic)


@dataclass(frozen=True)
class Batch:
    """Runs sharing one torchrun: world size, backend, environment."""

    name: str
    world: int
    backend: str
    runs: tuple
    env: dict = field(default_factory=dict)
    syncs_row: str = ""  # one row: no host sync inside any run's forward/backward (CUDA only)

    @property
    def rows(self) -> tuple:
        return tuple(r.row for r in self.runs if r.row) + ((self.syncs_row,) if self.syncs_row else ())


def flag_list(flags: dict) -> list:
    out = []
    for k, v in flags.items():
        if v is False or v is None:
            continue
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def model(size: str, P: int) -> dict:
    """The base flags of a ring of ``P`` (see the module docstring)."""
    shape = TINY if size == "tiny" else BIG
    return {**COMMON, **shape, "num_layers": 2 * P, "global_batch_size": (4 if size == "tiny" else 2) * P}


def backend_flags(backend: str) -> dict:
    """NCCL: a collective that hangs raises after a minute (with TORCH_NCCL_BLOCKING_WAIT),
    before the run's own timeout cuts it."""
    return {"distributed_backend": backend, **({"distributed_timeout_minutes": 1} if backend == "nccl" else {})}


def schedule_flags(schedule: str, P: int) -> dict:
    if registry.entry(schedule).virtual_stages:  # Megatron's default schedule for virtual stages
        return dict(pipeline_model_parallel_size=P, num_layers_per_virtual_pipeline_stage=1)
    return dict(pipeline_model_parallel_size=P, pipeline_schedule=schedule)


def ring_runs(prefix: str, backend: str, P: int, size: str, ref: str, rtol: float, extra=None, **kw) -> list[Run]:
    """``ref`` (PP = 1) and every schedule at P, rows ``<prefix>-<schedule>``."""
    base = {**model(size, P), **backend_flags(backend), **(extra or {})}
    runs = [Run(ref, base, **kw)]
    runs += [Run(f"{ref}:{s}", {**base, **schedule_flags(s, P)}, row=f"{prefix}-{s}", reference=ref, rtol=rtol, **kw)
             for s in SCHEDULES]
    return runs


def feature_runs(prefix: str, backend: str, ref: str, rtol: float, features, **kw) -> list[Run]:
    base = {**model("tiny", 2), **backend_flags(backend)}
    return [Run(f"{ref}:{f}", {**base, **FEATURES[f]}, row=f"{prefix}-{f}", reference=ref, rtol=rtol, **kw)
            for f in features]


def delayed_runs(row: str, flags: dict, name: str, **kw) -> list[Run]:
    """``name``, ``name-again`` (control) and ``name-delayed``: bitwise equal, deterministic kernels."""
    kw = dict(kw, deterministic=True)
    return [Run(name, {**flags, "deterministic_mode": True}, **kw),
            Run(f"{name}-again", {**flags, "deterministic_mode": True}, **kw),
            Run(f"{name}-delayed", {**flags, "deterministic_mode": True}, row=row, reference=name,
                control=f"{name}-again", delay_copies=True, **kw)]


def p2_batch(backend: str, sync_debug: bool) -> Batch:
    """Every schedule and feature at 2 ranks (tiny, fp32); on NCCL also bf16 at the big size."""
    rtol = RTOL[backend]
    kw = dict(sync_debug=sync_debug, timeout_s=120.0 if backend == "gloo" else 90.0)
    runs = ring_runs(f"{backend}-parity", backend, 2, "tiny", "reference", rtol, **kw)
    runs += feature_runs(f"{backend}-parity", backend, "reference", rtol, FEATURES, **kw)
    base = {**model("tiny", 2), **backend_flags(backend)}
    runs += delayed_runs(f"{backend}-delayed-copy-fpdt-offload-cp2", {**base, **FEATURES["fpdt-offload-cp2"]},
                         "fpdt-offload-cp2", **kw)
    runs += delayed_runs(f"{backend}-delayed-copy-layer-offload-weipipe-interleave",
                         {**base, **FEATURES["layer-offload-weipipe-interleave"]}, "layer-offload-weipipe", **kw)
    env = {}
    if backend == "nccl":
        runs += ring_runs("nccl-parity-bf16-p2", backend, 2, "big", "reference-bf16", RTOL["bf16"],
                          sync_debug=True, timeout_s=180.0)
        env = NCCL_PARITY_ENV
    return Batch(f"{backend}-p2", 2, backend, tuple(runs), env, "nccl-host-syncs-p2" if sync_debug else "")


def ring_batch(backend: str, P: int, label: str) -> Batch:
    """A ring of ``P`` >= 3 (separate pair communicators for the two neighbours): every
    schedule, tiny fp32; on NCCL also the big bf16 model."""
    runs = ring_runs(f"{backend}-parity-{label}", backend, P, "tiny", "reference", RTOL[backend],
                     sync_debug=backend == "nccl", timeout_s=120.0)
    env = {}
    if backend == "gloo":  # bf16 code paths at the tiny size
        runs += ring_runs(f"gloo-parity-bf16-{label}", backend, P, "tiny", "reference-bf16", RTOL["bf16"],
                          extra={"bf16": True}, timeout_s=120.0)
    if backend == "nccl":
        runs += ring_runs(f"nccl-parity-bf16-{label}", backend, P, "big", "reference-bf16", RTOL["bf16"],
                          sync_debug=True, timeout_s=240.0)
        env = NCCL_PARITY_ENV
    return Batch(f"{backend}-{label}", P, backend, tuple(runs), env,
                 f"nccl-host-syncs-{label}" if backend == "nccl" else "")


def te_batch() -> Batch:
    """Transformer Engine layers in every run (FPDT builds its own local-layer spec)."""
    runs = ring_runs("te-nccl-parity", "nccl", 2, "tiny", "reference", RTOL["te"], extra=TE, timeout_s=120.0)
    return Batch("te-nccl-p2", 2, "nccl", tuple(runs), NCCL_PARITY_ENV)


def one_gpu_batch() -> Batch:
    """One GPU, PP = 1 with layer offload (megatron-core's block path): delayed copies
    bitwise equal; no host sync in forward/backward."""
    flags = {**model("tiny", 1), **backend_flags("nccl"), **LAYER_OFFLOAD_P1}
    runs = delayed_runs("cuda-delayed-copy-layer-offload", flags, "layer-offload-p1", sync_debug=True,
                        timeout_s=90.0)
    return Batch("cuda-p1", 1, "nccl", tuple(runs), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "cuda-host-syncs-p1")
