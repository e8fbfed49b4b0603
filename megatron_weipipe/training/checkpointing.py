"""Distributed checkpoints (megatron-core dist_checkpointing, torch_dist format).

Layout, as in Megatron-LM: ``<dir>/iter_0000025/`` per checkpoint plus the tracker file
``<dir>/latest_checkpointed_iteration.txt``. A checkpoint becomes visible only when it
is complete: every rank writes its shards, all ranks agree, and only then rank 0
replaces the tracker atomically. A crash at any point of a save leaves the tracker on
the previous checkpoint, which therefore stays loadable and is what ``--load`` picks.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.parallel import ParallelGroups

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the path and the reason."""


@dataclass
class LoadedState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_skipped_iterations: int = 0
    rng_state: object = None  # applied by the loop just before training resumes

    def restore_rng(self) -> None:
        """Apply the saved RNG state; call after everything that draws random numbers at start-up."""
        if self.rng_state is not None:
            _restore_rng(self.rng_state)
            self.rng_state = None


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} is corrupt: expected an iteration number, found {text[:40]!r}")


def _write_tracker_atomically(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _rng_state(groups: ParallelGroups):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    # One object per (pipeline, tensor) coordinate; data-parallel copies are replicas.
    return ShardedObject(
        "rng_state",
        [state],
        (groups.pp_size, groups.tp_size),
        (groups.pp_rank, groups.tp_rank),
        replica_id=groups.dp_rank * groups.cp_size + groups.cp_rank,
    )


def _restore_rng(obj) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = obj[0] if isinstance(obj, list) else obj
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state["cuda_rng_state"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout(cfg: PretrainConfig) -> dict:
    p = cfg.parallel
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "world_size": cfg.world_size,
        "pipeline_schedule": cfg.schedule_name,
    }


def unwrap(chunk):
    """The model inside a DDP wrapper: checkpoint keys must not depend on the wrapper."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def _model_keys(model_chunks) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def _sharded_state(cfg, groups, model_chunks, optimizer, scheduler, *, is_loading: bool, with_optim: bool,
                   with_rng: bool, extra: Optional[dict] = None) -> dict:
    state: dict = {}
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        state[key] = unwrap(chunk).sharded_state_dict()
    if with_optim and optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
        state["opt_param_scheduler"] = scheduler.state_dict() if scheduler is not None else {}
    if with_rng:
        state["rng_state"] = _rng_state(groups)
    if extra:
        state.update(extra)
    return state


def save_checkpoint(
    cfg: PretrainConfig,
    groups: ParallelGroups,
    iteration: int,
    model_chunks,
    optimizer,
    scheduler,
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    num_skipped_iterations: int = 0,
) -> str:
    """Write ``iter_<N>`` on every rank, then publish it. Returns the checkpoint path."""
    from megatron.core import dist_checkpointing

    root = cfg.checkpoint.save
    path = checkpoint_dir(root, iteration)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(path) and read_tracker(root) != iteration:
            # Leftovers of a save that crashed before it was published.
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = _sharded_state(
        cfg, groups, model_chunks, optimizer, scheduler, is_loading=False, with_optim=True, with_rng=True,
        extra={
            "iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "num_skipped_iterations": num_skipped_iterations,
            "layout": _layout(cfg),
            "model_shape": _model_shape(cfg),
        },
    )
    dist_checkpointing.save(state, path)
    dist.barrier()
    if rank == 0:
        _write_tracker_atomically(root, iteration)
    dist.barrier()
    return path


def _model_shape(cfg: PretrainConfig) -> dict:
    m = cfg.model
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.query_groups,
        "ffn_hidden_size": m.ffn_hidden_size,
        "swiglu": m.swiglu,
        "normalization": m.normalization,
        "position_embedding_type": m.position_embedding_type,
    }


def find_checkpoint(cfg: PretrainConfig) -> Optional[str]:
    """Path of the checkpoint ``--load`` names, None to start fresh; CheckpointError if unusable."""
    root = cfg.checkpoint.load
    if root is None:
        return None
    same_as_save = cfg.checkpoint.save is not None and os.path.abspath(root) == os.path.abspath(cfg.checkpoint.save)
    if not os.path.isdir(root):
        if same_as_save:  # first run of a requeued job: nothing saved yet
            return None
        raise CheckpointError(f"--load {root}: directory does not exist")
    iteration = read_tracker(root)
    if iteration is None:
        if same_as_save:
            return None
        raise CheckpointError(
            f"--load {root}: no complete checkpoint ({TRACKER} is missing; a save may have been interrupted)"
        )
    path = checkpoint_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {root}: checkpoint {path} is incomplete (no metadata.json)")
    return path


def load_checkpoint(cfg: PretrainConfig, groups: ParallelGroups, model_chunks, optimizer, scheduler) -> LoadedState:
    """Restore model, optimizer, LR schedule, RNG and data position from ``--load``."""
    from megatron.core import dist_checkpointing

    path = find_checkpoint(cfg)
    if path is None:
        return LoadedState()
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # corrupt or truncated common file
        raise CheckpointError(f"--load: cannot read {path}/common.pt ({type(e).__name__}: {e})") from e
    saved_shape = common.get("model_shape")
    if saved_shape is not None and saved_shape != _model_shape(cfg):
        diff = {k: (saved_shape.get(k), v) for k, v in _model_shape(cfg).items() if saved_shape.get(k) != v}
        raise CheckpointError(f"--load {path}: model shape differs from the checkpoint (saved, requested): {diff}")
    saved_layout = common.get("layout", {})
    same_rng_layout = all(
        saved_layout.get(k) == v
        for k, v in _layout(cfg).items()
        if k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size")
    )
    finetune = cfg.checkpoint.finetune
    with_optim = not (cfg.checkpoint.no_load_optim or finetune)
    with_rng = same_rng_layout and not (cfg.checkpoint.no_load_rng or finetune)
    sharded = _sharded_state(
        cfg, groups, model_chunks, optimizer, scheduler, is_loading=True, with_optim=with_optim, with_rng=with_rng
    )
    try:
        state = dist_checkpointing.load(sharded, path)
    except Exception as e:
        raise CheckpointError(f"--load: cannot load {path} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    if with_optim:
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("opt_param_scheduler"):
            scheduler.load_state_dict(state["opt_param_scheduler"])
    if not with_rng and not finetune and dist.get_rank() == 0:
        log.warning("checkpoint %s was saved under another parallel layout: RNG state not restored", path)
    if finetune:
        return LoadedState()
    return LoadedState(
        iteration=int(common.get("iteration", 0)),
        consumed_train_samples=int(common.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(common.get("consumed_valid_samples", 0)),
        num_skipped_iterations=int(common.get("num_skipped_iterations", 0)),
        rng_state=state["rng_state"] if with_rng else None,
    )
