"""``--profile``: Megatron-LM's profiler hooks around the training loop.

With ``--use-pytorch-profiler``, torch.profiler runs from before the first iteration with
Megatron-LM's schedule (wait ``start - 1``, warm up 1, record ``end - start``), stepped at the
top of every iteration, so the trace holds ``ProfilerStep#start`` .. ``ProfilerStep#end-1``;
it is written as a Chrome trace to ``<--tensorboard-dir>/../torch_profile/rank-N.json.gz``.
Without it, ``cudaProfilerStart`` before iteration ``start + 1`` and ``cudaProfilerStop``
after iteration ``end`` bound the capture of ``nsys profile --capture-range=cudaProfilerApi``;
a CPU host has no Nsight capture and says so once. Only the ranks of ``--profile-ranks``
(all when none is given) profile.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_weipipe.logging_config import LoggingConfig
from megatron_weipipe.platform import Platform
from megatron_weipipe.training.console import print_rank_0


def trace_path(tensorboard_dir: str, rank: int) -> str:
    """Where Megatron-LM's trace handler writes rank ``rank``'s trace."""
    return os.path.join(os.path.dirname(os.path.abspath(tensorboard_dir)), "torch_profile", f"rank-{rank}.json.gz")


class StepProfiler:
    """The loop calls ``before_iteration(done)`` at the top of each iteration, ``after_iteration``
    once it is counted and ``close`` when training ends."""

    def __init__(self, log: LoggingConfig, platform: Platform, rank: int):
        self.log, self.platform, self.rank = log, platform, rank
        self.active = log.profile and (not log.profile_ranks or rank in log.profile_ranks)
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.nsight_running = False
        if self.active and log.use_pytorch_profiler:
            self.torch_profiler = self._start_torch_profiler()
        elif log.profile and not platform.is_cuda:
            print_rank_0("> --profile without --use-pytorch-profiler is Nsight's capture (cudaProfilerStart/Stop); "
                         "a CPU host has none: not profiling")
            self.active = False

    @classmethod
    def for_run(cls, log: LoggingConfig, platform: Platform) -> "StepProfiler":
        return cls(log, platform, dist.get_rank() if dist.is_initialized() else 0)

    def _start_torch_profiler(self) -> torch.profiler.profile:
        start, end = self.log.profile_step_start, self.log.profile_step_end
        path = trace_path(self.log.tensorboard_dir, self.rank)

        def write_trace(prof) -> None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            prof.export_chrome_trace(path)

        prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                             active=end - start, repeat=1),
            on_trace_ready=write_trace,
        )
        prof.start()
        return prof

    def before_iteration(self, done: int) -> None:
        """``done``: the iterations finished so far."""
        if not self.active:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif done == self.log.profile_step_start:
            torch.cuda.profiler.start()
            self.nsight_running = True

    def after_iteration(self, iteration: int) -> None:
        if self.active and iteration == self.log.profile_step_end:
            self.close()

    def close(self) -> None:
        """Stop (and write the trace) once; a run that ends before ``--profile-step-end`` stops here."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.nsight_running:
            torch.cuda.profiler.stop()
            self.nsight_running = False
        self.active = False
