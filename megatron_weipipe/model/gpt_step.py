"""The GPT forward step and loss, in Megatron-LM's (data_iterator, model) form."""

from __future__ import annotations

from functools import partial

import torch

from megatron_weipipe.training.faults import maybe_inject_nan


def batch_to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids of the next microbatch."""
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = batch_to_device(batch, device)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def masked_mean_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean of the per-token losses where the mask is set: this microbatch's lm loss."""
    losses = per_token_loss.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    loss = maybe_inject_nan(loss)  # test hook (MEGATRON_WEIPIPE_INJECT_NAN); a no-op otherwise
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(masked_mean_loss, loss_mask)
