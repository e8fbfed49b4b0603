"""Training runs for tests/test_per_token_loss.py: uneven loss masks, gradients of any
layout (FSDP2's by parameter name), the validation loss, bytes, gradient dtypes, and a
hand computation of the per-token loss and its gradient inside the one-process run."""

from __future__ import annotations

import numpy as np
import torch

# Loss tokens kept per sample (sample index mod 8) before --eod-mask-loss removes the
# end-of-document ones: microbatches and data-parallel ranks hold very different counts.
KEEP = (32, 3, 19, 7, 26, 1, 12, 30)


class UnevenMasks(torch.utils.data.Dataset):
    """A GPT dataset whose sample i keeps its loss mask on its first KEEP[i % 8] tokens only."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.dataset[i])
        mask = sample["loss_mask"].clone()
        mask[KEEP[i % len(KEEP)]:] = 0
        sample["loss_mask"] = mask
        return sample


def uneven_datasets(cfg, tokenizer, sizes):
    from megatron_weipipe.data.datasets import build_train_valid_test_datasets

    return tuple(None if d is None else UnevenMasks(d) for d in build_train_valid_test_datasets(cfg, tokenizer, sizes))


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().double().cpu().numpy().copy()


def by_name(schedule, what: str) -> dict[str, np.ndarray]:
    """Full parameters or gradients by parameter name (one process, or FSDP2: gathered)."""
    out = {}
    for chunk in schedule.model_chunks:
        for name, p in chunk.module.named_parameters():
            g = getattr(p, "main_grad", None) if what == "grad" else p
            g = p.grad if what == "grad" and g is None else g
            if g is not None:
                out[name] = _numpy(g)
    return out


def _state(schedule, what: str, fsdp: bool):
    from harness.state import local_shards

    return by_name(schedule, what) if fsdp else local_shards(schedule.model_chunks, what)


def hand_loss(model, batches: list[dict], backward: bool):
    """sum(masked token losses) / count over ``batches``, computed directly, and its gradient
    by parameter name (torch.autograd.grad: DDP's hooks and buffers are left alone)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total, count = 0.0, 0.0
    with torch.set_grad_enabled(backward):
        for b in batches:
            losses = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
            mask = b["loss_mask"].float()
            total = total + (losses.float() * mask).sum()
            count = count + mask.sum()
        loss = total / count
    if not backward:
        return float(loss.detach()), int(count), {}
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return float(loss.detach()), int(count), {n: _numpy(g) for (n, _), g in zip(named, grads)}


def _grad_buffers(schedule) -> dict:
    """dtypes of megatron-core DDP's gradient buffers and main_grads, the buffers' elements,
    and (WeiPipe) the elements of the replicated parameters summed over the ring."""
    dtypes, numel = set(), 0
    for chunk in schedule.model_chunks:
        for buffer in getattr(chunk, "buffers", []):
            dtypes.add(str(buffer.grad_dtype))
            numel += buffer.grad_data.numel()
        for p in chunk.module.parameters():
            if getattr(p, "main_grad", None) is not None:
                dtypes.add(str(p.main_grad.dtype))
    replicated = sum(p.numel() for p in getattr(schedule, "replicated", []))
    return {"dtypes": sorted(dtypes), "numel": numel, "replicated_numel": replicated}


def _reduce_scatters(log: list) -> dict:
    """Record (dtype, output bytes) of every reduce-scatter (FSDP2's gradient reduction:
    ``reduce_scatter_single`` in recent torch); returns the plain functions to put back."""
    import torch.distributed as dist

    plain = {name: getattr(dist, name) for name in ("reduce_scatter_single", "reduce_scatter_tensor")
             if hasattr(dist, name)}

    def recording(fn):
        def reduce_scatter(output, input, *args, **kwargs):
            log.append((str(output.dtype), output.numel() * output.element_size()))
            return fn(output, input, *args, **kwargs)
        return reduce_scatter

    for name, fn in plain.items():
        setattr(dist, name, recording(fn))
    return plain


def train_one(world_size: int, argv: list[str], hand: bool = False) -> dict:
    """pretrain() on this rank with uneven masks; with ``hand`` (one process) the iteration-1
    loss and gradient and the validation loss computed directly from the batches it read."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import pretrain_gpt
    from harness.gpu_rules import GpuRules
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training import evaluation
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    fsdp = cfg.parallel.use_torch_fsdp2
    read, seen = [], {}
    out = {"grads": {}, "sent": {}, "validation": [], "hand": {}, "grads_by_name": {}, "reduce_scatters": {}}

    def recording_forward_step(data_iterator, model):
        batch = next(data_iterator)
        read.append(batch)
        return forward_step(iter([batch]), model)

    def after_backward(iteration, schedule):
        seen["schedule"] = schedule
        out["grads"][iteration] = _state(schedule, "grad", fsdp)
        out["sent"][iteration] = dict(schedule.ctx.bytes.snapshot()["sent"])
        out["grad_buffers"] = _grad_buffers(schedule)
        out["reduce_scatters"][iteration] = list(rs_log)
        rs_log.clear()
        if hand:  # one process: by name too, for FSDP2's runs
            out["grads_by_name"][iteration] = by_name(schedule, "grad")
        if hand and iteration == 1:
            model = schedule.model_chunks[0].module
            before = out["grads_by_name"][iteration]
            out["hand"]["loss"], out["hand"]["count"], out["hand"]["grads"] = hand_loss(model, read, True)
            out["hand"]["grads_untouched"] = all(np.array_equal(before[k], v)
                                                 for k, v in by_name(schedule, "grad").items())
        read.clear()

    plain_evaluate, rs_log = evaluation.evaluate, []
    evaluation.evaluate = lambda run: out["validation"].append(plain_evaluate(run)) or out["validation"][-1]
    with GpuRules(cfg) as rules:  # no host sync inside forward-backward, no host tensor in a collective
        plain_rs = _reduce_scatters(rs_log)
        try:
            state = pretrain(cfg, rules.model_provider(pretrain_gpt.model_provider), recording_forward_step,
                             datasets_provider=uneven_datasets, after_backward=after_backward)
        finally:
            evaluation.evaluate = plain_evaluate
            for name, fn in plain_rs.items():
                setattr(dist, name, fn)
    out["gpu_rules"] = rules.report(state.iteration)
    if hand:
        out["params_by_name"] = by_name(seen["schedule"], "param")
    if hand and out["validation"]:
        out["hand"]["valid"] = hand_loss(seen["schedule"].model_chunks[0].module, read, False)[0]
    out.update(losses=state.losses, grad_norms=state.grad_norms, params=_state(seen["schedule"], "param", fsdp))
    parallel_state.destroy_model_parallel()
    return out


def train_many(rank: int, world_size: int, argvs: list[list[str]], hand: bool = False) -> list[dict]:
    return [train_one(world_size, argv, hand=hand) for argv in argvs]
