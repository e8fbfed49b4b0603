"""Checkpoints of ``--use-torch-fsdp2`` runs: torch.distributed.checkpoint over the DTensors.

The directory protocol is checkpointing.py's (``iter_N.partial`` published as ``iter_N``,
then the tracker); the content differs. The ``.distcp`` shards hold every parameter
(``model.<name>``) and its optimizer state (``optimizer.<name>.exp_avg`` ...) as the
DTensors FSDP2 shards over the data x context parallel group, under the model's own
parameter names; ``common.pt`` holds the iteration, data position, LR schedule, the Adam
step count and every rank's RNG state; ``metadata.json`` names the backend
``torch_dcp_fsdp2``. torch.distributed.checkpoint stores global tensors, so a checkpoint
loads under any data x context parallel size. Megatron's torch_dist checkpoints (DDP and
the distributed optimizer) use other keys: the two do not load into each other, and the
loader says so in one line.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

BACKEND = "torch_dcp_fsdp2"
FSDP_MODE, DDP_MODE = "fsdp2", "ddp"
_OPTIMIZER_STATE = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def mode(cfg) -> str:
    """The data-parallel mode a checkpoint records in its layout."""
    return FSDP_MODE if cfg.parallel.use_torch_fsdp2 else DDP_MODE


def check_mode(saved_layout: dict, cfg) -> Optional[str]:
    """One line when the checkpoint was written under the other data-parallel mode."""
    saved, now = saved_layout.get("data_parallel_mode", DDP_MODE), mode(cfg)
    if saved == now:
        return None
    if saved == FSDP_MODE:
        return ("the checkpoint was saved with --use-torch-fsdp2 (torch.distributed.checkpoint of the FSDP2 "
                "DTensors) and loads only with --use-torch-fsdp2")
    return ("the checkpoint was saved without --use-torch-fsdp2 (megatron-core torch_dist) and does not load "
            "into an FSDP2 run; resume it without --use-torch-fsdp2")


def _torch_optimizer(optimizer):
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1:
        raise NotImplementedError("FSDP checkpoints with more than one chained optimizer are not supported")
    return inner[0].optimizer


def _named_params(model_chunks):
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for key, chunk in zip(keys, model_chunks):
        for name, p in chunk.module.named_parameters():
            yield f"{key}.{name}", p


def _optimizer_tensors(cfg, model_chunks, optimizer, allocate: bool) -> dict:
    """Each parameter's optimizer state (DTensors), as key -> (state dict, entry);
    ``allocate`` creates zero state where the optimizer has not stepped yet, to load into."""
    torch_opt = _torch_optimizer(optimizer)
    names = _OPTIMIZER_STATE.get(cfg.training.optimizer, ())
    if cfg.training.optimizer == "sgd" and cfg.training.sgd_momentum == 0:
        names = ()
    out = {}
    for name, p in _named_params(model_chunks):
        if not p.requires_grad:
            continue
        state = torch_opt.state[p]
        if allocate and names and not all(n in state for n in names):
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            for n in names:
                state.setdefault(n, torch.zeros_like(p.detach()))
        for n in names:
            if n in state:
                out[f"optimizer.{name}.{n}"] = (state, n)
    return out


def _step(optimizer) -> Optional[float]:
    for state in _torch_optimizer(optimizer).state.values():
        if "step" in state:
            return float(state["step"])
    return None


def save(cfg, ctx, path: str, model_chunks, optimizer, scheduler, common: dict) -> None:
    """Write the DTensor shards of every rank and, from rank 0, common.pt and metadata.json."""
    import torch.distributed.checkpoint as dcp

    tensors = {name: p.detach() for name, p in _named_params(model_chunks)}
    if optimizer is not None:
        tensors.update({k: s[n] for k, (s, n) in _optimizer_tensors(cfg, model_chunks, optimizer, False).items()})
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, ctx.platform.rng_streams(host=True, tracker=_tracker()).get_state())
    dcp.save(tensors, storage_writer=_writer(path))
    if dist.get_rank() == 0:
        common = dict(common, rng_states=rng, optimizer_step=_step(optimizer) if optimizer is not None else None,
                      opt_param_scheduler=scheduler.state_dict() if scheduler is not None else {})
        torch.save(common, os.path.join(path, "common.pt"))
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
    dist.barrier()


def _writer(path: str):
    """torch's file writer, recording the checkpoint path as a plain string: safe_load
    reads ``.metadata`` with an allow-list that has no pathlib classes."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def storage_meta(self):
            meta = super().storage_meta()
            if meta is not None and meta.checkpoint_id is not None:
                meta.checkpoint_id = str(meta.checkpoint_id)
            return meta

    return Writer(path)


def _tracker():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def load(cfg, ctx, path: str, common: dict, model_chunks, optimizer, scheduler, *, with_optim: bool,
         with_rng: bool):
    """Load the DTensors in place (resharded to this run's group) and the LR schedule;
    returns this rank's saved RNG state, or None."""
    import torch.distributed.checkpoint as dcp

    params = dict(_named_params(model_chunks))
    tensors = {name: p.detach() for name, p in params.items()}
    entries = _optimizer_tensors(cfg, model_chunks, optimizer, allocate=True) if with_optim else {}
    tensors.update({k: s[n] for k, (s, n) in entries.items()})
    dcp.load(tensors, checkpoint_id=path)
    for key, (state, n) in entries.items():
        state[n] = tensors[key]
    with torch.no_grad():
        for name, p in params.items():  # dcp.load writes into the views; copy where it made new ones
            if tensors[name].to_local().data_ptr() != p.to_local().data_ptr():
                p.to_local().copy_(tensors[name].to_local())
    if with_optim:
        step = common.get("optimizer_step")
        for state in _torch_optimizer(optimizer).state.values():
            if step is not None and "step" in state:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if scheduler is not None and common.get("opt_param_scheduler"):
            scheduler.load_state_dict(common["opt_param_scheduler"])
    rng = common.get("rng_states")
    if with_rng and rng is not None and len(rng) == dist.get_world_size():
        return rng[dist.get_rank()]
    return None
