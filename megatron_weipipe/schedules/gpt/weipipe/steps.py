"""The GPT model around the decoder chunks: embedding in, final norm + output + loss out.
Under FPDT the final norm, output layer and loss run in sequence chunks, as under the
other schedules (model/long_context.py: chunk_final_norm, install_chunked_loss).

The user's Megatron-style ``forward_step(data_iterator, model)`` stays the one place
that reads a batch and defines the loss: it is called with a stand-in model that only
records the inputs (tokens, positions, mask, labels), and the ``loss_func`` it returns
is applied to the per-token loss that the replicated output layer computes later. The
loss is then scaled exactly as megatron-core's forward_step_calc_loss scales it, so
gradients equal those of Megatron's schedules. Under --calculate-per-token-loss it is the
microbatch's undivided loss sum: the ring and the data-parallel reduction sum the
gradients, and the training step divides them once by the global batch's token count.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

_ACCEPTED = ("input_ids", "position_ids", "attention_mask", "labels")


@dataclass
class Microbatch:
    index: int
    tokens: torch.Tensor
    position_ids: Optional[torch.Tensor]
    attention_mask: Optional[torch.Tensor]
    labels: Optional[torch.Tensor]
    loss_func: Callable
    reported: dict = field(default_factory=dict)  # loss_func's logged values, once computed


class _RecordingModel:
    """Stands in for the GPTModel inside forward_step: remembers the call, computes nothing."""

    def __init__(self, signature: inspect.Signature, long_context=None, config=None):
        self.signature = signature
        self.inputs: Optional[dict] = None
        self.long_context = long_context  # context-parallel sharding settings, read by forward_step
        self.config = config  # the TransformerConfig (forward_step reads calculate_per_token_loss)

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        extra = [k for k, v in bound.arguments.items() if k not in _ACCEPTED and v is not None]
        if extra:
            raise ValueError(f"WeiPipe schedules run GPTModel(input_ids, position_ids, attention_mask, labels); "
                             f"forward_step also passed {extra}")
        self.inputs = bound.arguments
        return None


def prepare_microbatches(forward_step: Callable, model: torch.nn.Module, batches: list[dict]) -> list[Microbatch]:
    signature = inspect.signature(model.forward)
    out = []
    for i, batch in enumerate(batches):
        recorder = _RecordingModel(signature, getattr(model, "long_context", None), getattr(model, "config", None))
        _, loss_func = forward_step(iter([batch]), recorder)
        if recorder.inputs is None:
            raise ValueError("forward_step did not call the model")
        a = recorder.inputs
        out.append(Microbatch(i, a["input_ids"], a.get("position_ids"), a.get("attention_mask"), a.get("labels"),
                              loss_func))
    return out


class GPTEnds:
    """pre_fn / post_fn / chunk_kwargs of the runtime for one ring rank's GPTModel."""

    def __init__(self, model: torch.nn.Module, num_microbatches: int, cp_size: int = 1):
        self.model = model
        self.config = model.config
        self.num_microbatches = num_microbatches  # N = G * P: Megatron's per-replica count
        self.cp_size = cp_size
        self._rotary: dict[int, Any] = {}
        self.per_token = bool(getattr(self.config, "calculate_per_token_loss", False))

    def rotary(self, seq_len: int):
        """The rotary embedding is a constant of the sequence length: computed once."""
        if getattr(self.model, "position_embedding_type", None) != "rope":
            return None
        if seq_len not in self._rotary:
            self._rotary[seq_len] = self.model.rotary_pos_emb(seq_len)
        return self._rotary[seq_len]

    def chunk_kwargs(self, mb: Microbatch) -> dict:
        return {"attention_mask": mb.attention_mask, "rotary_pos_emb": self.rotary(mb.tokens.size(1))}

    def pre_fn(self, mb: Microbatch) -> torch.Tensor:
        return self.model.embedding(input_ids=mb.tokens, position_ids=mb.position_ids)

    def per_token_loss(self, hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        from megatron.core.utils import make_viewless_tensor

        m = self.model
        norm = m.decoder.final_layernorm
        if norm is not None:
            hidden = make_viewless_tensor(inp=norm(hidden), requires_grad=True, keep_graph=True)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        chunked = getattr(m, "chunked_loss", None)  # FPDT: output layer + loss in sequence chunks
        if chunked is not None:
            return chunked(hidden, m.output_layer.weight if weight is None else weight, mb.labels)
        logits, _ = m.output_layer(hidden, weight=weight, runtime_gather_output=None)
        return m.compute_language_model_loss(mb.labels, logits)

    def post_fn(self, hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Loss to backpropagate, scaled as megatron-core's forward_step_calc_loss does."""
        outputs = mb.loss_func(self.per_token_loss(hidden, mb))
        if len(outputs) == 3:
            loss, num_tokens, mb.reported = outputs
            if not self.per_token:
                loss = loss / torch.clamp(num_tokens, min=1) / self.num_microbatches
        else:
            loss, mb.reported = outputs
            loss = loss * self.cp_size / self.num_microbatches
        scale = getattr(self.config, "grad_scale_func", None)
        return scale(loss) if scale is not None else loss
