"""Where the run's scalars go: TensorBoard and Weights & Biases, behind one interface.

Megatron-LM writes its scalars to TensorBoard and the same ones to W&B, from the last rank.
Here every ``scalars(step, values)`` call (the log line's, validation's) reaches each writer
the flags asked for through ``ScalarWriters``, so a new figure is logged once and lands in
both. The ``wandb`` package is imported only with ``--wandb-project`` (the configuration
refuses the flag at start-up, with the package to install, when it is missing).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Protocol

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.logging_config import LoggingConfig


class ScalarWriter(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars as TensorBoard events under ``--tensorboard-dir``."""

    def __init__(self, log_dir: str):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)
        except Exception as e:  # tensorboard not installed
            print(f"WARNING: --tensorboard-dir given but TensorBoard is unavailable ({e})", flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class WandbWriter:
    """One W&B run (Megatron-LM's ``wandb.init``: project, name, entity, the run's arguments as
    its config, files under ``--wandb-save-dir`` or ``<--save>/wandb``); each call is one
    ``log`` at the iteration as W&B's step."""

    def __init__(self, log: LoggingConfig, save: Optional[str], config: dict):
        import wandb

        kwargs = dict(project=log.wandb_project, name=log.wandb_exp_name, config=config)
        save_dir = log.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
            kwargs["dir"] = save_dir
        if log.wandb_entity:
            kwargs["entity"] = log.wandb_entity
        self.run = wandb.init(**kwargs)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class ScalarWriters:
    """Every writer of this rank, written and closed together (none: every call is a no-op)."""

    def __init__(self, writers: Iterable[ScalarWriter] = ()):
        self.writers = list(writers)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for writer in self.writers:
            writer.scalars(step, values)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def build_writers(cfg: PretrainConfig, rank: int, world_size: int) -> ScalarWriters:
    """The writers the flags ask for, on the last rank only (Megatron-LM's rule)."""
    if rank != world_size - 1:
        return ScalarWriters()
    log = cfg.logging
    writers: list[ScalarWriter] = []
    if log.tensorboard_dir:
        writers.append(TensorBoardWriter(log.tensorboard_dir))
    if log.wandb_project:
        writers.append(WandbWriter(log, cfg.checkpoint.save, run_arguments(cfg)))
    return ScalarWriters(writers)


def run_arguments(cfg: PretrainConfig) -> dict:
    """The run's settings by field name, one flat mapping as Megatron-LM's ``vars(args)``
    (a name two sections share holds the same derived value: the first is kept)."""
    flat: dict = {"world_size": cfg.world_size, "slurm_job_name": os.environ.get("SLURM_JOB_NAME", "N/A")}
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            for key, item in dataclasses.asdict(value).items():
                flat.setdefault(key, item)
    return flat
