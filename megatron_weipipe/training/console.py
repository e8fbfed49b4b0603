"""The run's console lines: every rank computes them, rank 0 prints them (Megatron's print_rank_0),
and the Python logging level the run's loggers (the package's, megatron-core's) log at."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from megatron_weipipe.errors import launcher_rank


def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def set_logging_level(level: Optional[int]) -> None:
    """Megatron-LM's ``--logging-level``: the root logger's level, from the flag, else from
    ``MEGATRON_LOGGING_LEVEL``; with neither the level stays as it is."""
    env = os.environ.get("MEGATRON_LOGGING_LEVEL")
    if level is None and env is not None:
        level = int(env)
    if level is None:
        return
    logging.getLogger().setLevel(level)
    if launcher_rank() == 0:
        logging.getLogger(__name__).info(f"Setting logging level to {level}")
