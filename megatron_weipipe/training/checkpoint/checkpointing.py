"""Saving and resuming a run: what every checkpoint shares, whichever format writes its shards.

The config picks one ``StateFormat`` (state_format.py) for the run; this module writes
around it what all formats share: the directory protocol of directory.py (a crash
mid-save leaves the previous checkpoint as what ``--load`` picks), the common state
(iteration, data position, layout, model shape and flags) and the checks before a load.

Loading reads files as data only (see ``safe_load``) and checks every file first, on
every rank, so a truncated or mismatched checkpoint fails with one line naming it
before any rank enters a collective it could hang in.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron_weipipe import faults
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.flags import to_flags
from megatron_weipipe.platform import Platform
from megatron_weipipe.training.checkpoint import directory, safe_load
from megatron_weipipe.training.checkpoint.async_saves import AsyncSaves
from megatron_weipipe.training.checkpoint.directory import CheckpointError
from megatron_weipipe.training.checkpoint.fsdp2_format import Fsdp2Format
from megatron_weipipe.training.checkpoint.state_format import StateFormat, TrainState, rng_streams
from megatron_weipipe.training.checkpoint.torch_dist_format import (DistributedOptimizerFormat, PlainOptimizerFormat,
                                                                    model_state_dict, save_sharded)

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
# Layout entries under which the RNG state of one rank is that of the same rank before.
_RNG_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size")


@dataclass
class LoadedState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_skipped_iterations: int = 0
    rng_state: object = None  # applied by the loop just before training resumes
    platform: Optional[Platform] = None

    def restore_rng(self) -> None:
        """Apply the saved RNG state; call after everything that draws random numbers at start-up."""
        if self.rng_state is not None:
            state = self.rng_state[0] if isinstance(self.rng_state, list) else self.rng_state
            rng_streams(self.platform).set_state(state)
            self.rng_state = None


def state_format(cfg: PretrainConfig) -> StateFormat:
    """The one place the data-parallel mode picks how a run's state is checkpointed."""
    if cfg.parallel.use_torch_fsdp2:
        return Fsdp2Format(cfg)
    if cfg.parallel.use_distributed_optimizer:
        return DistributedOptimizerFormat(cfg)
    return PlainOptimizerFormat(cfg)


def _layout(cfg: PretrainConfig, fmt: StateFormat) -> dict:
    p = cfg.parallel
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "world_size": cfg.world_size,
        "pipeline_schedule": cfg.schedule_name,
        "virtual_pipeline_size": p.virtual_pipeline_size(cfg.model.num_layers),
        **fmt.layout,
    }


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


def save_checkpoint(
    cfg: PretrainConfig,
    ctx: RunContext,
    iteration: int,
    model_chunks,
    optimizer,
    scheduler,
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
    num_skipped_iterations: int = 0,
    background: Optional[AsyncSaves] = None,
) -> tuple[str, bool]:
    """Write ``iter_<N>.partial`` on every rank, then publish it as ``iter_<N>``.

    With ``background`` (``--async-save``) the shards are written by a writer process and the
    publish is the request's last finalize step (async_saves.py); the caller waits for any
    save in flight first. Returns the checkpoint path and whether it was written (False:
    already published).
    """
    root = cfg.checkpoint.save
    if directory.is_published(root, iteration):
        # Already published (e.g. a resumed run told to exit at once): never rewrite it in place.
        return directory.checkpoint_dir(root, iteration), False
    partial = directory.start_partial(root, iteration)
    fmt = state_format(cfg)
    common = {
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "num_skipped_iterations": num_skipped_iterations,
        "layout": _layout(cfg, fmt),
        "model_shape": _model_shape(cfg),
        "model_flags": to_flags(cfg.model),
    }
    state = TrainState(ctx, model_chunks, optimizer, scheduler)
    if background is None:
        fmt.save(state, partial, common)
        faults.pause_inside_save(iteration)
        return directory.publish(root, iteration), True
    background.prepare()
    request = fmt.start_save(state, partial, common)
    request.add_finalize_fn(functools.partial(faults.pause_inside_save, iteration))
    request.add_finalize_fn(functools.partial(directory.publish, root, iteration))
    path = directory.checkpoint_dir(root, iteration)
    background.schedule(request, iteration, path)
    return path, True


def save_weights(cfg: PretrainConfig, model_chunks, root: str, extra: Optional[dict] = None) -> str:
    """A weights-only checkpoint (tracker ``release``): ``--load`` starts training from it at
    step 0 with a fresh optimizer, under any layout."""
    path = directory.checkpoint_dir(root, 0)
    if dist.get_rank() == 0:
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
    dist.barrier()
    state = model_state_dict(model_chunks)
    state.update(iteration=0, checkpoint_version=CHECKPOINT_VERSION, weights_only=True,
                 layout=_layout(cfg, state_format(cfg)), model_shape=_model_shape(cfg),
                 model_flags=to_flags(cfg.model), **(extra or {}))
    save_sharded(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        directory.write_release_tracker(root)
    dist.barrier()
    return path


def saved_common(root: str) -> dict:
    """The common state of the checkpoint ``root``'s tracker names (read as data only)."""
    iteration = directory.read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"{root}: no complete checkpoint ({directory.TRACKER} is missing)")
    try:
        return safe_load.load_common(directory.checkpoint_dir(root, iteration))
    except ValueError as e:
        raise CheckpointError(f"{root}: {e}") from None


def _agree(error: Optional[str]) -> None:
    """Raise the same CheckpointError on every rank if any rank found one; the first such rank prints it."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failing = [r for r, e in enumerate(errors) if e is not None]
    if failing:
        e = CheckpointError(errors[failing[0]])
        e.quiet = dist.get_rank() != failing[0]
        raise e


def _check_before_loading(cfg: PretrainConfig, path: str) -> dict:
    """Every file present, whole and plain data, and the model shape the same; returns the common state."""
    try:
        safe_load.check_checkpoint_files(path)
        common = safe_load.load_common(path)
    except ValueError as e:
        raise CheckpointError(f"--load: {e}") from None
    saved_shape = common.get("model_shape")
    if saved_shape is not None and saved_shape != _model_shape(cfg):
        diff = ", ".join(
            f"{k} {saved_shape.get(k)} in the checkpoint vs {v} requested"
            for k, v in _model_shape(cfg).items() if saved_shape.get(k) != v
        )
        raise CheckpointError(f"--load {path}: the checkpoint's model shape differs: {diff}")
    return common


def _find_loadable(cfg: PretrainConfig, fmt: StateFormat, now_layout: dict) -> tuple[Optional[str], dict]:
    """(path, common state) of the checkpoint to load, or (None, {}); the same on every rank,
    or the same CheckpointError on every rank."""
    error, path, common = None, None, {}
    try:
        path = directory.find_checkpoint(cfg)
        if path is not None:
            common = _check_before_loading(cfg, path)
            load_optimizer = not (cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune
                                  or common.get("weights_only"))
            problem = fmt.refusal(common.get("layout", {}), now_layout, bool(load_optimizer))
            if problem:
                raise CheckpointError(f"--load {path}: {problem}")
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    return path, common


def load_checkpoint(cfg: PretrainConfig, ctx: RunContext, model_chunks, optimizer, scheduler) -> LoadedState:
    """Restore model, optimizer, LR schedule, RNG and data position from ``--load``."""
    fmt = state_format(cfg)
    now_layout = _layout(cfg, fmt)
    path, common = _find_loadable(cfg, fmt, now_layout)
    if path is None:
        return LoadedState()
    saved_layout = common.get("layout", {})
    weights_only = bool(common.get("weights_only"))  # e.g. converted from Hugging Face: start at step 0
    with_optim = not (cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune or weights_only)
    finetune = cfg.checkpoint.finetune or weights_only
    same_rng_layout = all(saved_layout.get(k) == v for k, v in now_layout.items() if k in _RNG_LAYOUT)
    with_rng = same_rng_layout and not (cfg.checkpoint.no_load_rng or finetune)
    rng_state = fmt.load(TrainState(ctx, model_chunks, optimizer, scheduler), path, common,
                         with_optim=with_optim, with_rng=with_rng)
    if rng_state is None and not finetune and not cfg.checkpoint.no_load_rng and dist.get_rank() == 0:
        log.warning("checkpoint %s was saved under another parallel layout: RNG state not restored", path)
    if finetune:
        return LoadedState()
    return LoadedState(
        iteration=int(common.get("iteration", 0)),
        consumed_train_samples=int(common.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(common.get("consumed_valid_samples", 0)),
        num_skipped_iterations=int(common.get("num_skipped_iterations", 0)),
        rng_state=rng_state,
        platform=ctx.platform,
    )
