"""Block attention kernels that return the log-sum-exp, and their backward.

Shapes: q [b, Hq, sq, d], k/v [b, Hkv, sk, d] with Hq a multiple of Hkv (query head h
uses KV head h // (Hq/Hkv), Megatron's grouping). ``forward`` returns (out, lse) with
out in q's dtype and lse [b, Hq, sq] in the accumulation dtype (float64 for float64
inputs, float32 otherwise). ``backward(dout, q, k, v, out, lse)`` takes the FINAL
(merged over all key blocks) out and lse, so it returns this block's exact share of
dq, dk, dv: p = exp(s - lse_final), ds = p * (dout @ v^T - rowsum(dout * out_final)).

``causal`` means the square diagonal block (query i sees keys <= i).

Backends:
  math        plain matmul + logsumexp; any dtype (float64 for exactness tests), any device.
  cpu_flash   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); float32/bf16.
  cuda_flash  aten._scaled_dot_product_flash_attention (+ _backward); fp16/bf16, head_dim
              a multiple of 8 and <= 256.
"auto" picks cpu_flash for float32/bf16/fp16 on CPU, math for float64, cuda_flash for
fp16/bf16 on CUDA and math otherwise. The choice is logged once per (backend, device, dtype).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_logged: set = set()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for softmax statistics and partial sums."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate_matmul(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b with acc in the accumulation dtype; in place (no temporary) when the
    dtypes already match, which is what keeps weight-gradient sums over chunks cheap."""
    if acc is None:
        return (a @ b).to(acc_dtype(a.dtype))
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    return acc.add_(a @ b)


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _reduce_kv(dk: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dk
    b, h, s, d = dk.shape
    return dk.view(b, h // groups, groups, s, d).sum(dim=2)


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where masked (key after query), bottom-right aligned."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)


class MathKernel:
    """Reference-grade kernel: scores for one block materialised in the accumulation dtype."""

    name = "math"

    def _scores(self, q, k, causal, scale, visible=None):
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        g = hq // hkv
        acc = acc_dtype(q.dtype)
        # Query heads of one KV group are adjacent: fold them into the row dimension.
        qg = q.reshape(b, hkv, g * sq, d).to(acc)
        s = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale
        if causal:
            m = _causal_mask(sq, sk, q.device)
            s = s.view(b, hkv, g, sq, sk).masked_fill(m, float("-inf")).view(b, hkv, g * sq, sk)
        if visible is not None:  # [b, sq, sk] block mask of packed documents
            s = s.view(b, hkv, g, sq, sk).masked_fill(~visible[:, None, None], float("-inf")).view(b, hkv, g * sq, sk)
        return qg, s

    def forward(self, q, k, v, causal: bool, scale: float, visible=None):
        """``visible`` [b, sq, sk] masks a block; rows that see no key get out 0, lse -inf."""
        b, hq, sq, d = q.shape
        _, s = self._scores(q, k, causal, scale, visible)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        safe = lse.masked_fill(torch.isinf(lse), 0.0) if visible is not None else lse
        out = torch.matmul(torch.exp(s - safe), v.to(s.dtype))
        return out.view(b, hq, sq, -1).to(q.dtype), lse.view(b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, visible=None):
        b, hq, sq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qg, s = self._scores(q, k, causal, scale, visible)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).reshape(b, hkv, g * sq, 1))
        do = dout.reshape(b, hkv, g * sq, -1).to(acc)
        delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, hkv, g * sq, 1)
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qg) * scale
        return dq.view(b, hq, sq, d), dk, dv


class CpuFlashKernel:
    """torch's CPU flash-attention op (returns logsumexp). Recent torch handles GQA in the
    op itself (probed once); older versions get K/V expanded to the query heads."""

    name = "cpu_flash"
    _native_gqa: bool | None = None

    @classmethod
    def native_gqa(cls) -> bool:
        if cls._native_gqa is None:
            q, kv = torch.zeros(1, 2, 2, 8), torch.zeros(1, 1, 2, 8)
            try:
                o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, True)
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(o, q, kv, kv, o, lse, 0.0, True)
                cls._native_gqa = tuple(grads[1].shape) == tuple(kv.shape)
            except RuntimeError:
                cls._native_gqa = False
        return cls._native_gqa

    def _kv(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        if g == 1 or self.native_gqa():
            return 1, k.contiguous(), v.contiguous()
        return g, _expand_kv(k, g).contiguous(), _expand_kv(v, g).contiguous()

    def forward(self, q, k, v, causal: bool, scale: float):
        _, k, v = self._kv(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k, v, 0.0, causal, scale=scale
        )
        return out, lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        g, k, v = self._kv(q, k, v)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q.contiguous(),
            k,
            v,
            out.contiguous(),
            lse.float().contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq, _reduce_kv(dk, g), _reduce_kv(dv, g)


class CudaFlashKernel:
    """torch's CUDA flash-attention op. Its backward wants the auxiliary outputs of a
    forward of the same shapes (cumulative lengths, rng state); they depend only on the
    shapes when dropout is 0, so the last ones per shape are kept and reused."""

    name = "cuda_flash"

    def __init__(self):
        self._aux: dict = {}

    def forward(self, q, k, v, causal: bool, scale: float):
        g = q.shape[1] // k.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, g), _expand_kv(v, g), 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
        self._aux[(q.shape, k.shape[2])] = (res[2], res[3], res[4], res[5], res[6], res[7])
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        g = q.shape[1] // k.shape[1]
        key = (q.shape, k.shape[2])
        if key not in self._aux:
            with torch.no_grad():
                self.forward(q, k, v, causal, scale)
        cq, ck, mq, mk, seed, offset = self._aux[key]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(),
            q,
            _expand_kv(k, g),
            _expand_kv(v, g),
            out,
            lse.float().contiguous(),
            cq,
            ck,
            mq,
            mk,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        return dq, _reduce_kv(dk, g), _reduce_kv(dv, g)


def _auto_name(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    if dtype == torch.float64:
        return "math"
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256:
        return "cuda_flash"
    return "math"


def select_kernel(choice: str, device, dtype: torch.dtype, head_dim: int):
    """Kernel object for a device/dtype; ``choice`` is FPDTConfig.kernel."""
    device = torch.device(device)
    name = _auto_name(device, dtype, head_dim) if choice == "auto" else choice
    if name == "cpu_flash" and (device.type != "cpu" or dtype == torch.float64):
        raise ValueError(f"kernel 'cpu_flash' needs a CPU float32/bf16 tensor, got {device.type} {dtype}")
    if name == "cuda_flash" and (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"kernel 'cuda_flash' needs a CUDA fp16/bf16 tensor, got {device.type} {dtype}")
    kernel = {"math": MathKernel, "cpu_flash": CpuFlashKernel, "cuda_flash": CudaFlashKernel}[name]()
    key = (name, device.type, dtype)
    if key not in _logged:
        _logged.add(key)
        log.info("FPDT block attention kernel: %s (%s, %s)", name, device.type, dtype)
    return kernel


def self_check(kernel, device, dtype, b=1, hq=4, hkv=2, s=128, d=64, seed=0) -> float:
    """Largest abs difference of (out, lse, dq, dk, dv) of ``kernel`` against the math
    kernel on random inputs, split into two key blocks merged by log-sum-exp. Used by
    benchmarks before trusting a backend on a new machine."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(b, hq, s, d), mk(b, hkv, 2 * s, d), mk(b, hkv, 2 * s, d), mk(b, hq, s, d)
    scale = d**-0.5
    ref = MathKernel()
    errs = []
    outs = []
    for kern in (kernel, ref):
        o0, l0 = kern.forward(q, k[:, :, :s], v[:, :, :s], False, scale)
        o1, l1 = kern.forward(q, k[:, :, s:], v[:, :, s:], True, scale)
        o, lse = merge(o0.float(), l0.float(), o1, l1.float())
        o = o.to(dtype)
        g0 = kern.backward(do, q, k[:, :, :s], v[:, :, :s], o, lse, False, scale)
        g1 = kern.backward(do, q, k[:, :, s:], v[:, :, s:], o, lse, True, scale)
        dq = g0[0].float() + g1[0].float()
        dk = torch.cat([g0[1].float(), g1[1].float()], 2)
        dv = torch.cat([g0[2].float(), g1[2].float()], 2)
        outs.append((o.float(), lse, dq, dk, dv))
    for a, r in zip(*outs):
        errs.append((a - r).abs().max().item())
    return max(errs)


def merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor):
    """Online-softmax merge of a block into running (out, lse), in acc_out's dtype.

    lse' = lse + log1p(exp(lse_blk - lse)) written symmetrically (stable for either larger);
    out' = exp(lse - lse') * out + exp(lse_blk - lse') * out_blk.
    """
    dt = acc_out.dtype
    a, bl = acc_lse.to(dt), blk_lse.to(dt)
    hi = torch.maximum(a, bl)
    new = hi + torch.log1p(torch.exp(-(a - bl).abs()))
    out = torch.exp(a - new).unsqueeze(-1) * acc_out + torch.exp(bl - new).unsqueeze(-1) * blk_out.to(dt)
    return out, new
