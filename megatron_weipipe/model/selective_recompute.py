"""Selective activation recomputation (``--recompute-granularity selective``), megatron-core's.

megatron-core does the work: with ``recompute_modules`` ``core_attn`` its Attention runs the
core attention through ``tensor_parallel.checkpoint`` (inputs kept, the scores, probabilities
and dropout mask rebuilt in backward from the saved RNG states, the model-parallel RNG
tracker's included, so the dropout mask is the forward's), with ``mlp`` its TransformerLayer
does the same for the MLP, and with ``layernorm`` it frees each norm's output once the next
module has run and rebuilds it from a gradient hook (``tensor_parallel.CheckpointWithoutOutput``).
This module adds what megatron-core's versions need here:

- ``install_norm_fix``: megatron-core's CheckpointWithoutOutput reads Transformer Engine's
  FP8 state whenever it is built without an ``fp8`` argument (``fp8 is not None`` is always
  true; so in 0.16.1 and 0.19.2), which TransformerLayer does: without TE every layernorm
  recompute fails with a NameError. Where TE is absent the class is replaced by one that
  takes its plain (non-FP8) path.
- ``install_mlp_bias_fix``: an MLP with biases hands its output bias back as a view, or
  megatron-core's MLP checkpoint recurses forever in backward (its docstring says why).
- ``for_autograd_grad``: WeiPipe's runtime backpropagates each chunk with
  ``torch.autograd.grad`` and calls its modules through ``functional_call`` on circulating
  weights. megatron-core's checkpoints are reentrant: they refuse ``.grad()`` and send the
  recomputed weights' gradients to ``.grad``. Inside this context (the runtime's chunk
  forwards) both are replaced by torch's non-reentrant checkpoint with megatron-core's RNG
  handling: the forward's RNG states (CPU, device, tracker) and context variables are set
  again around the recompute; the gradients flow through the forward's graph. The runtime
  binds the backward's weights to the modules while a backward runs, so the recompute reads
  the weights the backward uses.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def install_norm_fix() -> None:
    """Let megatron-core's layernorm recompute run without Transformer Engine (idempotent)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    if getattr(random, "HAVE_TE", True) or getattr(tensor_parallel.CheckpointWithoutOutput, "non_fp8", False):
        return

    class CheckpointWithoutOutput(tensor_parallel.CheckpointWithoutOutput):
        non_fp8 = True

        def __init__(self, fp8=False):
            super().__init__(fp8)
            self.fp8 = False  # no Transformer Engine: no FP8 state to read

    tensor_parallel.CheckpointWithoutOutput = CheckpointWithoutOutput


def install_mlp_bias_fix(model: torch.nn.Module) -> None:
    """Every MLP that megatron-core recomputes hands back its output bias as a view.

    The MLP returns linear_fc2's bias parameter itself (the layer adds it after the MLP);
    megatron-core's reentrant checkpoint then makes that parameter an output of its
    autograd node, so the parameter gets the node as its grad_fn and the node's backward
    recurses into itself forever (0.16.1, 0.19.2; layers with --disable-bias-linear return
    no bias and are untouched). A view of the bias is a new tensor with the same storage:
    the node owns the view, the parameter stays a leaf and gets its gradient through the
    recomputed graph."""
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None) if getattr(layer, "recompute_mlp", False) else None
        if mlp is None or getattr(mlp, "bias_as_view", False):
            continue
        plain = mlp.forward

        def forward(*args, _plain=plain, **kwargs):
            out, bias = _plain(*args, **kwargs)
            return out, (bias.view_as(bias) if bias is not None else None)

        mlp.forward, mlp.bias_as_view = forward, True


def _set_forward_rng(states: dict) -> None:
    """Every RNG state as the forward found it: CPU, device, megatron-core's tracker."""
    from megatron.core.tensor_parallel.random import _set_all_rng_states

    _set_all_rng_states(*states["rng"])


@contextlib.contextmanager
def _replayed(states: dict):
    """Around a recompute: the forward's RNG states and context variables (WeiPipe's deferred
    weight-gradient scope among them), the CPU adapter's mode; all restored after."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_weipipe.platform import adapter_mode

    tokens = [(var, var.set(value)) for var, value in states["context"].items()]
    try:
        with adapter_mode(), _fork_rng():
            _set_forward_rng(states)
            yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def _contexts():
    """torch checkpoint's context_fn: the forward records, the recompute replays."""
    from megatron.core.tensor_parallel.random import _get_all_rng_states

    states: dict = {}

    @contextlib.contextmanager
    def forward():
        states["rng"], states["context"] = _get_all_rng_states(), contextvars.copy_context()
        yield

    return forward(), _replayed(states)


def checkpoint(function, distribute_saved_activations, *args):
    """``tensor_parallel.checkpoint`` for a backward through ``torch.autograd.grad``."""
    if distribute_saved_activations:
        raise ValueError("distribute_saved_activations is full recomputation's; selective never asks for it")
    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, context_fn=_contexts)


class CheckpointWithoutOutput:
    """``tensor_parallel.CheckpointWithoutOutput`` for a backward through ``torch.autograd.grad``:
    the function (a norm) runs under a non-reentrant checkpoint, its output's storage is
    freed after the next module's forward and refilled from a gradient hook on that
    module's output, before the module's backward reads it."""

    def __init__(self, fp8=False):
        self.run_function = self.args = self.outputs = None

    def checkpoint(self, run_function, *args):
        self.run_function, self.args = run_function, args
        out = torch_checkpoint(run_function, *args, use_reentrant=False, preserve_rng_state=False,
                               context_fn=_contexts)
        self.outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return out

    def discard_output_and_register_recompute(self, hook_tensor) -> None:
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        if self.run_function is None:  # refilled already (a second pass over a kept graph)
            return
        from megatron_weipipe.platform import adapter_mode

        with torch.no_grad(), adapter_mode():
            fresh = self.run_function(*self.args)
        fresh = (fresh,) if isinstance(fresh, torch.Tensor) else tuple(fresh)
        with torch.no_grad():
            for out, new in zip(self.outputs, fresh):
                out.untyped_storage().resize_(new.untyped_storage().size())
                out.untyped_storage().copy_(new.untyped_storage())
        self.run_function = self.args = self.outputs = None


@contextlib.contextmanager
def for_autograd_grad(enabled: bool = True):
    """megatron-core's selective-recompute checkpoints replaced by ones a ``torch.autograd.grad``
    backward over ``functional_call`` weights can run (module docstring), inside this block."""
    if not enabled:
        yield
        return
    from megatron.core import tensor_parallel

    saved = tensor_parallel.checkpoint, tensor_parallel.CheckpointWithoutOutput
    tensor_parallel.checkpoint, tensor_parallel.CheckpointWithoutOutput = checkpoint, CheckpointWithoutOutput
    try:
        yield
    finally:
        tensor_parallel.checkpoint, tensor_parallel.CheckpointWithoutOutput = saved
