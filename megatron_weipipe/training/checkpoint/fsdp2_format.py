"""Checkpoints of ``--use-torch-fsdp2`` runs: torch.distributed.checkpoint over the DTensors.

The directory protocol is directory.py's (``iter_N.partial`` published as ``iter_N``,
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

from megatron_weipipe.training.checkpoint.state_format import (StateFormat, TrainState, load_failure, model_keys,
                                                              rng_streams)

BACKEND = "torch_dcp_fsdp2"
FSDP_MODE = "fsdp2"
_OPTIMIZER_STATE = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class Fsdp2Format(StateFormat):
    """Every parameter and its optimizer state as DTensors, through torch.distributed.checkpoint."""

    data_parallel_mode = FSDP_MODE

    def refusal(self, saved_layout: dict, now_layout: dict, load_optimizer: bool) -> Optional[str]:
        if saved_layout.get("data_parallel_mode", "ddp") == FSDP_MODE:
            return None  # FSDP2 excludes the distributed optimizer: nothing dp_reshardable to refuse
        return ("the checkpoint was saved without --use-torch-fsdp2 (megatron-core torch_dist) and does not load "
                "into an FSDP2 run; resume it without --use-torch-fsdp2")

    def sharded_state_dict(self, state: TrainState, *, with_optim: bool) -> dict:
        tensors = {name: p.detach() for name, p in _named_params(state.model_chunks)}
        if with_optim and state.optimizer is not None:
            entries = _optimizer_tensors(self.cfg, state.model_chunks, state.optimizer, allocate=False)
            tensors.update({k: s[n] for k, (s, n) in entries.items()})
        return tensors

    def save(self, state: TrainState, path: str, common: dict) -> None:
        """Write the DTensor shards of every rank and, from rank 0, common.pt and metadata.json."""
        import torch.distributed.checkpoint as dcp

        tensors = self.sharded_state_dict(state, with_optim=True)
        _write_common(state, path, common)
        dcp.save(tensors, storage_writer=_writer(path))
        _write_metadata_json(path)

    def start_save(self, state: TrainState, path: str, common: dict):
        """The same files through megatron-core's asynchronous torch.distributed.checkpoint writer
        (as Megatron-LM saves its torch_dcp and fsdp_dtensor formats with --async-save)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
        from megatron.core.dist_checkpointing.strategies.state_dict_saver import (save_state_dict_async_finalize,
                                                                                  save_state_dict_async_plan)
        from torch.distributed.checkpoint import DefaultSavePlanner

        tensors = self.sharded_state_dict(state, with_optim=True)
        _write_common(state, path, common)
        writer = FileSystemWriterAsync(path, thread_count=1)
        planned = save_state_dict_async_plan(tensors, writer, None, 0, planner=DefaultSavePlanner())[0]
        write, preload, args = writer.get_save_function_and_args()

        def finalize() -> None:
            save_state_dict_async_finalize(*planned)
            _write_metadata_json(path)

        return AsyncRequest(write, args, [finalize], preload_fn=preload)

    def load(self, state: TrainState, path: str, common: dict, *, with_optim: bool, with_rng: bool):
        """Load the DTensors in place (resharded to this run's group) and the LR schedule."""
        try:
            _load_tensors(self.cfg, state, path, with_optim)
            if with_optim:
                _load_step_and_schedule(state, common)
        except Exception as e:
            raise load_failure(path, e) from e
        rng = common.get("rng_states")
        if with_rng and rng is not None and len(rng) == dist.get_world_size():
            return rng[dist.get_rank()]
        return None


def _write_common(state: TrainState, path: str, common: dict) -> None:
    """Rank 0 writes common.pt: the shared state, the LR schedule, the Adam step and every rank's RNG."""
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_streams(state.ctx.platform).get_state())
    if dist.get_rank() == 0:
        optimizer, scheduler = state.optimizer, state.scheduler
        common = dict(common, rng_states=rng, optimizer_step=_step(optimizer) if optimizer is not None else None,
                      opt_param_scheduler=scheduler.state_dict() if scheduler is not None else {})
        torch.save(common, os.path.join(path, "common.pt"))


def _write_metadata_json(path: str) -> None:
    """Rank 0 names the backend once every shard is written; every rank waits for it."""
    if dist.get_rank() == 0:
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
    dist.barrier()


def _torch_optimizer(optimizer):
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1:
        raise NotImplementedError("FSDP checkpoints with more than one chained optimizer are not supported")
    return inner[0].optimizer


def _named_params(model_chunks):
    for key, chunk in zip(model_keys(model_chunks), model_chunks):
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
        opt_state = torch_opt.state[p]
        if allocate and names and not all(n in opt_state for n in names):
            opt_state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            for n in names:
                opt_state.setdefault(n, torch.zeros_like(p.detach()))
        for n in names:
            if n in opt_state:
                out[f"optimizer.{name}.{n}"] = (opt_state, n)
    return out


def _step(optimizer) -> Optional[float]:
    for state in _torch_optimizer(optimizer).state.values():
        if "step" in state:
            return float(state["step"])
    return None


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


def _load_tensors(cfg, state: TrainState, path: str, with_optim: bool) -> None:
    """dcp.load into the parameters and (``with_optim``) the optimizer state, in place."""
    import torch.distributed.checkpoint as dcp

    params = dict(_named_params(state.model_chunks))
    tensors = {name: p.detach() for name, p in params.items()}
    entries = _optimizer_tensors(cfg, state.model_chunks, state.optimizer, allocate=True) if with_optim else {}
    tensors.update({k: s[n] for k, (s, n) in entries.items()})
    dcp.load(tensors, checkpoint_id=path)
    for key, (opt_state, n) in entries.items():
        opt_state[n] = tensors[key]
    with torch.no_grad():
        for name, p in params.items():  # dcp.load writes into the views; copy where it made new ones
            if tensors[name].to_local().data_ptr() != p.to_local().data_ptr():
                p.to_local().copy_(tensors[name].to_local())


def _load_step_and_schedule(state: TrainState, common: dict) -> None:
    """The Adam step count and the LR schedule, from common.pt."""
    step = common.get("optimizer_step")
    for opt_state in _torch_optimizer(state.optimizer).state.values():
        if step is not None and "step" in opt_state:
            opt_state["step"] = torch.tensor(float(step), dtype=torch.float32)
    if state.scheduler is not None and common.get("opt_param_scheduler"):
        state.scheduler.load_state_dict(common["opt_param_scheduler"])
