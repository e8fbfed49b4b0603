"""Rotary embedding with global positions, numerically identical to Megatron's.

Megatron builds inv_freq and the angle table in float32 (positions as float32, optional
interpolation and Llama-3.1 scaling), takes cos/sin in float32 and casts them to the
tensor's dtype. FPDT needs the table for an arbitrary global range [start, start+n), so
it is built per chunk here, with the same arithmetic as Megatron's full table sliced.
The rotation is orthogonal, so its backward is the rotation by the negative angle.
"""

from __future__ import annotations

import math

import torch

from megatron_weipipe.fpdt.config import RotaryConfig


def inv_freq(cfg: RotaryConfig, head_dim: int, device=None) -> torch.Tensor:
    dim = int(head_dim * cfg.percent) if cfg.percent < 1.0 else head_dim
    freq = 1.0 / (cfg.base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if cfg.rope_scaling:
        freq = _llama31_scaling(freq, cfg.rope_scaling_factor)
    return freq


def _llama31_scaling(freq: torch.Tensor, factor: float, low: float = 1.0, high: float = 4.0, old_len: int = 8192):
    """Llama-3.1 frequency rescaling (long wavelengths divided by ``factor``, smooth band between)."""
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin for a global position range, in the layout [n, rot_dim] (broadcast over b, h)."""

    def __init__(self, cfg: RotaryConfig, head_dim: int, start: int, length: int, dtype, device):
        freq = inv_freq(cfg, head_dim, device)
        pos = torch.arange(length, dtype=torch.float32, device=device) + start
        if cfg.seq_len_interpolation_factor is not None:
            pos = pos * (1 / cfg.seq_len_interpolation_factor)
        ang = torch.outer(pos, freq)
        if cfg.interleaved:
            ang = torch.stack((ang, ang), dim=-1).reshape(length, -1)
        else:
            ang = torch.cat((ang, ang), dim=-1)
        self.cos = torch.cos(ang).to(dtype)
        self.sin = torch.sin(ang).to(dtype)
        self.interleaved = cfg.interleaved
        self.rot_dim = ang.shape[-1]


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, table: RotaryTable, sign: float) -> torch.Tensor:
    """x: [..., n, d] with positions along dim -2."""
    rot, rest = x[..., : table.rot_dim], x[..., table.rot_dim :]
    out = rot * table.cos + _rotate_half(rot, table.interleaved) * (table.sin if sign > 0 else -table.sin)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rotary(x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Rotate x [..., n, d] (positions on dim -2, e.g. [b, h, n, d])."""
    return _rotate(x, table, 1.0)


def apply_rotary_backward(grad: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Gradient through apply_rotary: the transpose rotation."""
    return _rotate(grad, table, -1.0)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table):
        ctx.table = table
        return apply_rotary(x, table)

    @staticmethod
    def backward(ctx, g):
        return apply_rotary_backward(g, ctx.table), None


def rotary(x: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Autograd-aware apply_rotary (for the plain Ulysses path)."""
    return _Rotary.apply(x, table)
