"""The global batch size of each iteration under --rampup-batch-size or --step-batch-size-schedule.

megatron-core's microbatch calculator decides it during the run (training/batch_size.py).
Start-up needs the same facts before torch is imported: the run's length in iterations,
the samples it reads, and every batch size it reaches (each must split into microbatches
the schedule can run). Both flags are read here into ``Steps``: from a number of consumed
samples on, one global batch size. A step schedule is that already (Megatron-LM's format);
a ramp is turned into it exactly, so that megatron-core releases whose calculator runs step
schedules only (0.18 on) run the ramp that 0.16 and 0.17's ramp calculator runs
(tests/test_batch_size_rampup.py compares the two on every consumed count).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import ConfigError, require

RAMPUP_FLAG = "--rampup-batch-size"
STEP_FLAG = "--step-batch-size-schedule"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Steps:
    """``starts[i]``: the consumed samples from which ``sizes[i]`` is the global batch size
    (``starts[0]`` is 0, the starts increase); ``ramp_end``: a ramp's RAMPUP_SAMPLES (None: a schedule)."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    ramp_end: Optional[int] = None

    def size_at(self, consumed: int) -> int:
        return self.sizes[max(bisect.bisect_right(self.starts, consumed) - 1, 0)]

    @property
    def final(self) -> int:
        return self.sizes[-1]

    @property
    def final_from(self) -> int:
        """Consumed samples from which the batch size no longer changes."""
        return self.starts[-1]

    def as_schedule(self) -> str:
        """Megatron-LM's ``THRESHOLD:BS ...`` text with thresholds in samples (megatron-core's
        step calculator reads it so without a sequence length)."""
        return " ".join(f"{start}:{size}" for start, size in zip(self.starts, self.sizes))


def _number(text: str) -> int:
    """Megatron-LM's reading of a threshold or batch size: a number with an optional K, M, B or T."""
    value = text.strip().upper()
    scale = _SUFFIXES.get(value[-1:], 1)
    if scale != 1:
        value = value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise ConfigError(f"{STEP_FLAG}: {text!r} is not a number (suffixes K, M, B, T)") from None


def parse_step_schedule(text: str, seq_length: int) -> Steps:
    """``"0:768 250B:1536 ..."``: thresholds in tokens (Megatron-LM passes the sequence length,
    so they become samples by integer division), sorted, the first 0, strictly increasing."""
    pairs = []
    for entry in text.strip().replace(",", " ").split():
        require(":" in entry, f'{STEP_FLAG}: entry {entry!r} is not THRESHOLD:BATCH_SIZE')
        threshold, size = entry.split(":", 1)
        pairs.append((_number(threshold) // seq_length, _number(size)))
    require(bool(pairs), f"{STEP_FLAG} needs at least one THRESHOLD:BATCH_SIZE entry")
    pairs.sort(key=lambda p: p[0])
    require(pairs[0][0] == 0, f"{STEP_FLAG}: the first threshold must be 0, not {pairs[0][0]} samples")
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        require(b > a, f"{STEP_FLAG}: thresholds must increase (in samples of --seq-length {seq_length}), "
                       f"got {a} then {b}")
    require(all(size > 0 for _, size in pairs), f"{STEP_FLAG}: batch sizes must be positive")
    for (_, a), (_, b) in zip(pairs, pairs[1:]):
        require(b >= a, f"{STEP_FLAG}: batch sizes must not decrease (Megatron-LM's training loop stops when "
                        f"the number of microbatches falls), got {b} after {a}")
    return Steps(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def check_ramp(ramp: list[int], global_batch_size: int) -> None:
    """megatron-core's asserts on a ramp, plus what its division by zero would hit."""
    require(len(ramp) == 3, f"{RAMPUP_FLAG} takes 3 values, START INCREMENT RAMPUP_SAMPLES; got {len(ramp)}")
    start, increment, samples = ramp
    require(start > 0 and increment > 0 and samples > 0,
            f"{RAMPUP_FLAG} START, INCREMENT and RAMPUP_SAMPLES must be positive, got {start} {increment} {samples}")
    require(start < global_batch_size,
            f"{RAMPUP_FLAG} START ({start}) must be smaller than --global-batch-size ({global_batch_size})")
    require((global_batch_size - start) % increment == 0,
            f"{RAMPUP_FLAG}: --global-batch-size minus START ({global_batch_size - start}) must be a multiple of "
            f"INCREMENT ({increment})")


def _first_reaching(k: int, per_increment: float) -> int:
    """The fewest consumed samples c with int(c / per_increment) >= k, the ramp calculator's own arithmetic."""
    c = math.ceil(k * per_increment)
    while c > 0 and int((c - 1) / per_increment) >= k:
        c -= 1
    while int(c / per_increment) < k:
        c += 1
    return c


def ramp_steps(ramp: list[int], global_batch_size: int) -> Steps:
    """megatron-core's ramp as steps: START + int(consumed / (RAMPUP_SAMPLES / increments)) x INCREMENT
    up to RAMPUP_SAMPLES consumed samples, --global-batch-size after them."""
    start, increment, samples = ramp
    increments = (global_batch_size - start) // increment
    per_increment = samples / increments
    starts, sizes = [0], [start]
    for k in range(1, increments + 1):
        at = min(_first_reaching(k, per_increment), samples + 1)
        size = global_batch_size if at > samples else start + k * increment
        if at == starts[-1]:
            sizes[-1] = size
        else:
            starts.append(at)
            sizes.append(size)
    return Steps(tuple(starts), tuple(sizes), ramp_end=samples)


def iterations_for_samples(steps: Steps, train_samples: int) -> int:
    """Megatron-LM's update_train_iters: a ramp counts iterations while the consumed samples are
    at most RAMPUP_SAMPLES and --train-samples, then whole final batches of the rest (Megatron-LM
    0.17's rule); a step schedule counts iterations until --train-samples are consumed."""
    consumed = iterations = 0
    if steps.ramp_end is not None:
        while consumed <= steps.ramp_end and consumed <= train_samples:
            consumed += steps.size_at(consumed)
            iterations += 1
        return iterations + max(train_samples - consumed, 0) // steps.final
    while consumed < train_samples and consumed < steps.final_from:
        consumed += steps.size_at(consumed)
        iterations += 1
    return iterations + max(0, -(-(train_samples - consumed) // steps.final))


def changes(steps: Steps, consumed: int, iteration: int, train_iters: int) -> list[tuple[int, int, int]]:
    """(iteration, consumed samples before it, global batch size) of the run's first iteration
    after ``iteration`` and of every later one whose batch size differs from the one before."""
    out: list[tuple[int, int, int]] = []
    while iteration < train_iters:
        size = steps.size_at(consumed)
        if not out or out[-1][2] != size:
            out.append((iteration + 1, consumed, size))
        if consumed >= steps.final_from:
            break
        consumed += size
        iteration += 1
    return out


def samples_read(steps: Steps, train_iters: int) -> int:
    """The samples ``train_iters`` iterations consume from the start."""
    consumed = iteration = 0
    while iteration < train_iters and consumed < steps.final_from:
        consumed += steps.size_at(consumed)
        iteration += 1
    return consumed + (train_iters - iteration) * steps.final


def check_flags(t) -> None:
    """TrainingConfig's rules of the two flags, Megatron-LM's: a ramp only in sample-based training
    (0.17's assert), one schedule at a time, no rounding down under either (megatron-core's step
    calculator refuses it)."""
    ramp, step = t.rampup_batch_size is not None, t.step_batch_size_schedule is not None
    if ramp:
        require(not step, f"{RAMPUP_FLAG} and {STEP_FLAG} cannot both be given")
        require(t.train_samples is not None, f"{RAMPUP_FLAG} needs --train-samples (Megatron-LM ramps the batch "
                                             "size only in sample-based training)")
        check_ramp(t.rampup_batch_size, t.global_batch_size or 0)
    require(not (t.decrease_batch_size_if_needed and (ramp or step)),
            f"--decrease-batch-size-if-needed cannot be combined with {RAMPUP_FLAG} or {STEP_FLAG} "
            "(megatron-core's step calculator refuses it)")


def check_sizes(cfg) -> None:
    """PretrainConfig's rules: --global-batch-size and every batch size a schedule reaches split
    into micro batches over the data-parallel replicas (megatron-core's consistency check, made
    before the run), and a step schedule ends at --global-batch-size."""
    t, dp = cfg.training, cfg.data_parallel_size
    unit = t.micro_batch_size * dp
    gbs = t.global_batch_size
    require(gbs is not None and (gbs % unit == 0 or (t.decrease_batch_size_if_needed and gbs >= unit)),
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size x data-parallel size "
            f"({t.micro_batch_size} x {dp})")
    steps = cfg.batch_size_steps
    if steps is not None and t.step_batch_size_schedule is not None:
        require(gbs == steps.final, f"--global-batch-size ({gbs}) must be the last batch size of {STEP_FLAG} "
                                    f"({steps.final}), or be left out")
    for iteration, consumed, size in cfg.batch_size_changes():
        require(size % unit == 0,
                f"{schedule_flag(t)} reaches global batch size {size} at iteration {iteration} ({consumed} samples "
                f"consumed), which --micro-batch-size x data-parallel size ({t.micro_batch_size} x {dp}) does not "
                "divide")


def schedule_flag(t) -> str:
    """The flag that makes the batch size change (for messages)."""
    return RAMPUP_FLAG if t.rampup_batch_size is not None else STEP_FLAG
