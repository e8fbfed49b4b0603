"""What a state format is: how one data-parallel mode writes and reads a run's state.

checkpointing.py owns what every checkpoint shares (directories, tracker, the common
state, the checks before loading) and picks one ``StateFormat`` from the config; the
format owns the shards: which tensors, under which keys, through which writer. As
megatron-core's dist_checkpointing strategies are objects behind one interface, so are
these:

- torch_dist_format.PlainOptimizerFormat: DDP with megatron-core's plain optimizer;
- torch_dist_format.DistributedOptimizerFormat: DDP with ``--use-distributed-optimizer``;
- fsdp2_format.Fsdp2Format: ``--use-torch-fsdp2`` (torch.distributed.checkpoint of DTensors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.training.checkpoint import optimizer_resharding
from megatron_weipipe.training.checkpoint.directory import CheckpointError


@dataclass
class TrainState:
    """The live objects a checkpoint is saved from and loaded into.

    ``ctx`` may be None when nothing rank-dependent is touched (a weights-only load in one
    process); ``optimizer`` and ``scheduler`` are None when there are none.
    """

    ctx: Optional[RunContext]
    model_chunks: list
    optimizer: Any = None
    scheduler: Any = None


class StateFormat(ABC):
    """One data-parallel mode's checkpoint content; chosen once per run from the config."""

    #: recorded in the layout as ``data_parallel_mode``; a checkpoint loads only into its own mode
    data_parallel_mode: str

    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        #: the format's entries in the layout that common.pt records
        self.layout = {"optimizer": optimizer_resharding.optimizer_layout(cfg),
                       "data_parallel_mode": self.data_parallel_mode}

    @abstractmethod
    def refusal(self, saved_layout: dict, now_layout: dict, load_optimizer: bool) -> Optional[str]:
        """One line when a checkpoint saved under ``saved_layout`` cannot load into this run, else None.

        ``load_optimizer``: the optimizer state is wanted (not --no-load-optim, --finetune or weights only).
        """

    @abstractmethod
    def sharded_state_dict(self, state: TrainState, *, with_optim: bool) -> dict:
        """This rank's part of the state to save, under its checkpoint keys."""

    @abstractmethod
    def save(self, state: TrainState, path: str, common: dict) -> None:
        """Write every rank's shards and ``common`` (the state all formats share) into ``path``."""

    @abstractmethod
    def start_save(self, state: TrainState, path: str, common: dict):
        """What ``save`` writes, planned now (device tensors still to be copied) and returned as
        megatron-core's AsyncRequest, whose finalize functions complete it on every rank."""

    @abstractmethod
    def load(self, state: TrainState, path: str, common: dict, *, with_optim: bool, with_rng: bool):
        """Load ``path`` into ``state`` in place; returns this rank's saved RNG state, or None."""


def model_keys(model_chunks) -> list[str]:
    """Top-level checkpoint key of each model chunk: ``model``, or ``model0``, ``model1``, ... ."""
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def rng_streams(platform):
    """Every random stream a rank draws from (host, device, megatron-core's tracker)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return platform.rng_streams(host=True, tracker=get_cuda_rng_tracker())


def load_failure(path: str, e: Exception) -> CheckpointError:
    """The one line a failed read of ``path`` reports (the reader's first line of error)."""
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return CheckpointError(f"--load: cannot load {path} ({type(e).__name__}: {first})")
