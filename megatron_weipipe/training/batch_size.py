"""The global batch size of each iteration: megatron-core's microbatch calculator, driven as
Megatron-LM's training loop drives it.

At a fixed batch size: megatron-core's ConstantNumMicroBatchesCalculator (which rounds down
under --decrease-batch-size-if-needed). --rampup-batch-size: megatron-core's ramp calculator
where the release has one (0.16, 0.17), else its step calculator over the ramp's exact steps
(batch_sizes.ramp_steps). --step-batch-size-schedule: megatron-core's step calculator where
the release has one (0.18 on; it reads Megatron-LM's text itself), else ``StepsCalculator``,
a subclass of megatron-core's calculator base reading the steps start-up parsed.
"""

from __future__ import annotations

from megatron.core.num_microbatches_calculator import NumMicroBatchesCalculator

from megatron_weipipe import mcore_versions
from megatron_weipipe.batch_sizes import Steps
from megatron_weipipe.config import PretrainConfig


class StepsCalculator(NumMicroBatchesCalculator):
    """A step schedule where megatron-core has no step calculator: the batch size of the last
    step begun, megatron-core's consistency check, no rounding down (as megatron-core's own)."""

    def __init__(self, steps: Steps, micro_batch_size: int, data_parallel_size: int):
        super().__init__()
        self.steps = steps
        self.micro_batch_size = micro_batch_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        size = self.steps.size_at(consumed_samples)
        unit = self.micro_batch_times_data_parallel_size
        assert not consistency_check or size % unit == 0, (
            f"current global batch size ({size}) is not divisible by micro batch size x data parallel size ({unit})")
        self.current_global_batch_size = self.current_running_global_batch_size = size
        self.num_micro_batches = size // unit


def build_calculator(cfg: PretrainConfig, rank: int) -> NumMicroBatchesCalculator:
    """This run's calculator, from megatron-core where the release has the kind."""
    t = cfg.training
    common = dict(micro_batch_size=t.micro_batch_size, data_parallel_size=cfg.data_parallel_size,
                  decrease_batch_size_if_needed=t.decrease_batch_size_if_needed, rank=rank)
    steps = cfg.batch_size_steps
    if steps is None:
        return mcore_versions.microbatch_calculator_class("Constant")(global_batch_size=t.global_batch_size, **common)
    ramp_calculator = mcore_versions.microbatch_calculator_class("Rampup")
    if t.rampup_batch_size is not None and ramp_calculator is not None:
        start, increment, samples = t.rampup_batch_size
        return ramp_calculator(global_batch_size=t.global_batch_size, start_global_batch_size=start,
                               batch_size_increment=increment, ramup_samples=samples, **common)
    step_calculator = mcore_versions.microbatch_calculator_class("Step")
    if step_calculator is None:
        return StepsCalculator(steps, t.micro_batch_size, cfg.data_parallel_size)
    if t.rampup_batch_size is not None:  # the ramp's steps, thresholds in samples
        return step_calculator(schedule=steps.as_schedule(), seq_length=None, **common)
    return step_calculator(schedule=t.step_batch_size_schedule, seq_length=cfg.model.seq_length, **common)


class BatchSizes:
    """The calculator of one run and the figures the loop reads from it each iteration."""

    def __init__(self, cfg: PretrainConfig, rank: int):
        self.calculator = build_calculator(cfg, rank)
        self.unit = cfg.training.micro_batch_size * cfg.data_parallel_size

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Megatron-LM's update_num_microbatches: the batch size for the samples consumed so far."""
        self.calculator.update(consumed_samples, consistency_check, verbose=False)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel replica in this iteration."""
        return self.calculator.get()

    @property
    def global_batch_size(self) -> int:
        """The samples this iteration trains (megatron-core's running global batch size: the
        current one, rounded down under --decrease-batch-size-if-needed)."""
        return self.num_microbatches * self.unit
