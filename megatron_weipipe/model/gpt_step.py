"""The GPT forward step and loss, in Megatron-LM's (data_iterator, model) form."""

from __future__ import annotations

from functools import partial

import torch

from megatron_weipipe.faults import maybe_inject_nan
from megatron_weipipe.model.megatron_cp import MegatronContextParallel
from megatron_weipipe.platform import detect_platform


def batch_to_device(batch: dict, device: torch.device, keep_on_host=()) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in keep_on_host else v)
            for k, v in batch.items()}


def get_batch(data_iterator, long_context=None):
    """tokens, labels, loss_mask, attention_mask, position_ids of the next microbatch.

    Under context parallelism each rank keeps its share of the sequence: the FPDT layout for
    Ulysses/FPDT, megatron-core's load-balanced chunks for its own (model/megatron_cp.py).
    """
    batch = next(data_iterator)
    keep = ()
    if isinstance(long_context, MegatronContextParallel):
        batch = long_context.shard(batch)
    elif long_context is not None:
        from megatron_weipipe.model.long_context import shard_for_context_parallel

        batch = shard_for_context_parallel(batch, long_context)
        keep = ("attention_mask",)  # packed documents' offsets: read on the host
    batch = batch_to_device(batch, detect_platform().current_device(), keep)
    return (
        batch["tokens"],
        batch["labels"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        batch["position_ids"],
    )


def _masked_sum(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token losses where the mask is set, number of such tokens), in fp32."""
    mask = loss_mask.float().view(-1)
    return torch.sum(per_token_loss.float().view(-1) * mask), mask.sum()


def _finite_or_own(loss: torch.Tensor, reported: torch.Tensor) -> torch.Tensor:
    """A NaN/Inf loss is reported as itself, chosen on the device: a Python `if` on it would
    stall the host until the GPU drains, once per microbatch (the iteration end checks)."""
    return torch.where(torch.isfinite(loss.detach()), reported.detach(), loss.detach())


def masked_mean_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, cp_group=None):
    """Mean of the per-token losses where the mask is set: this microbatch's lm loss.

    With context parallelism each rank holds part of the sequence: the loss it returns is
    its tokens' share of the global mean (megatron-core multiplies it by the CP size before
    backward, and gradients are averaged over data x context parallel ranks), while the
    reported value is the global mean itself.
    """
    total, count = _masked_sum(loss_mask, per_token_loss)
    if cp_group is not None:
        stats = torch.stack([total.detach(), count])
        torch.distributed.all_reduce(stats, group=cp_group)
        loss = total / stats[1].clamp(min=1.0)
        reported = stats[0] / stats[1].clamp(min=1.0)
    else:
        loss = total / count.clamp(min=1.0)
        reported = loss.detach()
    loss = maybe_inject_nan(loss)  # test hook (MEGATRON_WEIPIPE_INJECT_NAN); a no-op otherwise
    return loss, {"lm loss": _finite_or_own(loss, reported).clone()}


def masked_sum_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, cp_group=None):
    """Megatron-LM's loss under --calculate-per-token-loss: (sum of this rank's masked token
    losses, their count, {"lm loss": [sum, count]}).

    megatron-core leaves the sum undivided (TransformerConfig.calculate_per_token_loss) and
    sums gradients over data-parallel ranks; the training step divides them by the count of
    the whole global batch, which the iteration's one reduction of the reported pairs gives.
    With context parallelism the returned sum and count are this rank's share of the sequence
    and the reported pair the whole sequence's (summed over the CP group on the device).
    """
    total, count = _masked_sum(loss_mask, per_token_loss)
    stats = torch.stack([total.detach(), count])
    if cp_group is not None:
        torch.distributed.all_reduce(stats, group=cp_group)
    total = maybe_inject_nan(total)  # test hook (MEGATRON_WEIPIPE_INJECT_NAN); a no-op otherwise
    reported = torch.stack([_finite_or_own(total, stats[0]), stats[1]])
    return total, count.to(torch.int), {"lm loss": reported}


def per_token_loss_enabled(model) -> bool:
    """Whether the model (or its DDP / FSDP wrapper) was built with --calculate-per-token-loss."""
    config = getattr(getattr(model, "module", model), "config", None)
    return bool(getattr(config, "calculate_per_token_loss", False))


def forward_step(data_iterator, model):
    long_context = getattr(getattr(model, "module", model), "long_context", None)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, long_context)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    cp_group = long_context.cp_group if long_context is not None and long_context.cp_size > 1 else None
    loss_func = masked_sum_loss if per_token_loss_enabled(model) else masked_mean_loss
    return output, partial(loss_func, loss_mask, cp_group=cp_group)
