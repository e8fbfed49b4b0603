"""torch's CUDA attention ops as FPDT block kernels: flash, cuDNN and memory-efficient.

All three return the log-sum-exp the chunk merge needs:

  cuda_flash      aten._scaled_dot_product_flash_attention (+ _backward), FlashAttention-2;
                  fp16/bf16, head_dim % 8 == 0 and <= 256; lse [b, h, sq]; causal is
                  bottom-right aligned.
  cudnn           aten._scaled_dot_product_cudnn_attention (+ _backward); fp16/bf16;
                  lse [b, h, sq, 1]; causal is top-left aligned.
  cuda_efficient  aten._scaled_dot_product_efficient_attention (+ _backward); fp32 too;
                  lse [b, h, ceil(sq/32)*32], padded (the backward wants that layout back);
                  causal is top-left aligned.

FPDT's causal blocks are square (the diagonal chunk pair, document squares inside it),
where the two alignments agree; a non-square causal call is refused, not mis-masked.

Every op is called with keyword arguments bound from its schema (``bind``), so a torch
release that renames, adds or drops an argument (pyproject allows torch >= 2.4) either
binds, or fails the probe with a sentence naming the argument, and ``auto`` falls back.
The backward wants auxiliary outputs of a forward of the same shapes (cumulative
lengths, maximum lengths, rng state); with no dropout they depend only on the shapes, so
the last ones per shape are kept. GQA: flash and cuDNN are probed once per (dtype,
head_dim) for grouped heads (values compared with the math kernel); the
memory-efficient kernel wants equal head counts and is not probed
(``kernel_base.GroupedKernel`` folds or expands for it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_weipipe.fpdt.kernel_base import SELF_CHECK_TOL, GroupedKernel, MathKernel

# Argument and result names that differ between torch releases, mapped to one spelling.
ALIASES = {
    "grad_out_": "grad_out",
    "log_sumexp": "logsumexp",
    "softmax_logsumexp": "logsumexp",
    "compute_logsumexp": "compute_log_sumexp",
    "rng_state": "philox_seed",
    "unused": "philox_offset",
}
_NOT_AUX = ("output", "logsumexp", "debug_attn_mask")


class SchemaMismatch(RuntimeError):
    """An op's schema in this torch does not take the arguments an adapter relies on."""


@functools.lru_cache(maxsize=None)
def op_schema(name: str):
    """The FunctionSchema of aten::``name`` (present in CPU builds too), or None."""
    try:
        return torch._C._get_schema(f"aten::{name}", "")
    except RuntimeError:
        return None


def bind(schema, values: dict, need=()) -> dict:
    """Keyword arguments for ``schema`` from ``values`` (keys in ALIASES' spelling).

    Values the schema does not take are dropped, unless named in ``need``; an argument
    without a default that ``values`` lacks raises SchemaMismatch, as does a dropped one
    from ``need``."""
    kwargs, used = {}, set()
    for arg in schema.arguments:
        key = ALIASES.get(arg.name, arg.name)
        if key in values:
            kwargs[arg.name] = values[key]
            used.add(key)
        elif not arg.has_default_value():
            raise SchemaMismatch(f"{schema.name} in torch {torch.__version__} needs argument {arg.name!r}, "
                                 f"which this adapter does not supply")
    missing = [n for n in need if n not in used]
    if missing:
        raise SchemaMismatch(f"{schema.name} in torch {torch.__version__} takes no {', '.join(missing)}")
    return kwargs


def name_results(schema, result) -> dict:
    """Results by name (ALIASES' spelling); unnamed ones by position ("0", "1", ...)."""
    result = result if isinstance(result, (tuple, list)) else (result,)
    out = {}
    for i, (ret, val) in enumerate(zip(schema.returns, result)):
        out[ALIASES.get(ret.name, ret.name) if ret.name else str(i)] = val
    return out


def call(name: str, values: dict, need=()) -> dict:
    """Call aten::``name`` (looked up now, on torch.ops.aten) with arguments bound by schema."""
    schema = op_schema(name)
    if schema is None:
        raise SchemaMismatch(f"torch {torch.__version__} has no aten::{name}")
    result = getattr(torch.ops.aten, name)(**bind(schema, values, need))
    return name_results(schema, result)


@dataclass(frozen=True)
class LseLayout:
    """How an op lays out the log-sum-exp of sq query rows: ``rows`` entries along the
    last dim (>= sq: padded), plus a trailing singleton dim when ``trailing_one``."""

    rows: int
    trailing_one: bool = False

    @staticmethod
    def of(raw: torch.Tensor, sq: int) -> LseLayout:
        if raw.dim() == 4 and raw.shape[-1] == 1 and raw.shape[2] == sq:
            return LseLayout(sq, True)
        if raw.dim() == 3 and raw.shape[-1] >= sq:
            return LseLayout(raw.shape[-1])
        raise SchemaMismatch(f"log-sum-exp of shape {tuple(raw.shape)} does not hold {sq} query rows")

    def to_bhs(self, raw: torch.Tensor, sq: int) -> torch.Tensor:
        """[b, h, sq] float32 (a view: the padding is sliced off, the singleton dropped)."""
        lse = raw.squeeze(-1) if self.trailing_one else raw
        return lse[..., :sq].float()

    def from_bhs(self, lse: torch.Tensor) -> torch.Tensor:
        """The op's own layout of a [b, h, sq] lse, contiguous; padded rows get +inf
        (p = exp(s - lse) = 0 there, as the kernels themselves assume)."""
        lse = lse.float()
        sq = lse.shape[-1]
        if self.rows > sq:
            full = lse.new_full((*lse.shape[:-1], self.rows), math.inf)
            full[..., :sq] = lse
            lse = full
        lse = lse.contiguous()
        return lse.unsqueeze(-1) if self.trailing_one else lse


_GQA_PROBES: dict = {}


class AtenKernel(GroupedKernel):
    """One torch CUDA attention op pair behind the block-kernel interface."""

    fwd_op = bwd_op = ""
    probe_gqa = False
    fwd_values: dict = {}
    bwd_values: dict = {}
    FWD_NEED = ("query", "key", "value", "is_causal", "scale")
    BWD_NEED = ("grad_out", "query", "key", "value", "out", "logsumexp", "is_causal", "scale")

    def __init__(self):
        super().__init__()
        self._aux: dict = {}

    @classmethod
    def schema_problem(cls) -> str | None:
        """Why this torch's schemas cannot be called (None: they bind), for the probe."""
        probe = dict(query=None, key=None, value=None, out=None, grad_out=None, logsumexp=None,
                     is_causal=True, scale=1.0, dropout_p=0.0)
        try:
            for name, extra, need in ((cls.fwd_op, cls.fwd_values, cls.FWD_NEED),
                                      (cls.bwd_op, cls.bwd_values, cls.BWD_NEED)):
                schema = op_schema(name)
                if schema is None:
                    return f"torch {torch.__version__} has no aten::{name}"
                bind(schema, {**probe, **_AUX_PLACEHOLDERS, **extra}, need)
        except SchemaMismatch as e:
            return str(e)
        return None

    def prepare(self, device, dtype, head_dim) -> None:
        problem = self.schema_problem()
        if problem:
            raise SchemaMismatch(problem)
        if self.probe_gqa:
            self._probe(torch.device(device).type, dtype, head_dim)

    def _probe(self, device_type, dtype, head_dim) -> bool:
        key = (type(self).__name__, device_type, dtype, head_dim)
        if key not in _GQA_PROBES:
            _GQA_PROBES[key] = _gqa_agrees(self, device_type, dtype, head_dim)
        return _GQA_PROBES[key]

    def native_gqa_for(self, q) -> bool:
        return self.probe_gqa and self._probe(q.device.type, q.dtype, q.shape[-1])

    def _forward(self, q, k, v, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        vals = dict(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal, scale=scale, **self.fwd_values)
        res = call(self.fwd_op, vals, self.FWD_NEED)
        sq = q.shape[2]
        layout = LseLayout.of(res["logsumexp"], sq)
        aux = {n: t for n, t in res.items() if n not in _NOT_AUX}
        self._aux[(q.shape, k.shape, q.dtype, q.device)] = (aux, layout)
        return res["output"], layout.to_bhs(res["logsumexp"], sq)

    def _backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        key = (q.shape, k.shape, q.dtype, q.device)
        if key not in self._aux:
            with torch.no_grad():
                self._forward(q, k, v, causal, scale)
        aux, layout = self._aux[key]
        vals = dict(aux, grad_out=dout.contiguous(), query=q, key=k, value=v, out=out, logsumexp=layout.from_bhs(lse),
                    dropout_p=0.0, is_causal=causal, scale=scale, **self.bwd_values)
        res = call(self.bwd_op, vals, self.BWD_NEED)
        grads = list(res.values())
        return grads[0], grads[1], grads[2]


# Stand-ins for the forward's auxiliary outputs when only checking that schemas bind.
_AUX_PLACEHOLDERS = dict(cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0, philox_seed=None, philox_offset=None)


class CudaFlashKernel(AtenKernel):
    name = "cuda_flash"
    fwd_op, bwd_op = "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"
    top_left_causal = False  # FlashAttention-2 aligns causal bottom-right
    probe_gqa = True
    fwd_values = dict(return_debug_mask=False)


class CudnnKernel(AtenKernel):
    name = "cudnn"
    fwd_op, bwd_op = "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"
    probe_gqa = True
    fwd_values = dict(attn_bias=None, compute_log_sumexp=True, return_debug_mask=False)
    bwd_values = dict(attn_bias=None)


class CudaEfficientKernel(AtenKernel):
    name = "cuda_efficient"
    fwd_op, bwd_op = "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"
    fwd_values = dict(attn_bias=None, compute_log_sumexp=True)
    bwd_values = dict(attn_bias=None, grad_input_mask=[True, True, True, False])


def _gqa_agrees(kern: AtenKernel, device_type, dtype, head_dim) -> bool:
    """Does the op take fewer K/V heads than query heads, grouped as Megatron groups them?
    Causal fwd + bwd of 2 query heads on 1 KV head, compared with the math kernel."""
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 2, 16, head_dim, generator=gen).to(device_type, dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, 16, head_dim, generator=gen).to(device_type, dtype) for _ in range(2))
    scale = head_dim**-0.5
    try:
        o, lse = kern._forward(q, k, v, True, scale)
        got = (o, lse, *kern._backward(do, q, k, v, o, lse, True, scale))
        ref = MathKernel()
        o_r, l_r = ref.forward(q, k, v, True, scale)
        want = (o_r, l_r, *ref.backward(do, q, k, v, o_r, l_r, True, scale))
        if any(tuple(a.shape) != tuple(b.shape) for a, b in zip(got, want)):
            return False
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    except Exception:  # noqa: BLE001 - any refusal of grouped heads means "not native"
        return False
    return err <= SELF_CHECK_TOL[dtype]


CUDA_KERNELS = {k.name: k for k in (CudnnKernel, CudaFlashKernel, CudaEfficientKernel)}
