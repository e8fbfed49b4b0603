"""Start torch.distributed and megatron-core's parallel layout for a run."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron_weipipe.byte_counter import process_byte_counter
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.parallel import ParallelGroups
from megatron_weipipe.platform import detect_platform, install_cpu_adapter

log = logging.getLogger(__name__)


def initialize_distributed(cfg: PretrainConfig) -> RunContext:
    """torch.distributed (NCCL on GPU hosts, gloo on CPU hosts) + megatron-core parallel_state;
    returns the run's services."""
    from megatron.core import parallel_state

    platform = detect_platform()
    if not platform.is_cuda:
        install_cpu_adapter()
    counter = process_byte_counter()
    backend = cfg.parallel.distributed_backend or platform.backend
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if platform.is_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_method = None  # the launcher's MASTER_ADDR / MASTER_PORT
        if "MASTER_ADDR" not in os.environ:  # a plain `python pretrain_gpt.py` single process
            # A store of its own on a free port; the process environment is left alone, so
            # nothing this process starts later inherits a port that is no longer its own.
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timeout)
    if dist.get_world_size() != cfg.world_size:
        raise RuntimeError(
            f"configuration was validated for world size {cfg.world_size} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel_groups()
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_size(cfg.model.num_layers),
        context_parallel_size=p.context_parallel_size,
        # the partial distributed optimizer's intra- and inter-instance data-parallel groups
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes or None,
        distributed_timeout_minutes=p.distributed_timeout_minutes,
        create_gloo_process_groups=False,
    )
    groups = ParallelGroups.from_parallel_state()
    set_random_seed(cfg.training.seed, groups)
    from megatron_weipipe.model.tp_overlap import initialize_userbuffers

    initialize_userbuffers(cfg, platform, dist.get_rank())  # --tp-comm-overlap, before any model is built
    return RunContext(groups=groups, platform=platform, bytes=counter)


def _free_port() -> int:
    """A port no one listens on now: the store of a single process needs one of its own,
    and a fixed or pid-derived choice collides with other runs on the same host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seed(seed: int, groups: ParallelGroups) -> None:
    """Megatron's seeding: distinct per pipeline stage, megatron-core's tracker for TP regions."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * groups.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2**32))
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def destroy_model_parallel_groups() -> None:
    """Forget megatron-core's groups and destroy every process group but the default one.

    megatron-core's destroy_model_parallel() only drops its references; a process that
    trains again (the link testbed runs many jobs in one process, tests run pretrain()
    repeatedly) would otherwise keep each old group's backend alive: under gloo two
    threads per group, a thousand after a few dozen runs, waking in the kernel and taking
    the cores the next run is timed on."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # DTensor caches sharding results by mesh equality (ranks, device), not by group: a
    # new FSDP mesh over the same ranks would get specs holding the old, destroyed group.
    from torch.distributed.tensor import debug as dtensor_debug

    clear = getattr(dtensor_debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
    world = dist.GroupMember.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    # a gloo group's threads stop when the group object is freed, and the last run's model
    # and optimizer hold theirs in reference cycles: collect now, not at some later
    # collection (until then each of those threads keeps waking in the kernel)
    gc.collect()


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
