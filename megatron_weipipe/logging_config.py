"""The logging flags: the log line, TensorBoard and W&B, traces and the profiler.

Part of the typed run configuration (megatron_weipipe/config.py composes it into
``PretrainConfig``); plain Python, like the rest of the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option


@dataclass
class LoggingConfig:
    log_interval: int = option(100, help="steps between log lines")
    tensorboard_dir: Optional[str] = option(None, help="write TensorBoard scalars here")
    log_throughput: bool = option(True, help="log tokens/s and TFLOP/s (always on)")
    timing_log_level: int = option(0, help="accepted for Megatron compatibility")
    schedule_trace: Optional[str] = option(
        None, help="write per-rank Chrome trace JSON of every schedule action here (rank{N}.json)")
    log_params_norm: bool = option(False, help="log the L2 norm of all parameters at each log line "
                                   "(params norm:, TensorBoard params-norm)")
    log_num_zeros_in_grad: bool = option(False, help="log the number of zero gradient entries at each log "
                                         "line (num zeros:, TensorBoard num-zeros)")
    log_memory_to_tensorboard: bool = option(False, help="write memory figures to TensorBoard (CUDA: "
                                             "mem-reserved/allocated/max-allocated-bytes, mem-allocated-count; "
                                             "CPU: mem-peak-rss-bytes)")
    log_timers_to_tensorboard: bool = option(False, help="write iteration-time (s) and throughput "
                                             "(TFLOP/s/GPU) to TensorBoard")
    profile: bool = option(False, help="profile the iterations from --profile-step-start to --profile-step-end: "
                           "torch.profiler with --use-pytorch-profiler, else cudaProfilerStart/Stop for nsys "
                           "--capture-range=cudaProfilerApi (a notice on a CPU host)")
    use_pytorch_profiler: bool = option(False, help="--profile with torch.profiler; the Chrome trace goes to "
                                        "<--tensorboard-dir>/../torch_profile/rank-N.json.gz")
    profile_step_start: int = option(10, help="the iteration --profile starts at")
    profile_step_end: int = option(12, help="the iteration --profile stops at")
    profile_ranks: list[int] = option(help="the global ranks --profile profiles (none given: all)",
                                      default_factory=list)
    log_validation_ppl_to_tensorboard: bool = option(False, help="write the validation perplexity "
                                                     "(lm-loss-validation-ppl) next to the validation loss")
    wandb_project: Optional[str] = option(None, help="log the TensorBoard scalars to this Weights & Biases project "
                                          "too, from the last rank, the run's flags as its config (needs wandb)")
    wandb_exp_name: Optional[str] = option(None, help="the W&B run's name (default: W&B picks one)")
    wandb_save_dir: Optional[str] = option(None, help="where W&B writes its run files (default: <--save>/wandb, "
                                           "without --save W&B's own ./wandb)")
    wandb_entity: Optional[str] = option(None, help="the W&B entity (team or user) the project belongs to")
    logging_level: Optional[int] = option(None, help="the Python logging level of the run (10 DEBUG, 20 INFO, "
                                          "30 WARNING, 40 ERROR); default: MEGATRON_LOGGING_LEVEL, else unchanged")

    def validate(self) -> None:
        require(self.log_interval > 0, "--log-interval must be positive")
        if self.schedule_trace is not None:
            import os.path

            require(self.schedule_trace != "" and not os.path.isfile(self.schedule_trace),
                    f"--schedule-trace must name a directory, not {self.schedule_trace!r}")
        if self.profile:
            require(0 <= self.profile_step_start < self.profile_step_end,
                    "--profile needs 0 <= --profile-step-start < --profile-step-end")
            require(not self.use_pytorch_profiler or self.tensorboard_dir is not None,
                    "--use-pytorch-profiler writes its trace next to --tensorboard-dir; give --tensorboard-dir")
        if self.wandb_project:  # an empty project is off, as in Megatron-LM
            import importlib.util

            require(self.wandb_exp_name != "", "--wandb-exp-name must not be empty (as in Megatron-LM)")
            require(importlib.util.find_spec("wandb") is not None,
                    "--wandb-project needs the 'wandb' package: pip install wandb (or megatron-weipipe[wandb])")
