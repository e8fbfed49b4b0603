"""Corrupt inputs: one line naming the file, a non-zero exit, nothing overwritten, no code run.

Data files are checked before any process group exists (exit code 2). Checkpoint files
are checked on every rank before loading (exit code 1), and read as data only: a
pickle that would run code is refused before anything unpickles it.
"""

import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from harness import run_distributed
from megatron_weipipe.training.checkpoint import safe_load
from harness.faults import DATA, PRETRAIN, ROOT, tiny_args

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _cli(args, timeout=100):
    return subprocess.run([sys.executable, PRETRAIN, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def _stderr_lines(out):
    return [line for line in out.stderr.splitlines() if line.strip()]


def _copy_data(tmp_path, truncate_suffix):
    prefix = str(tmp_path / "doc")
    for ext in (".bin", ".idx"):
        shutil.copy(DATA + ext, prefix + ext)
    os.truncate(prefix + truncate_suffix, os.path.getsize(prefix + truncate_suffix) - 10)
    return prefix


@pytest.mark.timeout(120)
def test_truncated_bin_through_the_cli_prints_one_line(tmp_path):
    prefix = _copy_data(tmp_path, ".bin")
    out = _cli(tiny_args(2, data_path=prefix))
    assert out.returncode == 2
    lines = _stderr_lines(out)
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: data file {prefix}.bin (") and "is truncated: its index" in lines[0]


def test_truncated_idx_is_refused_while_parsing_flags(tmp_path):
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.config import ConfigError

    prefix = _copy_data(tmp_path, ".idx")
    with pytest.raises(ConfigError, match=rf"^index file {prefix}.idx \(\d+ bytes\) is truncated: its header promises"):
        parse_config(tiny_args(2, data_path=prefix), world_size=1)


class _RunsCode:
    """Unpickling this would create a directory: the marker that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "good")
    out = _cli(tiny_args(2, save=root, save_interval=2), timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    return root


def _digest(root):
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            h.update(p.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


def _corrupt(kind, src, dst, marker):
    shutil.copytree(src, dst)
    it = os.path.join(dst, "iter_0000002")
    if kind == "shard":
        p = os.path.join(it, "__0_0.distcp")
        os.truncate(p, os.path.getsize(p) - 100)
    elif kind == "metadata":
        p = os.path.join(it, ".metadata")
        os.truncate(p, os.path.getsize(p) // 2)
    elif kind == "common":
        p = os.path.join(it, "common.pt")
        os.truncate(p, os.path.getsize(p) // 2)
    elif kind == "unsafe-common":
        torch.save({"iteration": 2, "x": _RunsCode(marker)}, os.path.join(it, "common.pt"))
    elif kind == "unsafe-metadata":
        with open(os.path.join(it, ".metadata"), "wb") as f:
            pickle.dump(_RunsCode(marker), f)
    return dst


# Run through pretrain() on two ranks (the whole path: checks, agreement, who prints).
CASES = {
    "shard": "checkpoint shard {it}/__0_0.distcp is truncated",
    "common": "{it}/common.pt is unreadable, truncated or not plain data",
    "shape": "{it}: the checkpoint's model shape differs: hidden_size 32 in the checkpoint vs 64 requested",
}
# Checked by the same functions, called directly.
FILE_CASES = {
    "metadata": "{it}/.metadata is truncated or corrupt",
    "unsafe-common": "{it}/common.pt is unreadable, truncated or not plain data",
    "unsafe-metadata": "{it}/.metadata is not plain checkpoint metadata: the unpickler refuses to import posix.mkdir",
}


def _try_loads(rank, world_size, roots):
    """pretrain() against each checkpoint directory: the error each one raised on this rank."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    errors = {}
    for kind, root in roots.items():
        overrides = dict(hidden_size=64) if kind == "shape" else {}
        cfg = parse_config(tiny_args(4, save=root, load=root, save_interval=1, **overrides), world_size=world_size)
        try:
            pretrain(cfg, pretrain_gpt.model_provider, forward_step)
            errors[kind] = None
        except Exception as e:
            errors[kind] = (type(e).__name__, e.report, e.quiet)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    return errors


def _has_common_pt(root):
    """megatron-core 0.16 writes common.pt; 0.17+ keeps the common state inside the shards."""
    return os.path.isfile(os.path.join(root, "iter_0000002", "common.pt"))


def _cases(table, root):
    return {k: v for k, v in table.items() if "common" not in k or _has_common_pt(root)}


@pytest.mark.timeout(200)
def test_corrupt_checkpoints_fail_with_one_line_and_change_nothing(checkpoint, tmp_path):
    """Two ranks: both stop with the same error, exactly one of them prints it."""
    cases = _cases(CASES, checkpoint)
    roots = {kind: _corrupt(kind, checkpoint, str(tmp_path / kind), None) for kind in cases if kind != "shape"}
    roots["shape"] = _corrupt("none", checkpoint, str(tmp_path / "shape"), None)
    before = {kind: _digest(root) for kind, root in roots.items()}
    per_rank = run_distributed(_try_loads, 2, roots, timeout=180, env={"MEGATRON_WEIPIPE_WATCHDOG_INTERVAL": "0.2"})
    for kind, expect in cases.items():
        results = [errors[kind] for errors in per_rank]
        assert all(r is not None and r[0] == "CheckpointError" for r in results), (kind, results)
        reports = {r[1] for r in results}
        assert len(reports) == 1, (kind, reports)
        report = reports.pop()
        assert expect.format(it=os.path.join(roots[kind], "iter_0000002")) in report, (kind, report)
        assert "\n" not in report
        assert sorted(r[2] for r in results) == [False, True], f"{kind}: exactly one rank prints it"
        assert _digest(roots[kind]) == before[kind], f"{kind}: checkpoint directory changed"


@pytest.mark.parametrize("kind", list(FILE_CASES))
def test_corrupt_or_unsafe_checkpoint_files_are_refused_without_running_code(checkpoint, tmp_path, kind):
    if kind not in _cases(FILE_CASES, checkpoint):
        pytest.skip("this megatron-core writes no common.pt (test_unsafe_common_state_object_runs_no_code covers it)")
    marker = str(tmp_path / "code-ran")
    it = os.path.join(_corrupt(kind, checkpoint, str(tmp_path / kind), marker), "iter_0000002")
    with pytest.raises(ValueError) as e:
        safe_load.check_checkpoint_files(it)
        safe_load.load_common(it)
    assert FILE_CASES[kind].format(it=it) in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(marker), "a pickle in the checkpoint ran code"


def test_good_checkpoint_files_pass_the_checks(checkpoint):
    it = os.path.join(checkpoint, "iter_0000002")
    safe_load.check_checkpoint_files(it)
    assert safe_load.load_common(it)["iteration"] == 2
    assert safe_load.read_metadata(it).storage_data


def test_unsafe_common_state_object_runs_no_code(tmp_path):
    """megatron-core 0.17+'s format: the common state is a pickled object inside the shards."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    marker = str(tmp_path / "code-ran")
    for name, payload in (("safe", [{"iteration": 7}]), ("unsafe", [{"iteration": 7, "x": _RunsCode(marker)}])):
        buf = io.BytesIO()
        torch.save(payload, buf)
        buf.seek(0)
        save({"common_state/shard_0_1": buf}, storage_writer=FileSystemWriter(str(tmp_path / name)), no_dist=True)
    assert safe_load.load_common(str(tmp_path / "safe")) == {"iteration": 7}
    with pytest.raises(ValueError, match="the common state .* is unreadable, truncated or not plain data"):
        safe_load.load_common(str(tmp_path / "unsafe"))
    assert not os.path.exists(marker), "a pickle in the checkpoint ran code"


def test_safe_planner_refuses_code_in_byte_objects(tmp_path):
    """Byte objects inside .distcp files (the RNG state) load with weights_only=True."""
    marker = str(tmp_path / "code-ran")
    buf = io.BytesIO()
    torch.save([_RunsCode(marker)], buf)
    buf.seek(0)
    planner = safe_load._safe_planner_class()(allow_shape_mismatch_sharded_tensors={})
    planner.flatten_state_dict = False
    planner.state_dict = {}

    class Item:
        class dest_index:
            fqn = "rng_state"

    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        planner.load_bytes(Item, buf)
    assert not os.path.exists(marker)
    buf = io.BytesIO()
    torch.save([{"torch_rng_state": torch.get_rng_state(), "np": ("MT19937", torch.arange(3), 1, 0, 0.0)}], buf)
    buf.seek(0)
    planner.load_bytes(Item, buf)
    assert torch.equal(planner.state_dict["rng_state"][0]["torch_rng_state"], torch.get_rng_state())
    import numpy as np

    buf = io.BytesIO()
    torch.save([{"np_rng_state": np.random.get_state()}], buf)  # the format of earlier checkpoints
    buf.seek(0)
    planner.load_bytes(Item, buf)
    assert (planner.state_dict["rng_state"][0]["np_rng_state"][1] == np.random.get_state()[1]).all()
