"""Megatron-LM's logging sinks in one two-rank pipeline run: Weights & Biases in its offline
mode (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``) holds the scalars of the
log line and of validation, the same set TensorBoard gets, with the run's flags as its config,
written by the last rank only; ``--log-validation-ppl-to-tensorboard`` adds the validation
perplexity; ``--logging-level 20`` lets megatron-core's INFO lines through. A second run
without those flags is the control. Without the ``wandb`` package the flag is one line."""

from __future__ import annotations

import math
import sys

import pytest

from harness import run_distributed
from harness.runs import tiny_gpt_args
from harness.wandb_records import offline_runs, read_run

BASE = dict(num_layers=2, pipeline_model_parallel_size=2, global_batch_size=4, train_iters=4, log_interval=2,
            eval_interval=2, eval_iters=1)
PROJECT, NAME = "weipipe-tests", "tiny-pp2"


def train_logged(rank: int, world_size: int, argvs: list[list[str]]) -> list[dict]:
    """Each run's log-line fields (iteration, loss, lr) and the INFO records logged on this rank."""
    import logging

    from megatron.core import parallel_state

    import pretrain_gpt
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno == logging.INFO:
                infos.append((record.name, record.getMessage()))

    out = []
    for args in argvs:
        logging.getLogger().setLevel(logging.WARNING)  # as a fresh process starts (cli.run_main)
        infos, logs, handler = [], [], Collect(level=logging.INFO)
        logging.getLogger().addHandler(handler)

        def on_log(stats):
            logs.append(dict(iteration=stats["iteration"], loss=stats["losses"]["lm loss"], lr=stats["lr"]))

        try:
            pretrain(parse_config(args, world_size=world_size), pretrain_gpt.model_provider, forward_step,
                     on_log=on_log)
        finally:
            logging.getLogger().removeHandler(handler)
        parallel_state.destroy_model_parallel()
        out.append(dict(logs=logs, infos=infos))
    return out


def _tensorboard(path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb")
    cache = str(tmp / "wandb-home")
    logged = tiny_gpt_args(**BASE, tensorboard_dir=str(tmp / "tb-logged"), wandb_project=PROJECT,
                           wandb_exp_name=NAME, wandb_save_dir=str(tmp / "w"), log_validation_ppl_to_tensorboard=True,
                           logging_level=20)
    plain = tiny_gpt_args(**BASE, tensorboard_dir=str(tmp / "tb-plain"))
    env = dict(WANDB_MODE="offline", WANDB_CONFIG_DIR=cache, WANDB_CACHE_DIR=cache, WANDB_DATA_DIR=cache)
    per_rank = run_distributed(train_logged, 2, [logged, plain], timeout=600, env=env)
    return tmp, per_rank


def test_wandb_offline_run_holds_the_logged_scalars_and_the_config(runs):
    tmp, per_rank = runs
    [run_dir] = offline_runs(str(tmp / "w"))  # one run: only the last of the two ranks writes
    run = read_run(run_dir)
    assert run["run"]["project"] == PROJECT and run["run"]["name"] == NAME
    config = run["config"]
    assert (config["hidden_size"], config["pipeline_model_parallel_size"], config["world_size"]) == (32, 2, 2)
    assert config["wandb_project"] == PROJECT and config["train_iters"] == 4
    history, logs = run["history"], per_rank[1][0]["logs"]
    assert sorted(history) == [l["iteration"] for l in logs] == [2, 4]
    for l in logs:  # the log line's values, as Python floats: exact
        assert (history[l["iteration"]]["lm-loss"], history[l["iteration"]]["learning-rate"]) == (l["loss"], l["lr"])
    tensorboard = _tensorboard(tmp / "tb-logged")
    logged = {k for row in history.values() for k in row if not k.startswith("_")}
    assert logged == set(tensorboard), "W&B and TensorBoard get the same scalars"
    for tag, values in tensorboard.items():
        assert {s: history[s][tag] for s in values} == pytest.approx(values, rel=1e-6), tag  # TensorBoard: float32


def test_validation_ppl_is_written_only_with_the_flag(runs):
    tmp, _ = runs
    logged, plain = _tensorboard(tmp / "tb-logged"), _tensorboard(tmp / "tb-plain")
    assert sorted(logged["lm-loss-validation-ppl"]) == [2, 4]
    for step, loss in logged["lm-loss-validation"].items():
        assert logged["lm-loss-validation-ppl"][step] == pytest.approx(math.exp(min(20.0, loss)), rel=1e-6)
    assert "lm-loss-validation" in plain and "lm-loss-validation-ppl" not in plain
    assert plain["lm-loss"] == logged["lm-loss"]  # the flags change what is written, not the run


def test_logging_level_lets_info_records_through(runs):
    _, per_rank = runs
    logged, plain = per_rank[0][0]["infos"], per_rank[0][1]["infos"]
    assert ("megatron_weipipe.training.console", "Setting logging level to 20") in logged
    assert any(name.startswith("megatron.core.datasets") for name, _ in logged), logged[:5]
    assert plain == []  # the default level (WARNING) lets none through


def test_wandb_writer_defaults_to_the_save_dir_and_passes_the_entity(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from megatron_weipipe.logging_config import LoggingConfig
    from megatron_weipipe.training.writers import WandbWriter

    seen = {}
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: seen.update(kw)))
    WandbWriter(LoggingConfig(wandb_project="p", wandb_entity="team"), str(tmp_path / "ckpt"), {"lr": 0.1})
    assert seen == dict(project="p", name=None, config={"lr": 0.1}, dir=str(tmp_path / "ckpt" / "wandb"),
                        entity="team")
    assert (tmp_path / "ckpt" / "wandb").is_dir()


def test_without_the_wandb_package_the_flag_is_one_line(monkeypatch, capsys):
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.cli import run_main

    argv = tiny_gpt_args(wandb_project="p")
    parse_config(argv)  # wandb installed: accepted
    capsys.readouterr()  # what importing the trainer printed (torch's notices on some releases)
    monkeypatch.setitem(sys.modules, "wandb", None)  # hidden: import wandb fails, find_spec finds nothing
    assert run_main(argv, None, None) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --wandb-project needs the 'wandb' package: pip install wandb (or megatron-weipipe[wandb])"]
