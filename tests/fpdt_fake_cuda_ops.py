"""CPU stand-ins for torch's CUDA attention ops, with the CUDA ops' signatures and layouts.

They compute with torch's CPU flash op (not the math kernel the adapters are checked
against) and reproduce what the adapters must cope with: flash's auxiliary outputs,
cuDNN's [b, h, sq, 1] log-sum-exp, the memory-efficient kernel's lse padded to 32 rows
(padding filled with NaN, so an adapter that reads it shows) and its [b, s, h, d]-strided
outputs, and, per instance, whether grouped K/V heads are accepted. Every call is
recorded as (op, query heads, key heads) as received, so a test can count materialised K/V copies.
"""

from __future__ import annotations

import math

import torch

CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class FakeCudaOps:
    def __init__(self, native_gqa: bool):
        self.native_gqa = native_gqa
        self.calls: list[tuple[str, int, int]] = []

    def _heads(self, op, q, k):
        self.calls.append((op, q.shape[1], k.shape[1]))
        if q.shape[1] != k.shape[1] and not self.native_gqa:
            raise RuntimeError(f"{op}: number of key heads must equal query heads")
        return q.shape[1] // k.shape[1]

    @staticmethod
    def _fwd(q, k, v, g, causal, scale):
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return CPU(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def _bwd(do, q, k, v, o, lse, g, causal, scale):
        kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        dq, dk, dv = CPU_BWD(do.contiguous(), q, kx, vx, o.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
        red = lambda t: t.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
        return dq, red(dk), red(dv)

    # ---- aten._scaled_dot_product_flash_attention
    def flash(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        g = self._heads("flash", query, key)
        o, lse = self._fwd(query, key, value, g, is_causal, scale)
        seed, offset = torch.zeros(2, dtype=torch.long), torch.zeros((), dtype=torch.long)
        return o, lse, None, None, query.shape[2], key.shape[2], seed, offset, torch.empty(0)

    def flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        assert (max_q, max_k) == (query.shape[2], key.shape[2]) and philox_seed.shape == (2,)
        assert logsumexp.shape == query.shape[:3]
        g = self._heads("flash_backward", query, key)
        return self._bwd(grad_out, query, key, value, out, logsumexp, g, is_causal, scale)

    # ---- aten._scaled_dot_product_cudnn_attention
    def cudnn(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
              return_debug_mask=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp
        g = self._heads("cudnn", query, key)
        o, lse = self._fwd(query, key, value, g, is_causal, scale)
        seed, offset = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
        return o, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2], seed, offset, None

    def cudnn_backward(self, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                       cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        assert logsumexp.shape == (*query.shape[:3], 1), logsumexp.shape
        g = self._heads("cudnn_backward", query, key)
        return self._bwd(grad_out, query, key, value, out, logsumexp.squeeze(-1), g, is_causal, scale)

    # ---- aten._scaled_dot_product_efficient_attention
    def efficient(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                  scale=None):
        assert attn_bias is None and compute_log_sumexp
        g = self._heads("efficient", query, key)
        o, lse = self._fwd(query, key, value, g, is_causal, scale)
        b, h, sq, d = o.shape
        o = o.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] in memory, as the kernel writes it
        padded = torch.full((b, h, math.ceil(sq / 32) * 32), float("nan"))
        padded[..., :sq] = lse
        return o, padded, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)

    def efficient_backward(self, grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                           dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        sq = query.shape[2]
        assert logsumexp.shape == (*query.shape[:2], math.ceil(sq / 32) * 32), logsumexp.shape
        assert list(grad_input_mask) == [True, True, True, False]
        g = self._heads("efficient_backward", query, key)
        dq, dk, dv = self._bwd(grad_out_, query, key, value, out, logsumexp[..., :sq], g, is_causal, scale)
        return dq, dk, dv, None

    def install(self, monkeypatch) -> FakeCudaOps:
        """Put the fakes where the adapters look the ops up (torch.ops.aten, at call time)."""
        for op, fn in (("flash", self.flash), ("flash_backward", self.flash_backward), ("cudnn", self.cudnn),
                       ("cudnn_backward", self.cudnn_backward), ("efficient", self.efficient),
                       ("efficient_backward", self.efficient_backward)):
            base, _, bwd = op.partition("_")
            monkeypatch.setattr(torch.ops.aten, f"_scaled_dot_product_{base}_attention" + ("_backward" if bwd else ""), fn)
        return self

    def expanded(self, op: str, query_heads: int) -> int:
        """Calls of ``op`` that received K/V expanded to the model's ``query_heads``."""
        return sum(1 for name, _, hk in self.calls if name == op and hk == query_heads)

    def count(self, op: str) -> int:
        return sum(1 for name, _, _ in self.calls if name == op)
