"""What the training loop works with (``TrainingRun``) and what it counts (``TrainState``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.data.datasets import build_train_valid_test_datasets
from megatron_weipipe.schedules.gpt.base import ForwardStep, TrainSchedule
from megatron_weipipe.training.checkpoint.async_saves import AsyncSaves
from megatron_weipipe.training.batch_size import BatchSizes
from megatron_weipipe.training.exit_signal import ExitSignal
from megatron_weipipe.training.housekeeping import Housekeeping
from megatron_weipipe.training.writers import ScalarWriters


@dataclass
class TrainState:
    """The loop's counters: checkpointed (iteration, samples, skips) and returned to the caller."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    last_saved_iteration: Optional[int] = None
    losses: list[float] = field(default_factory=list)  # lm loss per iteration (all ranks agree)
    grad_norms: list[float] = field(default_factory=list)
    exit_reason: str = "finished"


@dataclass
class TrainingHooks:
    """What the caller of ``pretrain()`` supplies: the model, the forward step, the data, and observers."""

    model_provider: Callable[..., torch.nn.Module]
    forward_step: ForwardStep
    datasets_provider: Callable = build_train_valid_test_datasets
    after_backward: Optional[Callable[[int, TrainSchedule], None]] = None
    on_log: Optional[Callable[[dict], None]] = None


@dataclass
class TrainingRun:
    """Everything set up before the first iteration; the step, the loop and its jobs read it."""

    cfg: PretrainConfig
    ctx: RunContext
    hooks: TrainingHooks
    schedule: TrainSchedule
    model_chunks: list[torch.nn.Module]
    optimizer: Any  # megatron-core's (Chained)MegatronOptimizer
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    train_iter: Optional[Iterator[dict]]
    valid_iter: Optional[Iterator[dict]]
    batch_sizes: BatchSizes  # megatron-core's microbatch calculator: this iteration's global batch
    train_iters: int  # the run's optimizer steps (PretrainConfig.train_iters)
    flops_per_sample: float
    writers: ScalarWriters  # TensorBoard and W&B (last rank)
    exit_signal: ExitSignal
    start_time: float  # time.time() when pretrain() was entered
    housekeeping: Housekeeping  # param-gather hooks, manual GC, empty_cache (housekeeping.py)
    async_saves: Optional[AsyncSaves] = None  # --async-save: the saves written in the background
