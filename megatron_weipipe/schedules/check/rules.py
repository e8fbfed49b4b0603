"""Start-up rules of every schedule: flag combinations it cannot run.

Each rule is ``(cfg, name) -> None`` and raises ConfigError with one sentence naming the
flag. They read only ``cfg.parallel``, ``cfg.num_microbatches`` and ``cfg.fp8.enabled`` of a
PretrainConfig, so the start-up validation and the simulator run them without torch or a
model (ConfigError is imported only to be raised). registry.py names the rule of each
schedule; the TrainSchedule classes reach them through registry.check_config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from megatron_weipipe.config import PretrainConfig


def _refuse(message: str) -> NoReturn:
    from megatron_weipipe.config import ConfigError

    raise ConfigError(message)


def check_no_pipelining(cfg: "PretrainConfig", name: str) -> None:
    if cfg.parallel.pipeline_model_parallel_size != 1:
        _refuse(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size 1")


def check_1f1b(cfg: "PretrainConfig", name: str) -> None:
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        _refuse(
            f"--pipeline-schedule {name} does not take --num-layers-per-virtual-pipeline-stage; "
            "use --pipeline-schedule interleaved"
        )


def check_interleaved(cfg: "PretrainConfig", name: str) -> None:
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is None:
        _refuse(f"--pipeline-schedule {name} needs --num-layers-per-virtual-pipeline-stage")
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.num_microbatches % pp != 0:
        _refuse(
            f"--pipeline-schedule {name} needs the number of microbatches per replica "
            f"({cfg.num_microbatches}) to be a multiple of --pipeline-model-parallel-size ({pp})"
        )


def check_weipipe(cfg: "PretrainConfig", name: str) -> None:
    """Every WeiPipe variant: a ring of at least 2, one chunk per ring rank, G = N / P."""
    p, flag = cfg.parallel, f"--pipeline-schedule {name}"
    P = p.pipeline_model_parallel_size
    if P < 2:
        _refuse(f"{flag} needs --pipeline-model-parallel-size >= 2 (the size of the weight ring)")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        _refuse(f"{flag} does not take --num-layers-per-virtual-pipeline-stage (one chunk per ring rank)")
    if p.overlap_param_gather:
        _refuse(f"{flag} cannot be combined with --overlap-param-gather: the ring sends the owned chunk's updated "
                "weights when the iteration starts, before any forward a deferred all-gather could overlap")
    if cfg.parallel.megatron_context_parallel:
        _refuse(f"{flag} cannot run --cp-comm-type {' '.join(cfg.parallel.cp_comm_type)} (megatron-core's context "
                "parallelism runs in Transformer Engine's attention; the ring runs local layers): use --cp-comm-type "
                "a2a")
    if cfg.fp8.enabled:
        _refuse(f"{flag} cannot run --fp8-format (the ring runs megatron-core's local layers, which have no FP8 "
                "GEMMs); use --pipeline-schedule 1f1b")
    if cfg.num_microbatches % P != 0:
        _refuse(
            f"{flag} needs the number of microbatches per replica (--global-batch-size / (--micro-batch-size x "
            f"data-parallel size) = {cfg.num_microbatches}) to be a multiple of --pipeline-model-parallel-size ({P})"
        )
