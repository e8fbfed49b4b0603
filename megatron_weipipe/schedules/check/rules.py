"""Start-up rules of every schedule: flag combinations it cannot run.

Each rule is ``(cfg, name) -> None`` and raises ConfigError with one sentence naming the
flag. They read only ``cfg.parallel``, ``cfg.num_microbatches``, ``cfg.fp8.enabled`` and the
batch sizes a --rampup-batch-size or --step-batch-size-schedule reaches (``_reached``) of a
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


def _reached(cfg: "PretrainConfig") -> list[tuple[str, int]]:
    """(what it is, microbatches per replica) of every iteration size the run reaches that
    differs from --global-batch-size's: a batch-size schedule's, from the start or the
    checkpoint loaded on (PretrainConfig.batch_size_changes)."""
    from megatron_weipipe.batch_sizes import schedule_flag

    unit = cfg.training.micro_batch_size * cfg.data_parallel_size
    flag = schedule_flag(cfg.training)
    return [(f"{flag} reaches global batch size {size} at iteration {iteration}", size // unit)
            for iteration, _, size in cfg.batch_size_changes() if size // unit != cfg.num_microbatches]


def _check_multiple(cfg: "PretrainConfig", what: str, P: int) -> None:
    """Each iteration's microbatches per replica a multiple of P (interleaved 1F1B, WeiPipe's ring)."""
    for reached, n in _reached(cfg):
        if n % P != 0:
            _refuse(f"{what} needs the number of microbatches per replica to be a multiple of "
                    f"--pipeline-model-parallel-size ({P}); {reached}: {n} microbatches per replica")


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
    _check_multiple(cfg, f"--pipeline-schedule {name}", pp)


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
    _check_multiple(cfg, f"{flag} (G = microbatches / ring size)", P)
