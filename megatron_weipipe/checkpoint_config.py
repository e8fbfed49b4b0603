"""The checkpoint flags: where to save and load, how often, in which format and how.

Part of the typed run configuration (megatron_weipipe/config.py composes it into
``PretrainConfig``); plain Python, like the rest of the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option


@dataclass
class CheckpointConfig:
    save: Optional[str] = option(None, help="directory to save checkpoints to")
    load: Optional[str] = option(None, help="directory to resume from")
    save_interval: Optional[int] = option(None, help="steps between checkpoints")
    no_load_optim: bool = option(False, help="do not load the optimizer state")
    no_load_rng: bool = option(False, help="do not load the RNG state")
    finetune: bool = option(False, help="load weights only and start at step 0")
    ckpt_format: str = option("torch_dist", help="torch_dist (megatron-core dist_checkpointing)")
    dist_ckpt_optim_fully_reshardable: bool = option(
        False, help="save the distributed optimizer's state in parameter shapes (fully_reshardable): it then loads "
                    "under other TP/PP/CP layouts and schedules and without --use-distributed-optimizer; the "
                    "default (dp_reshardable) reshards only across data-parallel ranks")
    async_save: bool = option(
        False, help="write checkpoints in the background (megatron-core's asynchronous dist_checkpointing): "
                    "training goes on while a forked writer saves; the tracker moves to a checkpoint only "
                    "once every rank has written it, and the next save and every exit wait for it")
    ckpt_fully_parallel_load: bool = option(
        False, help="torch_dist loads: each replicated shard is read by one rank of the data x context "
                    "parallel group and sent to the others (megatron-core's FullyParallelLoadStrategyWrapper)")

    def validate(self) -> None:
        require(self.ckpt_format == "torch_dist", "--ckpt-format must be torch_dist")
        require(self.save_interval is None or self.save_interval > 0, "--save-interval must be positive")
        require(self.save_interval is None or self.save is not None, "--save-interval needs --save DIR")
