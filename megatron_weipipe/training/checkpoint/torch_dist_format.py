"""DDP runs' checkpoints: megatron-core dist_checkpointing in its torch_dist format.

One sharded state dict holds the model chunks (``model`` or ``model0``, ``model1``, ...),
the optimizer (``optimizer``; ``optimizer_resharded`` when loading across optimizer
kinds), the LR schedule (``opt_param_scheduler``) and the RNG state of each (pipeline,
tensor) coordinate; megatron-core reshards the model into any layout on load. The two
formats differ only in how the optimizer state is written and requested
(optimizer_resharding.py says which combinations load).

Loading reads files as data only: megatron-core's reader runs with safe_load's planner
and common-state reader.
"""

from __future__ import annotations

import contextlib
import queue
import re
import warnings
from abc import abstractmethod
from typing import Callable, Optional

import torch

from megatron_weipipe import mcore_versions
from megatron_weipipe.training.checkpoint import optimizer_resharding as opt_state
from megatron_weipipe.training.checkpoint import safe_load
from megatron_weipipe.training.checkpoint.state_format import (StateFormat, TrainState, load_failure, model_keys,
                                                              rng_streams)

DDP_MODE = "ddp"
# (category, message) of the torch notices megatron-core's torch_dist reader raises from its
# own code, with no call of ours that avoids them: up to 0.16 it reads through the deprecated
# torch.distributed.checkpoint.load_state_dict; 0.19 calls ``load`` with positional
# arguments and ``no_dist=True``; and it hands torch the tensors it stacks along a prepended
# layer axis (every ``decoder.layers.*`` tensor and its optimizer state) as torch's legacy
# ShardedTensor, which warns when torch's load planner reads its device. The files read and
# the values loaded are the same either way.
_MCORE_READER_NOTICES = (
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    (UserWarning, "The argument order of load has been changed. Please check the document to avoid future "
                  "breakages."),
    (UserWarning, safe_load.SINGLE_PROCESS_NOTICE),
)
_PLAIN_FP32 = {"distributed": False, "precision": "fp32"}  # what a layout without an optimizer entry saved

# (top-level key, sharded request, apply(loaded value)) of the optimizer part of a load
OptimizerRequest = tuple[str, dict, Callable[[dict], None]]


def unwrap(chunk):
    """The model inside a DDP wrapper: checkpoint keys must not depend on the wrapper."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def model_state_dict(model_chunks) -> dict:
    """The sharded state dict of every model chunk, under its checkpoint key."""
    return {key: unwrap(chunk).sharded_state_dict() for key, chunk in zip(model_keys(model_chunks), model_chunks)}


def save_sharded(state: dict, path: str, background: bool = False):
    """megatron-core's torch_dist save of ``state`` into ``path``: written now, or (``background``)
    planned now and returned as megatron-core's AsyncRequest that writes it (async_saves.py)."""
    from megatron.core import dist_checkpointing

    if not background:
        _avoid_result_manager_process()
        return dist_checkpointing.save(state, path)
    return dist_checkpointing.save(state, path, async_sharded_save=True, **mcore_versions.async_save_kwargs())


def _avoid_result_manager_process() -> None:
    """Keep megatron-core's synchronous writer from starting a multiprocessing Manager.

    Its torch_dist writer collects results through a queue that it creates, on first use,
    with a ``spawn`` Manager: a server process that lives until interpreter exit and is
    orphaned if the rank is killed. A synchronous save produces and consumes the results
    in this process, so an in-process queue does the same job. (``--async-save`` writes in
    another process and serves the queue from there: async_saves.py.)
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def _rng_state(ctx):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    groups = ctx.groups
    # One object per (pipeline, tensor) coordinate; data-parallel copies are replicas.
    return ShardedObject(
        "rng_state",
        [rng_streams(ctx.platform).get_state()],
        (groups.pp_size, groups.tp_size),
        (groups.pp_rank, groups.tp_rank),
        replica_id=groups.dp_rank * groups.cp_size + groups.cp_rank,
    )


class TorchDistFormat(StateFormat):
    """Model, optimizer, LR schedule and RNG in one megatron-core sharded state dict."""

    data_parallel_mode = DDP_MODE

    def refusal(self, saved_layout: dict, now_layout: dict, load_optimizer: bool) -> Optional[str]:
        if saved_layout.get("data_parallel_mode", DDP_MODE) != DDP_MODE:
            return ("the checkpoint was saved with --use-torch-fsdp2 (torch.distributed.checkpoint of the FSDP2 "
                    "DTensors) and loads only with --use-torch-fsdp2")
        return opt_state.check_resharding(saved_layout, now_layout) if load_optimizer else None

    def sharded_state_dict(self, state: TrainState, *, with_optim: bool) -> dict:
        sharded = model_state_dict(state.model_chunks)
        if with_optim and state.optimizer is not None:
            sharded["optimizer"] = self._optimizer_state(state.optimizer, sharded)
            sharded["opt_param_scheduler"] = state.scheduler.state_dict() if state.scheduler is not None else {}
        sharded["rng_state"] = _rng_state(state.ctx)
        return sharded

    def save(self, state: TrainState, path: str, common: dict) -> None:
        save_sharded(self._to_save(state, common), path)

    def start_save(self, state: TrainState, path: str, common: dict):
        return save_sharded(self._to_save(state, common), path, background=True)

    def _to_save(self, state: TrainState, common: dict) -> dict:
        optimizer_step = opt_state.adam_step(state.optimizer) if state.optimizer is not None else None
        return {**self.sharded_state_dict(state, with_optim=True), **common, "optimizer_step": optimizer_step}

    def load(self, state: TrainState, path: str, common: dict, *, with_optim: bool, with_rng: bool):
        sharded = model_state_dict(state.model_chunks)
        optimizer_key, apply_optimizer = "optimizer", None
        if with_optim and state.optimizer is not None:
            saved_opt = common.get("layout", {}).get("optimizer") or _PLAIN_FP32
            optimizer_key, request, apply_optimizer = self._optimizer_request(
                state.optimizer, sharded, saved_opt, common.get("optimizer_step"))
            sharded[optimizer_key] = request
            sharded["opt_param_scheduler"] = state.scheduler.state_dict() if state.scheduler is not None else {}
        if with_rng:
            sharded["rng_state"] = _rng_state(state.ctx)
        try:
            loaded = _read(sharded, path, self._load_strategy(state))
        except Exception as e:
            raise load_failure(path, e) from e
        for key, chunk in zip(model_keys(state.model_chunks), state.model_chunks):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        if apply_optimizer is not None:
            with torch.no_grad():  # the state is copied into the optimizer's leaf parameters in place
                apply_optimizer(loaded[optimizer_key])
            if state.scheduler is not None and loaded.get("opt_param_scheduler"):
                state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        return loaded["rng_state"] if with_rng else None

    def _load_strategy(self, state: TrainState):
        """megatron-core's reader, or (--ckpt-fully-parallel-load) its fully parallel wrapper over
        the data x context parallel group: each replicated shard read once there, then broadcast."""
        if not self.cfg.checkpoint.ckpt_fully_parallel_load:
            return None
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

        return FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), state.ctx.groups.data_context)

    @abstractmethod
    def _optimizer_state(self, optimizer, model_state: dict) -> dict:
        """The optimizer's sharded state to save."""

    @abstractmethod
    def _optimizer_request(self, optimizer, model_state: dict, saved_opt: dict,
                           saved_step: Optional[float]) -> OptimizerRequest:
        """What to ask the checkpoint for the optimizer saved as ``saved_opt``, and how to apply it."""


def _read(sharded: dict, path: str, strategy=None) -> dict:
    """megatron-core's load of ``sharded`` from ``path`` (through ``strategy``, if given), reading
    every file as data only."""
    from megatron.core import dist_checkpointing

    with safe_load.safe_byte_objects(), _without_reader_notices():
        common_kwargs = {"common_strategy": safe_load.common_strategy()} \
            if mcore_versions.load_takes_common_strategy() else {}
        return dist_checkpointing.load(sharded, path, sharded_strategy=strategy, **common_kwargs)


@contextlib.contextmanager
def _without_reader_notices():
    """Drop exactly megatron-core's reader notices (``_MCORE_READER_NOTICES``) while it reads;
    every other warning is shown as before."""
    with warnings.catch_warnings():
        for category, notice in _MCORE_READER_NOTICES:
            warnings.filterwarnings("ignore", message=re.escape(notice) + "$", category=category)
        yield


class PlainOptimizerFormat(TorchDistFormat):
    """megatron-core's plain optimizer: its state in the shapes of the model's parameters."""

    def _optimizer_state(self, optimizer, model_state: dict) -> dict:
        return optimizer.sharded_state_dict(model_state, is_loading=False, metadata=None)

    def _optimizer_request(self, optimizer, model_state, saved_opt, saved_step) -> OptimizerRequest:
        request = optimizer.sharded_state_dict(model_state, is_loading=True)
        if opt_state.kind(saved_opt) != "distributed":
            return "optimizer", request, optimizer.load_state_dict
        load_kind = opt_state.kind(self.layout["optimizer"])
        return "optimizer_resharded", *opt_state.from_distributed(optimizer, request, load_kind, saved_step)


class DistributedOptimizerFormat(TorchDistFormat):
    """``--use-distributed-optimizer``: the state in dp_reshardable or fully_reshardable form."""

    def _optimizer_state(self, optimizer, model_state: dict) -> dict:
        sharding = self.layout["optimizer"]["sharding_type"]
        state = optimizer.sharded_state_dict(model_state, is_loading=False,
                                             metadata={"distrib_optim_sharding_type": sharding})
        _zero_bucket_padding(state)
        return state

    def _optimizer_request(self, optimizer, model_state, saved_opt, saved_step) -> OptimizerRequest:
        opt_state.allocate_state(optimizer)
        sharding = saved_opt.get("sharding_type") or opt_state.FULLY_RESHARDABLE
        request = optimizer.sharded_state_dict(model_state, is_loading=True,
                                               metadata={"distrib_optim_sharding_type": sharding})
        saved_kind = opt_state.kind(saved_opt)
        if saved_kind == "distributed":
            return "optimizer", request, lambda loaded: opt_state.load_distributed(optimizer, loaded)
        return "optimizer_resharded", *opt_state.from_plain(optimizer, request, saved_kind, saved_step,
                                                            opt_state.model_tensors(model_state))


def _zero_bucket_padding(state) -> None:
    """megatron-core's dp_reshardable state fills the gaps between parameters in a bucket with
    ``torch.empty``: whatever the allocator held would reach the file. Zeroed, two saves of the
    same state are the same tensors (the padding is never loaded into anything)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(state, dict):
        padding = state.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.unwrap() is True:
            for value in state.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
        children = state.values()
    elif isinstance(state, (list, tuple)):
        children = state
    else:
        return
    for child in children:
        _zero_bucket_padding(child)
