"""nn.Module wrappers with Megatron's parameter names and return conventions.

FPDTSelfAttention holds ``linear_qkv.weight/bias`` and ``linear_proj.weight/bias`` and
returns ``(output, proj_bias)`` like megatron.core's SelfAttention (skip-bias-add, so the
layer's bias-dropout-add applies the bias); ChunkedMLP holds ``linear_fc1.*`` and
``linear_fc2.*`` and returns ``(output, fc2_bias)`` like megatron.core's MLP. The state
dict keys therefore match Megatron's local-spec layer and checkpoints load unchanged.

Test support (tests/test_fpdt_units.py, tests/test_fpdt_megatron.py): the package's own
integration, megatron_weipipe/model/long_context.py, keeps megatron-core's modules and
replaces only their forward.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatron_weipipe.fpdt.chunked_attention import fpdt_attention
from megatron_weipipe.fpdt.config import AttentionSpec, FPDTConfig
from megatron_weipipe.fpdt.mlp import ACTIVATIONS, chunked_mlp
from megatron_weipipe.fpdt.offload import HostBufferPool, OffloadStats
from megatron_weipipe.fpdt.ulysses import CommCounter


def _normal(std: float = 0.02) -> Callable[[torch.Tensor], None]:
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class LinearParams(nn.Module):
    """Just a weight [out, in] and an optional bias [out] (the computation lives elsewhere)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, init_method, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        with torch.no_grad():
            init_method(self.weight)


class FPDTSelfAttention(nn.Module):
    """Causal self-attention over a context-parallel group, FPDT-chunked.

    forward(hidden_states [s_local, b, hidden] in FPDT layout) -> (output, bias).
    ``spec`` counts heads per TP rank; ``tp_group`` sums the row-parallel output.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        config: FPDTConfig,
        cp_group=None,
        tp_group=None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        init_method=None,
        output_init_method=None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        spec.validate(1 if cp_group is None else torch.distributed.get_world_size(cp_group))
        self.spec, self.config = spec, config
        self.cp_group, self.tp_group = cp_group, tp_group
        init = init_method or _normal()
        self.linear_qkv = LinearParams(spec.qkv_size, spec.hidden_size, qkv_bias, init, dtype, device)
        self.linear_proj = LinearParams(
            spec.hidden_size, spec.proj_input_size, proj_bias, output_init_method or init, dtype, device
        )
        self.pool: HostBufferPool | None = None  # host buffers, created on first offloaded call
        self.offload_stats = OffloadStats()
        self.comm = CommCounter()

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, rotary_pos_emb=None, **unused):
        """Megatron's SelfAttention call signature. ``rotary_pos_emb`` is not used: the
        rotary table of each chunk is built from its global positions (spec.rotary)."""
        if attention_mask is not None:
            raise ValueError("FPDTSelfAttention is causal only: pass attention_mask=None")
        if self.config.offload and self.pool is None:
            self.pool = HostBufferPool(pin_memory=hidden_states.is_cuda)
        out = fpdt_attention(
            hidden_states,
            self.linear_qkv.weight,
            self.linear_qkv.bias,
            self.linear_proj.weight,
            None,
            self.spec,
            self.config,
            self.cp_group,
            self.tp_group,
            pool=self.pool,
            stats=self.offload_stats,
            counter=self.comm,
        )
        return out, self.linear_proj.bias


class ChunkedMLP(nn.Module):
    """Megatron-layout MLP run in sequence chunks; forward(x) -> (output, fc2 bias).

    ``ffn_hidden_size`` is per TP rank."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        num_chunks: int = 1,
        bias: bool = False,
        tp_group=None,
        init_method=None,
        output_init_method=None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
        gated = ACTIVATIONS[activation][1]
        init = init_method or _normal()
        self.activation, self.num_chunks, self.tp_group = activation, num_chunks, tp_group
        self.linear_fc1 = LinearParams(ffn_hidden_size * (2 if gated else 1), hidden_size, bias, init, dtype, device)
        self.linear_fc2 = LinearParams(hidden_size, ffn_hidden_size, bias, output_init_method or init, dtype, device)

    def forward(self, hidden_states: torch.Tensor):
        out = chunked_mlp(
            hidden_states,
            self.linear_fc1.weight,
            self.linear_fc1.bias,
            self.linear_fc2.weight,
            None,
            self.activation,
            self.num_chunks,
            self.tp_group,
        )
        return out, self.linear_fc2.bias
