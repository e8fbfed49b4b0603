"""Everything before the first iteration: tokenizer, schedule and model, optimizer,
checkpoint, data loaders, random state; returns the ``TrainingRun`` and its ``TrainState``."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import torch.distributed as dist

from megatron_weipipe import faults
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.data.datasets import build_data_loader
from megatron_weipipe.data.tokenizers import build_tokenizer
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.gpt.base import TrainSchedule
from megatron_weipipe.shape import padded_vocab_size
from megatron_weipipe.training.batch_size import BatchSizes
from megatron_weipipe.training.checkpoint.async_saves import AsyncSaves
from megatron_weipipe.training.checkpoint.checkpointing import load_checkpoint
from megatron_weipipe.training.console import print_rank_0
from megatron_weipipe.training.exit_signal import ExitSignal
from megatron_weipipe.training.housekeeping import Housekeeping
from megatron_weipipe.training.loop_state import TrainingHooks, TrainingRun, TrainState
from megatron_weipipe.training.metrics import model_flops_per_sample
from megatron_weipipe.training.optimizer import build_optimizer, build_scheduler
from megatron_weipipe.training.writers import build_writers


def set_up_run(cfg: PretrainConfig, ctx: RunContext, hooks: TrainingHooks, exit_signal: ExitSignal,
               start_time: float) -> tuple[TrainingRun, TrainState]:
    tokenizer = build_tokenizer(cfg.data)
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, ctx.groups.tp_size)
    schedule: TrainSchedule = registry.train_class(cfg.schedule_name)(cfg, ctx)
    model_chunks = _build_model(cfg, ctx, schedule, hooks, vocab)
    optimizer = build_optimizer(cfg, model_chunks, ctx.platform.pin_memory)
    scheduler = build_scheduler(cfg, optimizer)
    faults.set_phase("loading checkpoint")
    loaded = load_checkpoint(cfg, ctx, model_chunks, optimizer, scheduler)
    state = _resumed_state(cfg, loaded)
    batches = _batch_sizes(cfg, state)
    faults.set_phase("building datasets")
    train_iter, valid_iter = _data_iterators(cfg, ctx, schedule, hooks, tokenizer, state)
    # Dataset and loader construction may draw random numbers; restore the saved state after them.
    loaded.restore_rng()
    run = TrainingRun(
        cfg=cfg, ctx=ctx, hooks=hooks, schedule=schedule, model_chunks=model_chunks,
        optimizer=optimizer, scheduler=scheduler, train_iter=train_iter, valid_iter=valid_iter,
        batch_sizes=batches, train_iters=cfg.train_iters, flops_per_sample=model_flops_per_sample(cfg, vocab),
        writers=build_writers(cfg, dist.get_rank(), dist.get_world_size()),
        exit_signal=exit_signal, start_time=start_time,
        housekeeping=Housekeeping(cfg.training, schedule.param_gather, ctx.platform),
        async_saves=AsyncSaves() if cfg.checkpoint.async_save and cfg.checkpoint.save else None,
    )
    print_rank_0(f"> setup done in {time.time() - start_time:.1f}s; training from iteration {state.iteration}")
    return run, state


def _build_model(cfg: PretrainConfig, ctx: RunContext, schedule: TrainSchedule, hooks: TrainingHooks, vocab: int):
    """This rank's model chunks from the schedule, and the lines that describe them."""
    g = ctx.groups
    print_rank_0(
        f"> schedule {cfg.schedule_name}: TP={g.tp_size} PP={g.pp_size} CP={g.cp_size} "
        f"DP={g.dp_size}, {cfg.num_microbatches} microbatches per replica"
        f"{' at the final batch size' if cfg.batch_size_steps else ''}, padded vocab {vocab}"
    )
    model_chunks = schedule.build_model(partial(hooks.model_provider, cfg, vocab))
    params = [p for m in model_chunks for p in m.parameters()]
    n_params = sum(p.numel() for p in params)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)  # FSDP: a shard
    print_rank_0(f"> parameters on rank 0: {n_params}" + (f" (its FSDP shards: {held})" if held != n_params else ""))
    return model_chunks


def _resumed_state(cfg: PretrainConfig, loaded) -> TrainState:
    """The counters a loaded checkpoint carries (all zero without one)."""
    state = TrainState(
        iteration=loaded.iteration,
        consumed_train_samples=loaded.consumed_train_samples,
        consumed_valid_samples=loaded.consumed_valid_samples,
        skipped_iterations=loaded.num_skipped_iterations,
    )
    if cfg.checkpoint.load and loaded.iteration:
        print_rank_0(f"> loaded checkpoint from {cfg.checkpoint.load} at iteration {loaded.iteration}")
        state.last_saved_iteration = loaded.iteration
    return state


def _batch_sizes(cfg: PretrainConfig, state: TrainState) -> BatchSizes:
    """megatron-core's calculator at the samples consumed (Megatron-LM updates it as it loads a
    checkpoint). A batch-size schedule resumed from a checkpoint is checked from there on with
    the start-up rules (a run with more data-parallel ranks may have left behind sizes it cannot split)."""
    import torch.distributed as dist

    from megatron_weipipe.arguments import check_config
    from megatron_weipipe.errors import ConfigError

    if cfg.batch_size_steps is not None and cfg.checkpoint.load:
        try:
            check_config(replace(cfg, resumed_at=(state.iteration, state.consumed_train_samples)), check_data=False)
        except ConfigError as e:  # the same line on every rank; rank 0 prints it
            e.quiet = dist.get_rank() != 0
            raise
    batches = BatchSizes(cfg, dist.get_rank())
    batches.update(state.consumed_train_samples, consistency_check=False)
    if cfg.batch_size_steps is not None:
        print_rank_0(f"> global batch size {batches.global_batch_size} ({batches.num_microbatches} microbatches "
                     f"per replica) at {state.consumed_train_samples} consumed samples, "
                     f"{cfg.training.global_batch_size} from {cfg.batch_size_steps.final_from} on; "
                     f"{cfg.train_iters} iterations")
    return batches


def _data_iterators(cfg: PretrainConfig, ctx: RunContext, schedule: TrainSchedule, hooks: TrainingHooks,
                    tokenizer, state: TrainState):
    """The training and validation iterators, each resumed at the samples already consumed."""
    t = cfg.training
    gbs = t.global_batch_size
    eval_runs = cfg.train_iters // t.eval_interval + 1
    # Megatron-LM's train_valid_test_num_samples: a sample-based run's dataset holds --train-samples
    num_samples = [cfg.train_samples_read, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs]
    train_ds, valid_ds, _ = hooks.datasets_provider(cfg.data, tokenizer, num_samples)
    data_rank, data_size, _ = schedule.data_shard()
    if train_ds is None and cfg.train_iters > 0 and not t.skip_train:
        raise ValueError(f"--split {cfg.data.split} leaves no training data")

    def loader(dataset, consumed: int, num_workers: int):
        return iter(build_data_loader(dataset, t.micro_batch_size, consumed, data_rank, data_size, num_workers,
                                      pin_memory=ctx.platform.pin_memory))

    train_iter = None if train_ds is None else loader(train_ds, state.consumed_train_samples, cfg.data.num_workers)
    valid_iter = None
    if valid_ds is not None and t.eval_iters > 0:
        valid_iter = loader(valid_ds, state.consumed_valid_samples, 0)
    return train_iter, valid_iter
