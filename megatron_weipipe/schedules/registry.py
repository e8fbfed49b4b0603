"""Pipeline schedules by name, selected with --pipeline-schedule.

A new schedule is one module defining a TrainSchedule subclass plus one line here.
Entries are import paths so that building the table imports nothing heavy.
"""

from __future__ import annotations

import importlib

from megatron_weipipe.config import ConfigError, PretrainConfig

_SCHEDULES: dict[str, str] = {
    "none": "megatron_weipipe.schedules.megatron_schedules:NoPipelining",
    "1f1b": "megatron_weipipe.schedules.megatron_schedules:OneFOneB",
    "interleaved": "megatron_weipipe.schedules.megatron_schedules:Interleaved",
    "weipipe-naive": "megatron_weipipe.schedules.weipipe_train:WeiPipeNaive",
    "weipipe-interleave": "megatron_weipipe.schedules.weipipe_train:WeiPipeInterleave",
    "weipipe-zb": "megatron_weipipe.schedules.weipipe_train:WeiPipeZeroBubble",
}


def register_schedule(name: str, target: str) -> None:
    """Add a schedule under ``name``; ``target`` is 'package.module:ClassName'."""
    _SCHEDULES[name] = target


def schedule_names() -> list[str]:
    return sorted(_SCHEDULES)


def get_schedule(name: str):
    if name not in _SCHEDULES:
        raise ConfigError(
            f"--pipeline-schedule {name!r} is unknown; choose one of: {', '.join(schedule_names())}"
        )
    module_name, cls_name = _SCHEDULES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def default_schedule_name(cfg: PretrainConfig) -> str:
    if cfg.parallel.pipeline_model_parallel_size == 1:
        return "none"
    if cfg.parallel.num_layers_per_virtual_pipeline_stage is not None:
        return "interleaved"
    return "1f1b"
