"""Token-wise layer pieces run in sequence chunks, so the whole layer is chunked.

FPDT chunks the attention, the MLP and the loss; what is left of a layer is token-wise:
the norms. Run on the whole local sequence, a norm keeps its own copies of it (torch's
RMSNorm on a host keeps float32 copies of its input and of the normalised tensor for
backward, twice the bytes of the bf16 input each). In chunks under activation
checkpointing it keeps only its input, which the layer holds anyway, and rebuilds one
chunk at a time in backward. The result is the same tensor: a token-wise function does
not care where the sequence is cut.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def sequence_chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """fn(x) for a token-wise fn of x [s, ...], computed on num_chunks pieces along s.
    With gradients, each piece is checkpointed (fn has no randomness: no RNG state kept)."""
    if num_chunks <= 1 or x.shape[0] < 2:
        return fn(x)
    pieces = x.chunk(num_chunks, dim=0)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in _params(fn))):
        outs = [checkpoint(fn, p, use_reentrant=False, preserve_rng_state=False) for p in pieces]
    else:
        outs = [fn(p) for p in pieces]
    return torch.cat(outs, dim=0)


def _params(fn) -> list:
    module = getattr(fn, "__self__", None)
    return list(module.parameters()) if isinstance(module, torch.nn.Module) else []


def chunk_forward(module: torch.nn.Module, num_chunks: int) -> torch.nn.Module:
    """Wrap ``module``'s instance forward so that a single-tensor call runs in sequence
    chunks; its class, parameters and state-dict keys stay as they are."""
    plain = module.forward

    def forward(x, *rest, **kw):
        if rest or kw:
            return plain(x, *rest, **kw)
        return sequence_chunked(plain, x, num_chunks)

    module.forward = forward
    return module


def sequence_chunked_module(build: Callable[..., torch.nn.Module], num_chunks: int) -> type:
    """A spec entry that builds what ``build`` builds, with its forward in sequence chunks
    (``chunk_forward``): megatron-core's build_module instantiates classes, so this is one."""
    from megatron.core.transformer.spec_utils import build_module

    def __new__(cls, *args, **kwargs):
        return chunk_forward(build_module(build, *args, **kwargs), num_chunks)

    return type("SequenceChunked", (), {"__new__": __new__, "__doc__": sequence_chunked_module.__doc__})
