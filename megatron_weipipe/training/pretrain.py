"""The training loop: Megatron-LM's ``pretrain()`` on megatron-core pieces, schedule-agnostic."""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.context import RunContext
from megatron_weipipe.data.datasets import build_data_loader, build_train_valid_test_datasets
from megatron_weipipe.data.tokenizers import build_tokenizer
from megatron_weipipe.host_values import all_reduce_values
from megatron_weipipe.initialize import initialize_distributed
from megatron_weipipe.parallel import ParallelGroups
from megatron_weipipe import faults
from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.gpt.base import ForwardStep, TrainSchedule
from megatron_weipipe.shape import padded_vocab_size
from megatron_weipipe.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron_weipipe.training.metrics import (
    TensorBoardWriter,
    model_flops_per_iteration,
    training_log_line,
)
from megatron_weipipe.training.optimizer import build_optimizer, build_scheduler
from megatron_weipipe.training.watchdog import install_child_process_guards, start_watchdog

log = logging.getLogger(__name__)


class NaNError(RuntimeError):
    """Loss or gradient norm is NaN/Inf and the run was told not to skip such steps."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    last_saved_iteration: Optional[int] = None
    losses: list[float] = field(default_factory=list)  # lm loss per iteration (all ranks agree)
    grad_norms: list[float] = field(default_factory=list)
    exit_reason: str = "finished"


def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class _ExitSignal:
    """Remembers a SIGTERM so the run can finish its iteration, save and exit cleanly.

    Installed before anything slow, so a preemption notice that arrives during start-up
    is honoured at the end of the first iteration instead of killing the rank.
    """

    def __init__(self, enabled: bool):
        self.received = False
        self._previous = None
        if enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _reduce_iteration_flags(
    ctx: RunContext, losses: list[torch.Tensor], contributes: bool, flags: list[float], checks: bool = False
) -> tuple[float, float, int, list[float]]:
    """One all-reduce per iteration: sum and count of the finite losses, bad-loss count, exit flags.

    The logged loss comes from the ``contributes`` ranks (one per replica); NaN/Inf is
    looked for on every rank that ``checks`` (has a loss: each tensor and context rank
    holds its own share of it). The per-microbatch losses stay on the device; the one
    ``.tolist()`` of the reduced vector is this iteration's host sync (host_values.py).
    """
    device = ctx.platform.collective_device()
    stacked = torch.stack([v.detach().reshape(()).to(device=device, dtype=torch.float64) for v in losses]) \
        if losses else torch.zeros(0, dtype=torch.float64, device=device)
    finite = torch.isfinite(stacked)
    none = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.where(finite, stacked, 0.0).sum() if contributes else none
    count = finite.sum(dtype=torch.float64) if contributes else none
    bad = (~finite).sum(dtype=torch.float64) if checks else none
    reduced = all_reduce_values([total, count, bad, *flags], ctx.platform)
    return reduced[0], reduced[1], int(reduced[2]), reduced[3:]


def _first_bad_microbatch(ctx: RunContext, losses: list[torch.Tensor], contributes: bool) -> tuple[int, int]:
    """(global rank, microbatch) of the first NaN/Inf loss anywhere (only after one was seen)."""
    code = 1 << 60
    if contributes:
        for i, v in enumerate(torch.stack([v.detach().reshape(()) for v in losses]).tolist() if losses else []):
            if not math.isfinite(v):
                code = dist.get_rank() * 1_000_000 + i
                break
    (first,) = all_reduce_values([code], ctx.platform, op=dist.ReduceOp.MIN)
    return int(first) // 1_000_000, int(first) % 1_000_000


def _optimizer_step(optimizer, clip_grad: float):
    """megatron-core's ChainedOptimizer.step, split so a NaN/Inf norm can veto the update."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    if found_inf:  # fp16 loss-scale overflow: megatron-core's own skip
        return False, None
    grad_norm = optimizer.get_grad_norm()
    if grad_norm is None or not math.isfinite(grad_norm):
        return False, float("nan")
    if clip_grad > 0:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params and not getattr(opt, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    return optimizer.step_with_ready_grads(), grad_norm


def _microbatches(iterator, n: int) -> list[dict]:
    return [next(iterator) for _ in range(n)]


def _loss_values(result) -> list[torch.Tensor]:
    """This rank's per-microbatch lm losses, where they are (no read-back)."""
    return [d["lm loss"] for d in result.losses]


def evaluate(
    cfg: PretrainConfig,
    groups: ParallelGroups,
    schedule: TrainSchedule,
    forward_step: ForwardStep,
    valid_iter,
    n_microbatches: int,
) -> Optional[float]:
    for chunk in schedule.model_chunks:
        chunk.eval()
    values, contributes = [], False
    with torch.no_grad():
        for _ in range(cfg.training.eval_iters):
            result = schedule.forward_backward(forward_step, _microbatches(valid_iter, n_microbatches), forward_only=True)
            contributes = result.has_loss and groups.tp_rank == 0 and groups.cp_rank == 0
            values += _loss_values(result)
    for chunk in schedule.model_chunks:
        chunk.train()
    total, count, _, _ = _reduce_iteration_flags(schedule.ctx, values, contributes, [])
    return total / count if count else None


def pretrain(
    cfg: PretrainConfig,
    model_provider: Callable[..., torch.nn.Module],
    forward_step: ForwardStep,
    datasets_provider: Callable = build_train_valid_test_datasets,
    after_backward: Optional[Callable[[int, TrainSchedule], None]] = None,
    on_log: Optional[Callable[[dict], None]] = None,
) -> TrainState:
    """Train ``cfg.training.train_iters`` iterations; returns the final state (losses per iteration).

    ``model_provider(cfg, vocab_size, pre_process, post_process, vp_stage=None)`` builds one
    stage; ``forward_step(data_iterator, model)`` is Megatron-LM's forward step.
    ``after_backward(iteration, schedule)``, if given, sees the reduced gradients of every
    iteration before the optimizer step (tests compare them across schedules).
    ``on_log(stats)``, if given, is called on every rank at each logged iteration with the
    fields of the log line as a dict (``iteration``, ``elapsed_ms``, ``bytes_sent`` ...,
    unrounded), before rank 0 prints the line.

    An exception leaves with ``report`` (the line to print) and ``quiet`` (another rank
    prints the same error) attributes; peers are told through the watchdog and exit.
    """
    start_time = time.time()
    faults.configure()
    exit_signal = _ExitSignal(cfg.training.exit_signal_handler)
    install_child_process_guards()
    watchdog = None
    try:
        ctx = initialize_distributed(cfg)
        watchdog = start_watchdog(cfg.parallel.distributed_timeout_minutes)
        state = _pretrain(cfg, ctx, model_provider, forward_step, datasets_provider, after_backward,
                          exit_signal, start_time, on_log)
        if watchdog is not None:
            watchdog.stop()
            dist.barrier()  # no rank may take the store down while a peer's watchdog still polls it
        return state
    except BaseException as e:
        _describe_failure(e, watchdog)
        raise
    finally:
        exit_signal.restore()


def _describe_failure(e: BaseException, watchdog) -> None:
    """Publish the failure to the peers and attach the one line this rank should print."""
    own = f"failed during {faults.describe_phase()}: {type(e).__name__}: {_first_line(e)}"
    if isinstance(e, (NaNError, CheckpointError, ValueError, FileNotFoundError)):  # self-explanatory
        own = _first_line(e)
    if watchdog is None:
        report = own
    elif hasattr(e, "quiet"):  # raised by every rank together; one of them prints it
        watchdog.leave()
        report = own
    else:
        line = watchdog.report_failure(e)
        report = line if line.startswith("stopping:") else own
    try:
        e.report = report
        if not hasattr(e, "quiet"):
            e.quiet = False
    except AttributeError:
        pass


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _pretrain(cfg, ctx: RunContext, model_provider, forward_step, datasets_provider, after_backward, exit_signal,
              start_time, on_log=None) -> TrainState:
    t, groups = cfg.training, ctx.groups
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model, cfg.data.vocab_size)
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, groups.tp_size)
    schedule: TrainSchedule = registry.train_class(cfg.schedule_name)(cfg, ctx)
    print_rank_0(
        f"> schedule {cfg.schedule_name}: TP={groups.tp_size} PP={groups.pp_size} CP={groups.cp_size} "
        f"DP={groups.dp_size}, {cfg.num_microbatches} microbatches per replica, padded vocab {vocab}"
    )
    model_chunks = schedule.build_model(partial(model_provider, cfg, vocab))
    params = [p for m in model_chunks for p in m.parameters()]
    n_params = sum(p.numel() for p in params)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)  # FSDP: a shard
    print_rank_0(f"> parameters on rank 0: {n_params}" + (f" (its FSDP shards: {held})" if held != n_params else ""))
    optimizer = build_optimizer(cfg, model_chunks)
    scheduler = build_scheduler(cfg, optimizer)

    state = TrainState()
    faults.set_phase("loading checkpoint")
    loaded = load_checkpoint(cfg, ctx, model_chunks, optimizer, scheduler)
    state.iteration = loaded.iteration
    state.consumed_train_samples = loaded.consumed_train_samples
    state.consumed_valid_samples = loaded.consumed_valid_samples
    state.skipped_iterations = loaded.num_skipped_iterations
    if cfg.checkpoint.load and loaded.iteration:
        print_rank_0(f"> loaded checkpoint from {cfg.checkpoint.load} at iteration {loaded.iteration}")
        state.last_saved_iteration = loaded.iteration

    gbs = t.global_batch_size
    eval_runs = t.train_iters // t.eval_interval + 1
    num_samples = [t.train_iters * gbs, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs]
    faults.set_phase("building datasets")
    train_ds, valid_ds, _ = datasets_provider(cfg.data, tokenizer, num_samples)
    data_rank, data_size, n_mb = schedule.data_shard()
    if train_ds is None and t.train_iters > 0 and not t.skip_train:
        raise ValueError(f"--split {cfg.data.split} leaves no training data")
    train_iter = None if train_ds is None else iter(
        build_data_loader(
            train_ds, t.micro_batch_size, state.consumed_train_samples, data_rank, data_size, cfg.data.num_workers,
            pin_memory=ctx.platform.pin_memory,
        )
    )
    valid_iter = None
    if valid_ds is not None and t.eval_iters > 0:
        valid_iter = iter(
            build_data_loader(
                valid_ds, t.micro_batch_size, state.consumed_valid_samples, data_rank, data_size, 0,
                pin_memory=ctx.platform.pin_memory,
            )
        )

    # Dataset and loader construction may draw random numbers; restore the saved state after them.
    loaded.restore_rng()
    flops = model_flops_per_iteration(cfg, vocab)
    tb = TensorBoardWriter(cfg.logging.tensorboard_dir, dist.get_rank() == dist.get_world_size() - 1)
    print_rank_0(f"> setup done in {time.time() - start_time:.1f}s; training from iteration {state.iteration}")

    window_start, window_iters = time.time(), 0
    last_grad_norm = None
    try:
        while state.iteration < t.train_iters and not t.skip_train:
            faults.set_phase("reading data", state.iteration + 1)
            microbatches = _microbatches(train_iter, n_mb)
            faults.set_phase(faults.TRAIN_STEP, state.iteration + 1)
            ctx.bytes.reset()
            schedule.zero_grad()
            optimizer.zero_grad()
            result = schedule.forward_backward(forward_step, microbatches)
            values = _loss_values(result)
            contributes = result.has_loss and groups.tp_rank == 0 and groups.cp_rank == 0
            if after_backward is not None:
                after_backward(state.iteration + 1, schedule)
            timed_out = (
                t.exit_duration_in_mins is not None and (time.time() - start_time) / 60.0 > t.exit_duration_in_mins
            )
            total, count, bad, (sig, dur) = _reduce_iteration_flags(
                ctx, values, contributes, [float(exit_signal.received), float(timed_out and dist.get_rank() == 0)],
                checks=result.has_loss,
            )
            faults.set_phase("optimizer step", state.iteration + 1)
            stepped, grad_norm = False, None
            if bad:
                rank, mb = _first_bad_microbatch(ctx, values, result.has_loss)
                msg = (
                    f"NaN/Inf lm loss at iteration {state.iteration + 1} on rank {rank}, "
                    f"microbatch {mb} of that rank"
                )
                if not t.check_for_nan_in_loss_and_grad:
                    pass
                elif t.skip_nan_steps:
                    print_rank_0(f"WARNING: {msg}: step skipped")
                else:
                    raise _nan_error(msg)
            if not bad or not t.check_for_nan_in_loss_and_grad:
                with schedule.trace_span("optimizer"):
                    stepped, grad_norm = _optimizer_step(optimizer, t.clip_grad)
                if grad_norm is not None and not math.isfinite(grad_norm) and t.check_for_nan_in_loss_and_grad:
                    msg = f"NaN/Inf gradient norm at iteration {state.iteration + 1}"
                    if not t.skip_nan_steps:
                        raise _nan_error(msg)
                    print_rank_0(f"WARNING: {msg}: step skipped")
            if stepped:
                scheduler.step(increment=gbs)
                last_grad_norm = grad_norm
            else:
                state.skipped_iterations += 1
                if bad or (grad_norm is not None and not math.isfinite(grad_norm)):
                    state.nan_iterations += 1
            state.iteration += 1
            state.consumed_train_samples += gbs
            loss = total / count if count else float("nan")
            state.losses.append(loss)
            state.grad_norms.append(grad_norm if grad_norm is not None else float("nan"))
            window_iters += 1

            if state.iteration % cfg.logging.log_interval == 0:
                elapsed = time.time() - window_start
                per_iter = elapsed / window_iters
                mem, _ = ctx.platform.peak_memory_gb()
                lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else t.lr
                stats = dict(
                    iteration=state.iteration,
                    train_iters=t.train_iters,
                    consumed_samples=state.consumed_train_samples,
                    elapsed_ms=per_iter * 1000,
                    tflops_per_device=flops / per_iter / 1e12 / cfg.world_size,
                    tokens_per_second=gbs * cfg.model.seq_length / per_iter,
                    lr=lr,
                    global_batch_size=gbs,
                    losses={"lm loss": loss},
                    loss_scale=float(optimizer.get_loss_scale().item()),
                    grad_norm=grad_norm if stepped else None,  # none for a skipped step
                    skipped=state.skipped_iterations,
                    nan_iterations=state.nan_iterations,
                    mem_gb=mem,
                    bytes_sent=ctx.bytes.snapshot()["sent"],
                )
                if on_log is not None:
                    on_log(stats)
                print_rank_0(training_log_line(**stats))
                tb.scalars(state.iteration, {"lm-loss": loss, "learning-rate": lr, "grad-norm": last_grad_norm or 0.0})
                window_start, window_iters = time.time(), 0

            if valid_iter is not None and state.iteration % t.eval_interval == 0:
                faults.set_phase("validation", state.iteration)
                _run_validation(cfg, groups, schedule, forward_step, valid_iter, n_mb, state, tb)

            exit_now = None
            if sig:
                exit_now = "signal"
            elif dur:
                exit_now = "duration"
            elif t.exit_interval and state.iteration % t.exit_interval == 0:
                exit_now = "interval"
            save_now = cfg.checkpoint.save and (
                exit_now
                or (cfg.checkpoint.save_interval and state.iteration % cfg.checkpoint.save_interval == 0)
            )
            if save_now:
                _save(cfg, ctx, state, model_chunks, optimizer, scheduler)
                window_start = time.time()  # keep the save out of the next throughput window
            if exit_now:
                state.exit_reason = exit_now
                what = {"signal": "SIGTERM received", "duration": f"--exit-duration-in-mins {t.exit_duration_in_mins}",
                        "interval": f"--exit-interval {t.exit_interval}"}[exit_now]
                where = f"checkpoint in {cfg.checkpoint.save}" if cfg.checkpoint.save else "no --save, nothing saved"
                print_rank_0(f"> exiting at iteration {state.iteration} ({exit_now}: {what}; {where})")
                break

        if t.skip_train and valid_iter is not None:  # Megatron-LM: --skip-train still evaluates
            faults.set_phase("validation", state.iteration)
            _run_validation(cfg, groups, schedule, forward_step, valid_iter, n_mb, state, tb)
        if cfg.checkpoint.save and state.iteration > 0 and state.last_saved_iteration != state.iteration:
            _save(cfg, ctx, state, model_chunks, optimizer, scheduler)
        faults.set_phase("shutdown", state.iteration)
    finally:
        tb.close()
    return state


def _nan_error(msg: str) -> NaNError:
    """Every rank raises the same NaNError; rank 0 prints it."""
    e = NaNError(msg)
    e.quiet = dist.get_rank() != 0
    return e


def _run_validation(cfg, groups, schedule, forward_step, valid_iter, n_mb, state, tb) -> None:
    value = evaluate(cfg, groups, schedule, forward_step, valid_iter, n_mb)
    state.consumed_valid_samples += cfg.training.eval_iters * cfg.training.global_batch_size
    if value is None:
        return
    ppl = math.exp(min(20.0, value))
    bar = "-" * 100
    print_rank_0(
        f"{bar}\n validation loss at iteration {state.iteration} | lm loss value: {value:.6E} | "
        f"lm loss PPL: {ppl:.6E} | \n{bar}"
    )
    tb.scalars(state.iteration, {"lm-loss-validation": value})


def _save(cfg, ctx: RunContext, state: TrainState, model_chunks, optimizer, scheduler) -> None:
    faults.set_phase("checkpoint save", state.iteration)
    t0 = time.time()
    path, written = save_checkpoint(
        cfg,
        ctx,
        state.iteration,
        model_chunks,
        optimizer,
        scheduler,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        num_skipped_iterations=state.skipped_iterations,
    )
    state.last_saved_iteration = state.iteration
    if not written:
        print_rank_0(f"  checkpoint at iteration {state.iteration:7d} is already published in {path}; not rewritten")
        return
    print_rank_0(f"  successfully saved checkpoint at iteration {state.iteration:7d} to {path} "
                 f"[ t {time.time() - t0:.2f}s ]")
