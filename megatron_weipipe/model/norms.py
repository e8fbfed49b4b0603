"""Local norms with a zero-centred weight (--apply-layernorm-1p): y = norm(x) * (1 + weight).

megatron-core's local layers build torch's LayerNorm / RMSNorm through ``WrappedTorchNorm``,
which refuses ``layernorm_zero_centered_gamma``; its apex ``FusedLayerNorm`` and Transformer
Engine's norms honour it. These are torch's two norms with the weight initialised to 0 and
applied as 1 + weight, as those are: the same parameters and state-dict keys as the norms
they stand in for, so a checkpoint converts by shifting every norm weight by 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron_weipipe.config import PretrainConfig


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class ZeroCenteredNorm:
    """A spec entry with megatron-core's norm interface (``WrappedTorchNorm``'s arguments)
    that builds the zero-centred norm of ``config.normalization``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kinds = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"--apply-layernorm-1p: no zero-centred {config.normalization} (LayerNorm or RMSNorm)")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():  # summed over TP ranks under sequence parallelism, as apex's
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


def local_layer_spec(cfg: "PretrainConfig"):
    """megatron-core's local layer spec with this model's norms: --normalization's kind, the
    query/key norms of --qk-layernorm, and zero-centred ones under --apply-layernorm-1p where
    megatron-core's entry (torch's norms) refuses them."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    m = cfg.model
    spec = get_gpt_layer_local_spec(normalization=m.normalization, qk_layernorm=m.qk_layernorm)
    if m.apply_layernorm_1p:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layer, attention = spec.submodules, spec.submodules.self_attention.submodules
        for holder, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                             (attention, "q_layernorm"), (attention, "k_layernorm")):
            if getattr(holder, name) is WrappedTorchNorm:
                setattr(holder, name, ZeroCenteredNorm)
    return spec
