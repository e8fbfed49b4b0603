"""One call per masked block of packed documents: the block's document rectangles packed.

A block that document boundaries cut (``documents.MASKED``) holds, per sample, one
rectangle per document that spans both its queries and its keys (a causal square on the
diagonal block, at most one full rectangle off it). ``VarlenLayout`` lists them all,
over every sample, as flash-attention's variable-length form: the query rows and key
rows of each rectangle gathered document after document (``q_rows``/``k_rows`` into
the block's flattened [b * s] rows) with cumulative lengths ``cu_q``/``cu_k``. It is
built on the host from the CPU offsets with tensor ops (no loop over documents) and
copied to the device once (pinned, non-blocking), cached on the micro-batch's
``Documents``: the max lengths, Python ints the varlen op needs, are read off host
tensors, so no device synchronisation happens in the chunk loop.

Two backends compute the same thing, each ONE call for the whole block:

  flash   torch's ``aten._flash_attention_forward``/``_backward`` with cum_seq_q/k
          (FlashAttention-2 varlen); CUDA fp16/bf16, head_dim % 8 == 0 and <= 256;
          probed and self-checked against ``reference`` once per (device, dtype, head_dim).
  reference  the rectangles as a padded batch [n_docs, heads, max_q, max_k] with a
          key-padding mask: the math kernel on any device and dtype (float64 for the
          exactness tests), torch's CPU flash op (it takes the mask) for CPU
          float32/bf16/fp16; vectorised. ``padded_entries`` says what it costs; the
          caller takes the block-masked math kernel instead when that is smaller (one
          long document among short ones would make the padding quadratic).

Each query and each key lies in at most one rectangle, so results are placed
(index_copy), never summed; queries in no rectangle get out = 0, lse = -inf, and the
online-softmax merge over chunk pairs (``kernels.merge``) takes the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_weipipe.fpdt.kernel_base import SELF_CHECK_TOL, MathKernel, acc_dtype

log = logging.getLogger(__name__)
_MATH = MathKernel()
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenLayout:
    """The document rectangles of one block (q0, q1) x (k0, k1), packed; tensors on one device."""

    q_rows: torch.Tensor  # [Nq] int64: rows of the flattened [b * sq] queries, document after document
    k_rows: torch.Tensor  # [Nk] int64: rows of the flattened [b * sk] keys
    cu_q: torch.Tensor  # [n + 1] int32 cumulative query lengths
    cu_k: torch.Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    q_pad: torch.Tensor  # [n, max_q] int64: packed row of (document, position), Nq where padded
    k_pad: torch.Tensor  # [n, max_k] int64: packed row, Nk where padded
    k_valid: torch.Tensor  # [n, max_k] bool
    q_sel: torch.Tensor  # [Nq] int64: flat (document * max_q + position) of each packed query
    k_sel: torch.Tensor  # [Nk] int64

    @property
    def docs(self) -> int:
        return self.cu_q.shape[0] - 1

    @property
    def padded_entries(self) -> int:
        """Score entries per head of the padded reference: n_docs x max_q x max_k."""
        return self.docs * self.max_q * self.max_k

    def to(self, device, padded: bool = True) -> VarlenLayout:
        """On ``device`` (pinned, non-blocking from the host on CUDA); without the padded
        fields (left on the host, unused) when ``padded`` is False: flash needs none."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        pin = device.type == "cuda"

        def move(name):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or (not padded and name in PADDED_FIELDS):
                return t
            return (t.pin_memory() if pin else t).to(device, non_blocking=pin)

        return VarlenLayout(**{f: move(f) for f in self.__dataclass_fields__})


PADDED_FIELDS = ("q_pad", "k_pad", "k_valid", "q_sel", "k_sel")  # the reference's only


def _pack(starts: torch.Tensor, lengths: torch.Tensor):
    """Rows start, start+1, ... of each run, runs one after another; cumulative lengths;
    and the padded [n, max] view of them (pad index = total)."""
    n = lengths.shape[0]
    cu = torch.zeros(n + 1, dtype=torch.long)
    torch.cumsum(lengths, 0, out=cu[1:])
    total = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(n), lengths)
    within = torch.arange(total) - cu[:-1][doc]
    rows = starts[doc] + within
    width = int(lengths.max()) if n else 0
    j = torch.arange(width)
    valid = j[None, :] < lengths[:, None]
    pad = torch.where(valid, cu[:-1, None] + j[None, :], torch.full((), total))
    sel = doc * width + within
    return rows, cu.to(torch.int32), width, pad, valid, sel


def build_layout(offsets: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> VarlenLayout:
    """The rectangles of block (q0, q1) x (k0, k1) from CPU offsets [b, n+1], on the CPU."""
    s, e = offsets[:, :-1], offsets[:, 1:]
    qa, qe = s.clamp(q0, q1), e.clamp(q0, q1)
    ka, ke = s.clamp(k0, k1), e.clamp(k0, k1)
    keep = (qe > qa) & (ke > ka)  # documents spanning both the block's queries and keys
    sample = torch.arange(offsets.shape[0])[:, None].expand_as(keep)[keep]
    qa, qe, ka, ke = qa[keep], qe[keep], ka[keep], ke[keep]
    q_rows, cu_q, max_q, q_pad, _, q_sel = _pack(sample * (q1 - q0) + qa - q0, qe - qa)
    k_rows, cu_k, max_k, k_pad, k_valid, k_sel = _pack(sample * (k1 - k0) + ka - k0, ke - ka)
    return VarlenLayout(q_rows, k_rows, cu_q, cu_k, max_q, max_k, q_pad, k_pad, k_valid, q_sel, k_sel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, ...] -> [b * s, h, ...]."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])


def _unrows(t: torch.Tensor, b: int) -> torch.Tensor:
    """[b * s, h, ...] -> [b, h, s, ...] (contiguous)."""
    return t.view(b, t.shape[0] // b, *t.shape[1:]).transpose(1, 2).contiguous()


def _place(packed: torch.Tensor, rows: torch.Tensor, like_rows: int, fill: float, dtype) -> torch.Tensor:
    """[N, ...] packed values into a [like_rows, ...] tensor filled with ``fill``."""
    out = torch.full((like_rows, *packed.shape[1:]), fill, dtype=dtype, device=packed.device)
    return out.index_copy_(0, rows, packed.to(dtype))


def _padded(flat: torch.Tensor, packed_rows: torch.Tensor, pad: torch.Tensor, pad_value: float) -> torch.Tensor:
    """Gather flat rows [R, h, ...] into the padded [n, h, max, ...] batch of the documents."""
    packed = flat.index_select(0, packed_rows)
    packed = torch.cat([packed, packed.new_full((1, *packed.shape[1:]), pad_value)])
    return packed[pad].transpose(1, 2)  # [n, max, h, ...] -> [n, h, max, ...]


def _unpadded(t: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """[n, h, max, ...] padded -> [N, h, ...] packed."""
    t = t.transpose(1, 2)
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, sel)


class _PaddedCpuFlash:
    """torch's CPU flash op on the padded batch, the padding masked by an additive key
    mask (float32/bf16/fp16 on the CPU): the math kernel's result without its fp32 scores."""

    FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    @staticmethod
    def _kv(k, v, groups):
        from megatron_weipipe.fpdt.kernels import CpuFlashKernel

        if groups == 1 or CpuFlashKernel.native_gqa():
            return k, v, 1
        return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), groups

    @staticmethod
    def _mask(visible, dtype, Lq):
        zero = torch.zeros((), dtype=dtype)
        m = torch.where(visible[:, None, None, :], zero, torch.full((), float("-inf"), dtype=dtype))
        return m.expand(-1, 1, Lq, -1).contiguous()

    def forward(self, q, k, v, causal, scale, visible):
        k, v, _ = self._kv(k, v, q.shape[1] // k.shape[1])
        return self.FWD(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal,
                        attn_mask=self._mask(visible, q.dtype, q.shape[2]), scale=scale)

    def backward(self, do, q, k, v, o, lse, causal, scale, visible):
        hkv = k.shape[1]
        kx, vx, g = self._kv(k, v, q.shape[1] // hkv)
        dq, dk, dv = self.BWD(do.contiguous(), q.contiguous(), kx.contiguous(), vx.contiguous(), o.contiguous(),
                              lse.float().contiguous(), 0.0, causal, attn_mask=self._mask(visible, q.dtype, q.shape[2]),
                              scale=scale)
        if g > 1:
            dk, dv = (t.unflatten(1, (hkv, g)).sum(2) for t in (dk, dv))
        return dq, dk, dv


_CPU_FLASH = _PaddedCpuFlash()


def _padded_kernel(q):
    """Math (float64, other devices) or, for CPU float32/bf16/fp16, torch's CPU flash op."""
    return _CPU_FLASH if q.device.type == "cpu" and q.dtype in (torch.float32, *HALF) else None


class ReferenceVarlen:
    """The rectangles as one padded batch: the math kernel with a key-padding mask (any
    device and dtype), or torch's CPU flash op with that mask (CPU float32/bf16/fp16)."""

    name = "reference"

    def forward(self, q, k, v, lay: VarlenLayout, causal: bool, scale: float):
        b, hq, sq, _ = q.shape
        n, Lq, Lk = lay.docs, lay.max_q, lay.max_k
        qp = _padded(_rows(q), lay.q_rows, lay.q_pad, 0.0)
        kp = _padded(_rows(k), lay.k_rows, lay.k_pad, 0.0)
        vp = _padded(_rows(v), lay.k_rows, lay.k_pad, 0.0)
        fast = _padded_kernel(q)
        if fast is not None:
            o, lse = fast.forward(qp, kp, vp, causal, scale, lay.k_valid)
        else:
            o, lse = _MATH.forward(qp, kp, vp, causal, scale, visible=lay.k_valid[:, None, :].expand(n, Lq, Lk))
        out = _place(_unpadded(o, lay.q_sel), lay.q_rows, b * sq, 0.0, q.dtype)
        lse = _place(_unpadded(lse.unsqueeze(-1), lay.q_sel), lay.q_rows, b * sq, float("-inf"), lse.dtype)
        return _unrows(out, b), _unrows(lse, b).squeeze(-1)

    def backward(self, dout, q, k, v, out, lse, lay: VarlenLayout, causal: bool, scale: float):
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        n, Lq, Lk = lay.docs, lay.max_q, lay.max_k
        qp = _padded(_rows(q), lay.q_rows, lay.q_pad, 0.0)
        dop = _padded(_rows(dout), lay.q_rows, lay.q_pad, 0.0)
        op = _padded(_rows(out), lay.q_rows, lay.q_pad, 0.0)
        # padded query rows: lse = +inf gives p = 0, so they add nothing to dk, dv
        lp = _padded(_rows(lse.unsqueeze(-1)), lay.q_rows, lay.q_pad, float("inf")).squeeze(-1)
        kp = _padded(_rows(k), lay.k_rows, lay.k_pad, 0.0)
        vp = _padded(_rows(v), lay.k_rows, lay.k_pad, 0.0)
        fast = _padded_kernel(q)
        if fast is not None:
            dq, dk, dv = fast.backward(dop, qp, kp, vp, op, lp, causal, scale, lay.k_valid)
        else:
            dq, dk, dv = _MATH.backward(dop, qp, kp, vp, op, lp, causal, scale,
                                        visible=lay.k_valid[:, None, :].expand(n, Lq, Lk))
        acc = acc_dtype(q.dtype)
        dq = _place(_unpadded(dq, lay.q_sel), lay.q_rows, b * sq, 0.0, acc)
        dk = _place(_unpadded(dk, lay.k_sel), lay.k_rows, b * sk, 0.0, acc)
        dv = _place(_unpadded(dv, lay.k_sel), lay.k_rows, b * sk, 0.0, acc)
        return _unrows(dq, b), _unrows(dk, b), _unrows(dv, b)


class FlashVarlen:
    """torch's FlashAttention-2 varlen op pair on the packed rectangles (CUDA fp16/bf16)."""

    name = "flash_varlen"
    FWD, BWD = "_flash_attention_forward", "_flash_attention_backward"

    def __init__(self):
        self._aux: dict = {}

    def _packed(self, q, k, v, lay):
        return (_rows(q).index_select(0, lay.q_rows), _rows(k).index_select(0, lay.k_rows),
                _rows(v).index_select(0, lay.k_rows))

    def _fwd(self, qp, kp, vp, lay, causal, scale):
        from megatron_weipipe.fpdt.cuda_kernels import SchemaMismatch, call

        res = call(self.FWD, dict(query=qp, key=kp, value=vp, cum_seq_q=lay.cu_q, cum_seq_k=lay.cu_k,
                                  max_q=lay.max_q, max_k=lay.max_k, dropout_p=0.0, is_causal=causal,
                                  return_debug_mask=False, scale=scale), ("cum_seq_q", "cum_seq_k", "scale"))
        lse = res["logsumexp"]
        if tuple(lse.shape) != (qp.shape[1], qp.shape[0]):  # varlen lse is [heads, total_q]
            raise SchemaMismatch(f"varlen log-sum-exp of shape {tuple(lse.shape)}, expected {(qp.shape[1], qp.shape[0])}")
        self._aux[id(lay), causal] = (res["philox_seed"], res["philox_offset"])
        return res["output"], lse

    def forward(self, q, k, v, lay: VarlenLayout, causal: bool, scale: float):
        b, hq, sq, _ = q.shape
        o, lse = self._fwd(*self._packed(q, k, v, lay), lay, causal, scale)
        out = _place(o, lay.q_rows, b * sq, 0.0, q.dtype)
        lse = _place(lse.t().float().unsqueeze(-1), lay.q_rows, b * sq, float("-inf"), torch.float32)
        return _unrows(out, b), _unrows(lse, b).squeeze(-1)

    def backward(self, dout, q, k, v, out, lse, lay: VarlenLayout, causal: bool, scale: float):
        from megatron_weipipe.fpdt.cuda_kernels import call

        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        qp, kp, vp = self._packed(q, k, v, lay)
        if (id(lay), causal) not in self._aux:
            with torch.no_grad():
                self._fwd(qp, kp, vp, lay, causal, scale)
        seed, offset = self._aux[id(lay), causal]
        sel = lambda t: _rows(t).index_select(0, lay.q_rows).contiguous()  # noqa: E731
        lse_p = _rows(lse.unsqueeze(-1).float()).index_select(0, lay.q_rows).squeeze(-1).t().contiguous()
        res = call(self.BWD, dict(grad_out=sel(dout), query=qp, key=kp, value=vp, out=sel(out), logsumexp=lse_p,
                                  cum_seq_q=lay.cu_q, cum_seq_k=lay.cu_k, max_q=lay.max_q, max_k=lay.max_k,
                                  dropout_p=0.0, is_causal=causal, philox_seed=seed, philox_offset=offset,
                                  scale=scale), ("cum_seq_q", "cum_seq_k", "scale"))
        dq, dk, dv = list(res.values())[:3]
        acc = torch.float32
        return (_unrows(_place(dq, lay.q_rows, b * sq, 0.0, acc), b), _unrows(_place(dk, lay.k_rows, b * sk, 0.0, acc), b),
                _unrows(_place(dv, lay.k_rows, b * sk, 0.0, acc), b))


REFERENCE = ReferenceVarlen()
_FLASH_OK: dict = {}


def varlen_self_check(backend, device, dtype, head_dim: int, hq: int = 4, hkv: int = 2) -> float:
    """Largest difference of (out, lse, dq, dk, dv) of ``backend`` against the reference
    on two samples of three and two documents, for a diagonal and an earlier key block."""
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([[0, 20, 50, 64], [0, 40, 64, 64]])
    worst = 0.0
    for (q0, q1, k0, k1), causal in (((32, 64, 32, 64), True), ((32, 64, 0, 32), False)):
        lay = build_layout(offsets, q0, q1, k0, k1).to(device)
        mk = lambda h, s: torch.randn(2, h, s, head_dim, generator=gen).to(device, dtype)  # noqa: E731
        q, k, v, do = mk(hq, 32), mk(hkv, 32), mk(hkv, 32), mk(hq, 32)
        got, want = [], []
        for impl, res in ((backend, got), (REFERENCE, want)):
            o, lse = impl.forward(q, k, v, lay, causal, head_dim**-0.5)
            res += [o, lse, *impl.backward(do, q, k, v, o, lse, lay, causal, head_dim**-0.5)]
        for a, r in zip(got, want):
            fin = torch.isfinite(r)
            if not torch.equal(fin, torch.isfinite(a)):
                return float("inf")
            worst = max(worst, (a.float()[fin] - r.float()[fin]).abs().max().item())
    return worst


def varlen_backend(kern, q: torch.Tensor):
    """The one-call backend for a masked block of ``q``: flash varlen where torch's CUDA
    op takes this dtype and head_dim and agrees with the reference (probed once), else
    the padded reference."""
    d = q.shape[-1]
    if not (q.is_cuda and q.dtype in HALF and d % 8 == 0 and d <= 256 and getattr(kern, "name", "math") != "math"):
        return REFERENCE
    key = (str(q.device), q.dtype, d)
    if key not in _FLASH_OK:
        flash = FlashVarlen()
        try:
            err = varlen_self_check(flash, q.device, q.dtype, d)
            ok, why = err <= SELF_CHECK_TOL[q.dtype], f"self-check error {err:.2g}"
        except Exception as e:  # noqa: BLE001 - any failure to run rules the op out
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        _FLASH_OK[key] = flash if ok else None
        (log.info if ok else log.warning)("FPDT packed documents: %s for masked blocks (%s, %s, head_dim %d; %s)",
                                          "flash varlen" if ok else "padded reference", q.device, q.dtype, d, why)
    return _FLASH_OK[key] or REFERENCE


__all__ = ["FlashVarlen", "REFERENCE", "ReferenceVarlen", "VarlenLayout", "build_layout", "varlen_backend",
           "varlen_self_check"]
