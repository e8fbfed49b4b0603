"""Distributed checkpoints (megatron-core dist_checkpointing, torch_dist format).

Layout, as in Megatron-LM: ``<dir>/iter_0000025/`` per checkpoint plus the tracker file
``<dir>/latest_checkpointed_iteration.txt``. A checkpoint becomes visible only when it
is complete: every rank writes its shards into ``iter_0000025.partial/``, all ranks
agree, rank 0 renames the directory to ``iter_0000025`` and only then replaces the
tracker atomically. A crash at any point of a save (SIGKILL included) leaves the tracker
on the previous checkpoint, which therefore stays loadable and is what ``--load`` picks;
the ``.partial`` directory it leaves behind is removed by the next save.

Loading reads files as data only (see ``safe_load``) and checks every file first, on
every rank, so a truncated or mismatched checkpoint fails with one line naming it
before any rank enters a collective it could hang in.
"""

from __future__ import annotations

import glob
import logging
import os
import queue
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_weipipe import faults
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.flags import to_flags
from megatron_weipipe.parallel import ParallelGroups
from megatron_weipipe.platform import Platform
from megatron_weipipe.training import fsdp_checkpoint, optimizer_checkpoint, safe_load

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
    platform: Optional[Platform] = None

    def restore_rng(self) -> None:
        """Apply the saved RNG state; call after everything that draws random numbers at start-up."""
        if self.rng_state is not None:
            state = self.rng_state[0] if isinstance(self.rng_state, list) else self.rng_state
            _rng_streams(self.platform).set_state(state)
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


def _fsync_dir(path: str) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_tracker_atomically(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_dir(root)


def _rng_streams(platform: Platform):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return platform.rng_streams(host=True, tracker=get_cuda_rng_tracker())


def _rng_state(groups: ParallelGroups, platform: Platform):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _rng_streams(platform).get_state()
    # One object per (pipeline, tensor) coordinate; data-parallel copies are replicas.
    return ShardedObject(
        "rng_state",
        [state],
        (groups.pp_size, groups.tp_size),
        (groups.pp_rank, groups.tp_rank),
        replica_id=groups.dp_rank * groups.cp_size + groups.cp_rank,
    )


def _layout(cfg: PretrainConfig) -> dict:
    p = cfg.parallel
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "world_size": cfg.world_size,
        "pipeline_schedule": cfg.schedule_name,
        "virtual_pipeline_size": p.virtual_pipeline_size(cfg.model.num_layers),
        "optimizer": optimizer_checkpoint.optimizer_layout(cfg),
        "data_parallel_mode": fsdp_checkpoint.mode(cfg),
    }


def unwrap(chunk):
    """The model inside a DDP wrapper: checkpoint keys must not depend on the wrapper."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def _model_keys(model_chunks) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def _sharded_state(cfg, ctx: RunContext, model_chunks, optimizer, scheduler, *, with_optim: bool, with_rng: bool,
                   extra: Optional[dict] = None, load_optimizer=None) -> dict:
    """The sharded state to save, or (``load_optimizer(state)`` given) to request when loading."""
    state: dict = {}
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        state[key] = unwrap(chunk).sharded_state_dict()
    if with_optim and optimizer is not None:
        if load_optimizer is None:
            state["optimizer"] = optimizer_checkpoint.save_state(optimizer, state, cfg)
        else:
            key, request = load_optimizer(state)
            state[key] = request
        state["opt_param_scheduler"] = scheduler.state_dict() if scheduler is not None else {}
    if with_rng:
        state["rng_state"] = _rng_state(ctx.groups, ctx.platform)
    if extra:
        state.update(extra)
    return state


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
) -> tuple[str, bool]:
    """Write ``iter_<N>.partial`` on every rank, then publish it as ``iter_<N>``.

    Returns the checkpoint path and whether it was written (False: already published).
    """
    from megatron.core import dist_checkpointing

    root = cfg.checkpoint.save
    path = checkpoint_dir(root, iteration)
    partial = path + ".partial"
    rank = dist.get_rank()
    if read_tracker(root) == iteration and os.path.isdir(path):
        # Already published (e.g. a resumed run told to exit at once): never rewrite it in place.
        return path, False
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in [partial, *glob.glob(os.path.join(root, "iter_*.partial"))]:
            if os.path.isdir(stale):  # left by a save that crashed before it was published
                shutil.rmtree(stale)
        if os.path.isdir(path):  # unpublished: newer than the tracker, from a crashed run
            shutil.rmtree(path)
        os.makedirs(partial)
    dist.barrier()
    common = {
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "num_skipped_iterations": num_skipped_iterations,
        "layout": _layout(cfg),
        "model_shape": _model_shape(cfg),
        "model_flags": to_flags(cfg.model),
    }
    if cfg.parallel.use_torch_fsdp2:
        fsdp_checkpoint.save(cfg, ctx, partial, model_chunks, optimizer, scheduler, common)
    else:
        common["optimizer_step"] = optimizer_checkpoint.adam_step(optimizer) if optimizer is not None else None
        state = _sharded_state(cfg, ctx, model_chunks, optimizer, scheduler, with_optim=True, with_rng=True,
                               extra=common)
        _avoid_result_manager_process()
        dist_checkpointing.save(state, partial)
    faults.pause_inside_save(iteration)
    dist.barrier()
    if rank == 0:
        os.replace(partial, path)
        _fsync_dir(root)
        _write_tracker_atomically(root, iteration)
    dist.barrier()
    return path, True


def _avoid_result_manager_process() -> None:
    """Keep megatron-core's synchronous writer from starting a multiprocessing Manager.

    Its torch_dist writer collects results through a queue that it creates, on first use,
    with a ``spawn`` Manager: a server process that lives until interpreter exit and is
    orphaned if the rank is killed. A synchronous save produces and consumes the results
    in this process, so an in-process queue does the same job. (An asynchronous save would
    need the Manager back; this package saves synchronously.)
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


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


def save_weights(cfg: PretrainConfig, model_chunks, root: str, extra: Optional[dict] = None) -> str:
    """A weights-only checkpoint (tracker ``release``): ``--load`` starts training from it at
    step 0 with a fresh optimizer, under any layout."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(root, 0)
    if dist.get_rank() == 0:
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
    dist.barrier()
    state = {key: unwrap(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model_chunks), model_chunks)}
    state.update(iteration=0, checkpoint_version=CHECKPOINT_VERSION, weights_only=True, layout=_layout(cfg),
                 model_shape=_model_shape(cfg), model_flags=to_flags(cfg.model), **(extra or {}))
    _avoid_result_manager_process()
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        _fsync_dir(root)
        tmp = os.path.join(root, f".{TRACKER}.tmp")
        with open(tmp, "w") as f:
            f.write("release")
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def saved_common(root: str) -> dict:
    """common.pt of the checkpoint ``root``'s tracker names (read as data only)."""
    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"{root}: no complete checkpoint ({TRACKER} is missing)")
    try:
        return safe_load.load_common(checkpoint_dir(root, iteration))
    except ValueError as e:
        raise CheckpointError(f"{root}: {e}") from None


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
    """Every file present, whole and plain data, and the model shape the same; returns common.pt."""
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
        raise CheckpointError(f"--load {path}/common.pt: the checkpoint's model shape differs: {diff}")
    return common


def load_checkpoint(cfg: PretrainConfig, ctx: RunContext, model_chunks, optimizer, scheduler) -> LoadedState:
    """Restore model, optimizer, LR schedule, RNG and data position from ``--load``."""
    from megatron.core import dist_checkpointing

    finetune = cfg.checkpoint.finetune
    with_optim = not (cfg.checkpoint.no_load_optim or finetune)
    error, path, common = None, None, {}
    try:
        path = find_checkpoint(cfg)
        if path is not None:
            common = _check_before_loading(cfg, path)
            mode_problem = fsdp_checkpoint.check_mode(common.get("layout", {}), cfg)
            if mode_problem:
                raise CheckpointError(f"--load {path}: {mode_problem}")
            problem = optimizer_checkpoint.check_resharding(common.get("layout", {}), _layout(cfg))
            if with_optim and problem and not common.get("weights_only"):
                raise CheckpointError(f"--load {path}: {problem}")
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    if path is None:
        return LoadedState()
    saved_layout = common.get("layout", {})
    weights_only = bool(common.get("weights_only"))  # e.g. converted from Hugging Face: start at step 0
    with_optim = with_optim and not weights_only
    finetune = finetune or weights_only
    same_rng_layout = all(
        saved_layout.get(k) == v
        for k, v in _layout(cfg).items()
        if k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size")
    )
    with_rng = same_rng_layout and not (cfg.checkpoint.no_load_rng or finetune)
    if cfg.parallel.use_torch_fsdp2:
        try:
            rng_state = fsdp_checkpoint.load(cfg, ctx, path, common, model_chunks, optimizer, scheduler,
                                             with_optim=with_optim, with_rng=with_rng)
        except Exception as e:
            raise CheckpointError(f"--load: cannot load {path} ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:300] if str(e) else ''})") from e
        return _loaded(cfg, ctx, path, common, finetune, rng_state)
    optimizer_key, apply_optimizer = "optimizer", None

    def load_optimizer(model_state):
        nonlocal optimizer_key, apply_optimizer
        optimizer_key, request, apply_optimizer = optimizer_checkpoint.load_request(
            optimizer, model_state, saved_layout, _layout(cfg), common.get("optimizer_step"))
        return optimizer_key, request

    sharded = _sharded_state(cfg, ctx, model_chunks, optimizer, scheduler, with_optim=with_optim, with_rng=with_rng,
                             load_optimizer=load_optimizer)
    try:
        with safe_load.safe_byte_objects():
            state = dist_checkpointing.load(sharded, path, common_strategy=safe_load.common_strategy())
    except Exception as e:
        raise CheckpointError(f"--load: cannot load {path} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    if with_optim:
        with torch.no_grad():  # the state is copied into the optimizer's leaf parameters in place
            apply_optimizer(state[optimizer_key])
        if scheduler is not None and state.get("opt_param_scheduler"):
            scheduler.load_state_dict(state["opt_param_scheduler"])
    return _loaded(cfg, ctx, path, common, finetune, state["rng_state"] if with_rng else None)


def _loaded(cfg, ctx: RunContext, path: str, common: dict, finetune: bool, rng_state) -> LoadedState:
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
