"""--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler, as in Megatron-LM:
without either, a --load whose learning-rate schedule differs from the checkpoint's stops
with one line naming both flags; with the first the checkpoint's schedule is kept, with the
second the flags' is taken. The scheduler is megatron-core's (training/optimizer.py)."""

from __future__ import annotations

import pytest
import torch
from harness.runs import tiny_gpt_args

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError
from megatron_weipipe.training.optimizer import ScheduleMismatch, build_scheduler


def _scheduler(*extra):
    cfg = parse_config(tiny_gpt_args() + list(extra))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return build_scheduler(cfg, optimizer), optimizer


def _saved(*extra) -> dict:
    scheduler, _ = _scheduler(*extra)
    scheduler.step(increment=8)
    return scheduler.state_dict()


def test_a_changed_schedule_stops_the_load_with_one_line_naming_both_flags():
    state = _saved("--lr", "1e-3")
    scheduler, _ = _scheduler("--lr", "2e-3")
    with pytest.raises(ScheduleMismatch) as e:
        scheduler.load_state_dict(state)
    line = str(e.value)
    assert "learning rate is 0.001 but these flags give 0.002" in line and "\n" not in line
    assert "--use-checkpoint-opt_param-scheduler" in line and "--override-opt_param-scheduler" in line
    same, _ = _scheduler("--lr", "1e-3")
    same.load_state_dict(state)  # an unchanged schedule loads as before


@pytest.mark.parametrize("flag, kept_lr", [("--use-checkpoint-opt_param-scheduler", 1e-3),
                                           ("--override-opt_param-scheduler", 2e-3)])
def test_either_flag_settles_which_schedule_runs(flag, kept_lr):
    state = _saved("--lr", "1e-3")
    scheduler, optimizer = _scheduler("--lr", "2e-3", flag)
    scheduler.load_state_dict(state)
    assert scheduler.max_lr == kept_lr and scheduler.num_steps == 8  # the position is the checkpoint's
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.get_lr(optimizer.param_groups[0]))


def test_the_two_flags_exclude_each_other():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        parse_config(tiny_gpt_args() + ["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"])


def test_a_run_extended_with_its_decay_length_fixed_resumes():
    """A longer --train-iters moves only the weight-decay ramp's length, which a constant weight
    decay never reads: the load goes on. Where the decay ramps it is compared as in Megatron-LM."""
    state = _saved("--train-iters", "3", "--lr-decay-iters", "6")
    longer, _ = _scheduler("--train-iters", "6", "--lr-decay-iters", "6")
    longer.load_state_dict(state)
    assert longer.num_steps == 8 and longer.lr_decay_steps == state["lr_decay_steps"]
    ramped, _ = _scheduler("--train-iters", "6", "--lr-decay-iters", "6")
    ramped.start_wd, ramped.end_wd, ramped.wd_incr_style = 0.0, 0.1, "linear"
    with pytest.raises(ScheduleMismatch, match="weight decay iterations"):
        ramped.load_state_dict({**state, "start_wd": 0.0, "end_wd": 0.1, "wd_incr_style": "linear"})
