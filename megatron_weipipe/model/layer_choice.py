"""Which layer implementation a run builds: Transformer Engine or megatron-core's local layers.

The one place that decides it. Paths that are believed to work on a GPU but have not yet
passed there (``tools/gpu_acceptance.sh``, docs/reference/gpu-readiness.md "unverified on GPU")
fall back to local layers with a one-line notice, unless the run passes
``--allow-unverified-gpu-paths``. The platform is passed in, so tests decide for a faked
CUDA + TE host on a CPU machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.platform import Platform

log = logging.getLogger(__name__)
_announced: set = set()

ALLOW_FLAG = "--allow-unverified-gpu-paths"

# The unverified paths, by name (docs/reference/gpu-readiness.md lists the same names).
WEIPIPE_TE = "WeiPipe over Transformer Engine modules through functional_call"
DROPOUT_REPLAY_TE = "dropout replay with separate CUDA RNG streams (Transformer Engine layers)"


@dataclass(frozen=True)
class LayerChoice:
    transformer_engine: bool  # build TE layers (else megatron-core's local spec)
    notices: tuple = field(default=())  # one line per unverified path that was avoided


def _weipipe(cfg: PretrainConfig) -> bool:
    """Every WeiPipe schedule is named weipipe-* (the registry; tests/test_gpu_fallbacks.py
    pins it): WeiPipe runs each decoder chunk through functional_call on circulating weights."""
    return (cfg.parallel.pipeline_schedule or "").startswith("weipipe")


def _replays_dropout(cfg: PretrainConfig) -> bool:
    """WeiPipe's runtime recomputes a chunk's forward from RNG snapshots (RNGStreams) under
    full recomputation; with dropout on, the replayed masks must equal the original ones."""
    m = cfg.model
    return _weipipe(cfg) and m.recompute_granularity == "full" and (m.hidden_dropout > 0 or m.attention_dropout > 0)


def _wants_transformer_engine(cfg: PretrainConfig, platform: Platform) -> bool:
    impl = cfg.model.transformer_impl
    local_attention = cfg.model.attention_backend == "local"
    return impl == "transformer_engine" or (impl == "auto" and platform.transformer_engine_available()
                                            and not local_attention)


def check_host(cfg: PretrainConfig, platform: Platform) -> None:
    """The rules that depend on the host, not only on the flags: raises ConfigError with one
    line. The entry point runs them before any process group exists (cli.run_main); building
    the model runs them again for callers of pretrain()."""
    impl = cfg.model.transformer_impl
    if impl == "transformer_engine" and not platform.transformer_engine_available():
        raise ConfigError("--transformer-impl transformer_engine needs transformer-engine and a GPU")
    if impl == "transformer_engine" and cfg.model.attention_backend == "local":
        raise ConfigError("--attention-backend local needs local layers: use --transformer-impl local")
    backend = cfg.parallel.distributed_backend or platform.backend
    if cfg.parallel.use_nccl_ub and backend != "nccl":
        raise ConfigError(f"--use-nccl-ub registers NCCL user buffers; this run's backend is {backend}")
    if cfg.parallel.megatron_context_parallel and not _wants_transformer_engine(cfg, platform):
        kind = next(t for t in cfg.parallel.cp_comm_type if t != "a2a")
        raise ConfigError(f"--cp-comm-type {kind} is megatron-core's context parallelism, which runs inside Transformer "
                          "Engine's attention on a GPU; this host builds megatron-core's local layers (--cp-comm-type "
                          "a2a, this package's Ulysses/FPDT, runs on every host)")
    problem = cfg.offload.host_problem(platform.transformer_engine_available())
    if problem is not None:
        raise ConfigError(problem)
    if cfg.fp8.enabled:
        problem = cfg.fp8.host_problem(_wants_transformer_engine(cfg, platform), platform.compute_capability())
        if problem is not None:
            raise ConfigError(problem)


def choose_layers(cfg: PretrainConfig, platform: Platform) -> LayerChoice:
    """TE when asked for (or ``auto`` and available), unless an unverified path would use it.
    ``--attention-backend local`` is megatron-core's own attention, so local layers (as
    Megatron-LM asks for ``--spec local`` with it)."""
    check_host(cfg, platform)
    wanted = _wants_transformer_engine(cfg, platform)
    if not wanted or cfg.model.allow_unverified_gpu_paths:
        return LayerChoice(wanted)
    unverified = [path for path, applies in ((WEIPIPE_TE, _weipipe(cfg)), (DROPOUT_REPLAY_TE, _replays_dropout(cfg)))
                  if applies]
    if not unverified:
        return LayerChoice(True)
    notices = tuple(f"notice: {path} is unverified on GPU; using local layers ({ALLOW_FLAG} keeps Transformer Engine)"
                    for path in unverified)
    return LayerChoice(False, notices)


def announce(choice: LayerChoice) -> None:
    """Log each notice once per process (every stage builds a model)."""
    for line in choice.notices:
        if line not in _announced:
            _announced.add(line)
            log.warning(line)
