"""Bad input: one clear line on stderr and a non-zero exit, before any process group can hang."""

import os
import subprocess
import sys

import pytest

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.config import ConfigError
from harness.runs import REPO_ROOT, SAMPLE_DATA, tiny_gpt_args


def _cli(argv, world_size=1, timeout=120):
    env = dict(os.environ, WORLD_SIZE=str(world_size), RANK="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *argv],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )


def _error_lines(proc):
    return [l for l in proc.stderr.splitlines() if l.startswith("error:")]


CONFIG_CASES = {
    "world-not-divisible": (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6,
                            "world size (6) must be divisible by tensor x pipeline x context"),
    "layers-vs-pp": (dict(num_layers=3, pipeline_model_parallel_size=2), 2, "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"),
    "layers-vs-vpp": (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3), 2,
                      "must be divisible by pipeline size x --num-layers-per-virtual-pipeline-stage"),
    "heads-vs-tp": (dict(num_attention_heads=3, hidden_size=36, tensor_model_parallel_size=2), 2,
                    "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    "batch-vs-dp": (dict(global_batch_size=6, micro_batch_size=2), 2,
                    "--global-batch-size (6) must be divisible by --micro-batch-size x data-parallel size (2 x 2)"),
    "warmup-vs-iters": (dict(lr_warmup_iters=5, train_iters=5), 1, "--lr-warmup-iters (5) must be smaller than"),
    "unknown-schedule": (dict(pipeline_schedule="zigzag"), 1, "--pipeline-schedule 'zigzag' is unknown"),
    "missing-data": (dict(data_path="/nonexistent/corpus_text_document"), 1, "/nonexistent/corpus_text_document"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_rule_raises_one_sentence(case):
    overrides, world, expected = CONFIG_CASES[case]
    with pytest.raises(ConfigError) as info:
        parse_config(tiny_gpt_args(**overrides), world_size=world)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("case", ["world-not-divisible", "unknown-schedule", "missing-data"])
def test_cli_prints_one_line_and_exits_nonzero(case):
    overrides, world, expected = CONFIG_CASES[case]
    proc = _cli(tiny_gpt_args(**overrides), world_size=world)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _copy_dataset(tmp_path, truncate_suffix, keep_bytes):
    prefix = str(tmp_path / "corpus_text_document")
    for suffix in (".bin", ".idx"):
        data = open(SAMPLE_DATA + suffix, "rb").read()
        if suffix == truncate_suffix:
            data = data[:keep_bytes]
        with open(prefix + suffix, "wb") as f:
            f.write(data)
    return prefix


@pytest.mark.parametrize("suffix,keep", [(".idx", 100), (".bin", 1000)])
def test_truncated_data_file_is_named(tmp_path, suffix, keep):
    prefix = _copy_dataset(tmp_path, suffix, keep)
    proc = _cli(tiny_gpt_args(data_path=prefix))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and prefix + suffix in lines[0], proc.stderr[-2000:]


def test_load_from_missing_checkpoint_dir(tmp_path):
    proc = _cli(tiny_gpt_args(load=str(tmp_path / "nope"), train_iters=1))
    assert proc.returncode == 1
    lines = _error_lines(proc)
    assert len(lines) == 1 and "does not exist" in lines[0], proc.stderr[-2000:]


def test_load_from_half_written_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000005").mkdir(parents=True)
    (ckpt / "iter_0000005" / "__0_0.distcp").write_bytes(b"partial")
    # No tracker: the save never completed.
    proc = _cli(tiny_gpt_args(load=str(ckpt), train_iters=1))
    assert proc.returncode == 1
    lines = _error_lines(proc)
    assert len(lines) == 1 and "no complete checkpoint" in lines[0], proc.stderr[-2000:]
    # Tracker written but the checkpoint it names lacks its metadata.
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    proc = _cli(tiny_gpt_args(load=str(ckpt), train_iters=1))
    lines = _error_lines(proc)
    assert proc.returncode == 1 and len(lines) == 1 and "incomplete" in lines[0], proc.stderr[-2000:]
