"""Megatron-compatible command-line flags, generated from the typed configs.

Flag names follow Megatron-LM so that existing launch scripts carry over. The flags are
the ``option`` fields of the config dataclasses (``megatron_weipipe.flags``); parsing
fills in derived defaults, then every rule is checked once: the configs' own, the
schedule's, and the data files'.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from typing import Optional, Sequence

from megatron_weipipe.errors import launcher_rank
from megatron_weipipe.checkpoint_config import CheckpointConfig
from megatron_weipipe.config import ConfigError, PretrainConfig, TrainingConfig
from megatron_weipipe.logging_config import LoggingConfig
from megatron_weipipe.model_config import ModelConfig
from megatron_weipipe.parallel_config import ParallelConfig
from megatron_weipipe.data.config import DataConfig
from megatron_weipipe.flags import FlagParser, add_flags, from_args
from megatron_weipipe.fp8_config import FP8Config
from megatron_weipipe.fpdt.config import FPDTConfig
from megatron_weipipe.megatron_compat import MegatronCompatConfig
from megatron_weipipe.offload_config import OffloadConfig

log = logging.getLogger(__name__)
SEQUENCE_PARALLEL_OFF = ("warning: disabling --sequence-parallel because --tensor-model-parallel-size is 1 "
                         "(as Megatron-LM does)")
OVERLAP_P2P_OFF = ("warning: disabling --overlap-p2p-comm because there are no virtual pipeline stages (as "
                   "Megatron-LM does: only the interleaved schedule overlaps its point-to-point communication)")
RESET_ATTENTION_MASK_OFF = ("warning: --reset-attention-mask has no effect with "
                            "--no-create-attention-mask-in-dataloader: documents in a sample attend to each other "
                            "(as in Megatron-LM)")
TIKTOKEN_SPECIAL_TOKENS_DEPRECATED = ("warning: --tiktoken-special-tokens is deprecated, use "
                                      "--tokenizer-special-tokens (as Megatron-LM says)")

# (PretrainConfig field, its dataclass, argument-group title), in --help order.
SECTIONS = (
    ("model", ModelConfig, "model"),
    ("parallel", ParallelConfig, "parallelism"),
    ("fpdt", FPDTConfig, "FPDT (chunked Ulysses attention)"),
    ("training", TrainingConfig, "training"),
    ("fp8", FP8Config, "FP8 (Transformer Engine)"),
    ("offload", OffloadConfig, "optimizer offload (model state in host memory)"),
    ("data", DataConfig, "data"),
    ("checkpoint", CheckpointConfig, "checkpointing"),
    ("logging", LoggingConfig, "logging"),
    ("megatron", MegatronCompatConfig, "Megatron-LM compatibility (docs/reference/flags.md)"),
)


def add_pretrain_flags(parser: argparse.ArgumentParser, *, require: bool = True) -> None:
    """Every pretrain_gpt.py flag, one argument group per config section."""
    for section, cls, title in SECTIONS:
        add_flags(parser, cls, section, title=title, require=require)


def build_parser() -> argparse.ArgumentParser:
    from megatron_weipipe.schedules import registry

    p = FlagParser(
        prog="pretrain_gpt.py",
        description="Megatron-style GPT pretraining with WeiPipe and FPDT schedules.",
        epilog=f"pipeline schedules: {', '.join(registry.names())}",
        allow_abbrev=False,
    )
    add_pretrain_flags(p)
    return p


def config_from_args(args: argparse.Namespace, world_size: Optional[int] = None) -> PretrainConfig:
    """The typed config as the flags give it (no derived defaults, no validation)."""
    parts = {}
    for section, cls, _ in SECTIONS:
        extra = {"seq_length": getattr(args, "model.seq_length")} if cls is DataConfig else {}
        parts[section] = from_args(args, cls, section, **extra)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return PretrainConfig(**parts, world_size=world_size)


def resolve_defaults(cfg: PretrainConfig) -> PretrainConfig:
    """``cfg`` with the defaults that depend on other flags filled in (the schedule among them).

    A flag Megatron-LM turns off where it cannot apply is turned off here too, with its
    one-line warning printed by rank 0 (every rank resolves the same flags)."""
    from megatron_weipipe.schedules import registry

    resolved = cfg.with_derived_defaults(registry.schedule_name(cfg))
    if launcher_rank() == 0:
        for name, line in (("sequence_parallel", SEQUENCE_PARALLEL_OFF), ("overlap_p2p_comm", OVERLAP_P2P_OFF)):
            if getattr(cfg.parallel, name) and not getattr(resolved.parallel, name):
                log.warning(line)
        if cfg.data.reset_attention_mask and not resolved.data.reset_attention_mask:
            log.warning(RESET_ATTENTION_MASK_OFF)
        if cfg.data.tiktoken_special_tokens:
            log.warning(TIKTOKEN_SPECIAL_TOKENS_DEPRECATED)
    return resolved


def check_config(cfg: PretrainConfig, *, check_data: bool = True) -> None:
    """Every start-up rule: the configs', the schedule's and (optionally) the data files'."""
    from megatron_weipipe.schedules import registry

    cfg.validate()
    registry.check_config(cfg)
    if check_data:
        try:
            cfg.data.validate()
        except ConfigError:
            raise
        except ValueError as e:  # missing or corrupt data files: same one-line treatment
            raise ConfigError(str(e)) from e


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """One parser for every parse_config call (a parse does not change it; building one is
    most of a parse's time, which tools/plan.py pays once per layout it asks about)."""
    return build_parser()


def parse_config(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> PretrainConfig:
    """Parse, resolve and validate; raises ConfigError (one sentence) on anything that cannot work."""
    args = _parser().parse_args(argv)
    cfg = resolve_defaults(config_from_args(args, world_size))
    cfg.training.require_run_length()
    check_config(cfg)
    return cfg
