"""tools/gpu_acceptance.sh on this host: every check that needs no CUDA runs and PASSes
(none may be SKIPPED: --require-cpu-checks), and the CUDA ones say SKIPPED with a reason
when there is no CUDA device. The exit-status rules, skip reasons, the side-by-side
scheduling on disjoint GPUs, the parity runs' isolation and the rows' arithmetic are
checked on the driver's own functions with faked hosts and results."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from tools import gpu_acceptance
from tools.acceptance.checks import Group, Host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "interleaved", "weipipe-naive", "weipipe-interleave", "weipipe-zb")
FEATURES = ("fpdt-cp2", "fpdt-offload-cp2", "tp2", "fsdp2", "layer-offload-1f1b", "layer-offload-weipipe-interleave")
CPU_CHECKS = {"nccl-ordering", "fpdt-kernel-cpu-fp32", "fpdt-kernel-cpu-bf16", "fpdt-chunked-cpu-fp32",
              "fpdt-chunked-cpu-bf16", "layer-parity-harness-fp32", "layer-parity-harness-bf16",
              *(f"gloo-parity-{s}" for s in SCHEDULES + FEATURES),
              "gloo-delayed-copy-fpdt-offload-cp2", "gloo-delayed-copy-layer-offload-weipipe-interleave",
              *(f"gloo-parity-p3-{s}" for s in SCHEDULES), *(f"gloo-parity-bf16-p3-{s}" for s in SCHEDULES)}


def test_acceptance_script(tmp_path):
    """The whole table on this host (CPU rows PASS, CUDA rows SKIPPED with reasons), and
    --json-out writes the object --json prints."""
    out_file = tmp_path / "acceptance.json"
    p = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_acceptance.sh"), "--require-cpu-checks", "--json",
                        "--json-out", str(out_file), "--logdir", str(tmp_path)], capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert json.loads(out_file.read_text()) == out
    rows = {r["check"]: r for r in out["checks"]}
    cpu = {n for n, r in rows.items() if r["needs"] == "cpu"}
    assert cpu == CPU_CHECKS, cpu ^ CPU_CHECKS
    assert all(rows[n]["result"] == "PASS" and rows[n]["figure"] for n in cpu), [rows[n] for n in cpu]
    cuda = [r for r in rows.values() if r["needs"] != "cpu"]
    assert {r["needs"] for r in cuda} == {"cuda", "te", "2+gpus", "3+gpus", "4+gpus", "te+2gpus"}
    assert {"nccl-parity-weipipe-zb", "nccl-parity-fpdt-cp2", "nccl-parity-tp2", "nccl-parity-fsdp2",
            "nccl-parity-p4-interleaved", "nccl-parity-pN-weipipe-zb", "nccl-parity-bf16-p4-weipipe-zb",
            "nccl-parity-bf16-pN-1f1b", "nccl-host-syncs-p2", "nccl-host-syncs-pN", "cuda-host-syncs-p1",
            "nccl-delayed-copy-fpdt-offload-cp2", "cuda-delayed-copy-layer-offload",
            "fpdt-offload-delayed-copy-cuda-bf16", "memory-gpu_single_node-weipipe-interleave",
            "throughput-gpu_single_node-1f1b", "memory-pretrain_gpt_slurm", "te-parity-bf16", "fpdt-gpu-bench",
            "fpdt-offload-overlap-cuda-bf16", "fpdt-kernel-cuda-bf16", "fpdt-kernel-cuda-cudnn-bf16",
            "fpdt-kernel-cuda-cuda_efficient-fp32"} <= set(rows)
    if out["gpus"] == 0:
        assert all(r["result"] == "SKIPPED" and r["reason"] for r in cuda), cuda
    assert all(r["result"] in ("PASS", "SKIPPED") for r in cuda)


# Breaks chosen runs of a real torchrun from outside the code under test: a sitecustomize
# (PYTHONPATH) wraps pretrain() so that on one rank the forward step of the run whose
# schedule is named raises (a rank failing alone, as NCCL's crash on a host tensor did at
# the end of iteration 1) or sleeps for good (a hang: its peers wait in a collective).
_INJECT = '''
import importlib.abc, importlib.util, os, sys, time
_PLAN = dict(t.split("=") for t in os.environ.get("ACCEPTANCE_TEST_INJECT", "").split(",") if t)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron_weipipe.training.pretrain":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        plain_exec = spec.loader.exec_module
        def exec_module(module):
            plain_exec(module)
            real = module.pretrain
            def pretrain(cfg, model_provider, forward_step, *args, **kwargs):
                how, _, rank = _PLAN.get(cfg.schedule_name, "@").partition("@")
                if how and rank == os.environ.get("RANK"):
                    def forward_step(*a, **k):
                        if how == "hang":
                            time.sleep(3600)
                        raise RuntimeError("injected failure in " + cfg.schedule_name)
                return real(cfg, model_provider, forward_step, *args, **kwargs)
            module.pretrain = pretrain
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
'''


def test_a_failing_or_hanging_run_is_one_fail_row_and_the_rest_still_run(tmp_path, monkeypatch):
    """GPU defect guarded: one crash (a rank raising alone mid-iteration) or one hang in a
    parity run used to end the whole torchrun, and every later row read "no result", so a
    single bug hid the rest of the table. Each run is now isolated: the raising run is one
    FAIL row with its first error line, the hanging one is cut by its timeout and is one
    FAIL row, and the runs after each still PASS."""
    from tools.acceptance.checks import schedule_parity

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_INJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "inject"),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ACCEPTANCE_TEST_INJECT", "weipipe-naive=raise@1,interleaved=hang@0")
    monkeypatch.setenv("GPU_ACCEPTANCE_RUN_TIMEOUT_S", "30")
    host = Host(gpus=0, te=False, no_cuda_reason="no CUDA", logdir=str(tmp_path), deadline=time.monotonic() + 600)
    out = schedule_parity(host, "gloo", ("weipipe-naive", "1f1b", "interleaved", "weipipe-zb"))
    assert out["gloo-parity-1f1b"][0] is True, out
    assert out["gloo-parity-weipipe-zb"][0] is True, out
    ok, figure, _ = out["gloo-parity-weipipe-naive"]
    assert ok is False and "injected failure in weipipe-naive" in figure and "rank 1" in figure, figure
    ok, figure, _ = out["gloo-parity-interleaved"]
    assert ok is False and "hang" in figure, figure


def _host(tmp_path, gpus=0, te=False, why="no CUDA"):
    return Host(gpus=gpus, te=te, no_cuda_reason=why, logdir=str(tmp_path), deadline=1e18)


def _row(needs, result):
    return dict(check="x", needs=needs, result=result, reason="r", figure="", seconds=0.0)


def test_exit_status_rules():
    passed, skipped_cuda = _row("cpu", "PASS"), _row("cuda", "SKIPPED")
    assert gpu_acceptance.exit_code([passed, skipped_cuda], require_cpu_checks=True) == 0
    assert gpu_acceptance.exit_code([passed, _row("cuda", "FAIL")], require_cpu_checks=False) == 1
    assert gpu_acceptance.exit_code([_row("cpu", "SKIPPED")], require_cpu_checks=False) == 0
    assert gpu_acceptance.exit_code([_row("cpu", "SKIPPED")], require_cpu_checks=True) == 1


def test_skip_reasons(tmp_path):
    def g(needs, also=None):
        return Group(needs, ("c",), lambda host: {}, also_skip=also)

    assert g("cpu").skip_reason(_host(tmp_path)) == ""
    assert g("cuda").skip_reason(_host(tmp_path)) == "no CUDA"
    one_gpu = _host(tmp_path, gpus=1, why="")
    assert g("cuda").skip_reason(one_gpu) == ""
    assert g("2+gpus").skip_reason(one_gpu) == "needs 2+ CUDA devices, found 1"
    assert g("4+gpus").skip_reason(_host(tmp_path, gpus=3, why="")) == "needs 4+ CUDA devices, found 3"
    assert g("te").skip_reason(one_gpu) == "Transformer Engine is not installed"
    assert g("te").skip_reason(_host(tmp_path, gpus=1, te=True, why="")) == ""
    assert g("te+2gpus").skip_reason(_host(tmp_path, gpus=1, te=True, why="")).startswith("needs 2+")
    four = g("3+gpus", also=lambda h: "four" if h.gpus == 4 else "")
    assert four.skip_reason(_host(tmp_path, gpus=4, why="")) == "four"
    assert four.skip_reason(_host(tmp_path, gpus=8, why="")) == ""


def test_a_raising_check_fails_its_rows_and_skip_marks_rows(tmp_path):
    def boom(host):
        raise RuntimeError("kernel mismatch\nmore")

    rows = gpu_acceptance.run_group(Group("cpu", ("a", "b"), boom), _host(tmp_path), set())
    assert [(r["result"], r["figure"]) for r in rows] == [("FAIL", "RuntimeError: kernel mismatch")] * 2
    partial = gpu_acceptance.run_group(Group("cpu", ("a", "b", "c"), lambda h: {"a": (True, "f", 1.0),
                                                                                "c": (None, "not here", 0.0)}),
                                       _host(tmp_path), set())
    assert [r["result"] for r in partial] == ["PASS", "FAIL", "SKIPPED"] and partial[2]["reason"] == "not here"
    skipped = gpu_acceptance.run_group(Group("cpu", ("a",), boom), _host(tmp_path), {"a"})
    assert skipped[0]["result"] == "SKIPPED" and skipped[0]["reason"] == "excluded by --skip"
    assert gpu_acceptance.exit_code(skipped, require_cpu_checks=True) == 1


def test_groups_run_side_by_side_on_disjoint_gpus(tmp_path):
    """Every GPU a group holds is its own while it runs: the all-GPU groups alone, the
    others packed onto the rest, none waiting for a group on other GPUs; CPU groups
    take a CPU slot; rows come back in the groups' order."""
    lock, held, log = threading.Lock(), set(), []

    def job(name, seconds):
        def run(host):
            devices = set(host.devices or ())
            with lock:
                assert not devices & held, (name, devices, held)
                held.update(devices)
                log.append((name, "start", time.monotonic(), tuple(sorted(devices))))
            time.sleep(seconds)
            with lock:
                held.difference_update(devices)
                log.append((name, "end", time.monotonic(), ()))
            return {name: (True, ",".join(map(str, sorted(devices))), seconds)}
        return run

    gs = [Group("cpu", ("cpu-a",), job("cpu-a", 0.2)),
          Group("2+gpus", ("two",), job("two", 0.3), gpus=2, expect_s=5),
          Group("cuda", ("one",), job("one", 0.3), gpus=1, expect_s=1),
          Group("cuda", ("all",), job("all", 0.2), gpus="all", expect_s=1),
          Group("4+gpus", ("four",), job("four", 0.3), gpus=4, expect_s=3),
          Group("cuda", ("inline",), job("inline", 0.0), gpus=1, inline=True),
          Group("8+gpus", ("eight",), job("eight", 0.0), gpus="all")]
    out = gpu_acceptance.run_all(gs, _host(tmp_path, gpus=4, why=""), set(), cpu_slots=1)
    rows = [r for group in out for r in group]
    assert [r["check"] for r in rows] == ["cpu-a", "two", "one", "all", "four", "inline", "eight"]
    assert rows[-1]["result"] == "SKIPPED" and rows[-1]["reason"] == "needs 8+ CUDA devices, found 4"
    assert rows[3]["figure"] == "0,1,2,3" and rows[5]["figure"] == "0"
    starts = {name: t for name, what, t, _ in log if what == "start"}
    ends = {name: t for name, what, t, _ in log if what == "end"}
    assert ends["all"] <= min(starts[n] for n in ("two", "one", "four"))  # the all-GPU group first, alone
    assert starts["two"] < ends["four"] and starts["one"] < ends["two"]  # 4 + ... packed: side by side
    assert starts["cpu-a"] < ends["all"]  # CPU groups need no GPU


def test_parity_rows_arithmetic():
    """Parity within rtol, a failed reference named, bitwise rows need their control and
    at least one delayed copy, the host-sync row lists where runs synchronized."""
    from tools.acceptance.parity import parity_row, syncs_row
    from tools.acceptance.parity_runs import Batch, Run

    flags = dict(num_layers=4, hidden_size=64, seq_length=64)
    ref = dict(losses=[1.0, 2.0, 3.0], grad_norms=[1.0, 1.0, 1.0], seconds=1.0, host_syncs=[])
    close = dict(ref, losses=[1.0, 2.0, 3.0000001], host_syncs=["megatron_weipipe/x.py:3"] * 2)
    run = Run("a", flags, row="r", reference="ref", rtol=1e-5, sync_debug=True)
    assert parity_row(run, {"a": close, "ref": ref}, 2)[0] is True
    assert parity_row(run, {"a": dict(ref, losses=[1.0, 2.0, 3.1]), "ref": ref}, 2)[0] is False
    ok, figure, _ = parity_row(run, {"a": close, "ref": {"error": "boom"}}, 2)
    assert not ok and "reference ref failed: boom" in figure
    assert parity_row(run, {"a": {"error": "RuntimeError: x"}, "ref": ref}, 2)[:2] == (False, "RuntimeError: x")
    bit = Run("d", flags, row="b", reference="ref", control="again")
    delayed = dict(ref, delayed_copies=12)
    assert parity_row(bit, {"d": delayed, "ref": ref, "again": ref}, 2)[0] is True
    assert parity_row(bit, {"d": dict(ref, delayed_copies=0), "ref": ref, "again": ref}, 2)[0] is False
    assert parity_row(bit, {"d": delayed, "ref": ref, "again": close}, 2)[0] is False  # undecidable
    assert parity_row(bit, {"d": dict(close, delayed_copies=3), "ref": ref, "again": ref}, 2)[0] is False
    batch = Batch("b", 2, "nccl", (Run("ref", flags, sync_debug=True), run), syncs_row="s")
    ok, figure, _ = syncs_row(batch, {"ref": ref, "a": close})
    assert not ok and figure.startswith("a: 2 (first at megatron_weipipe/x.py:3)"), figure
    assert syncs_row(batch, {"ref": ref, "a": ref})[0] is True
    assert syncs_row(batch, {"ref": {"error": "x"}, "a": {"error": "y"}})[0] is False


def test_example_runs_take_the_scripts_flags_and_scale_them(tmp_path):
    """The example rows train what examples/*.sh launch, scaled as stated: every flag set
    passes start-up validation for its world; memory and throughput rows judge as stated."""
    from tools.acceptance import example_runs as ex
    from megatron_weipipe.arguments import parse_config

    full = ex.single_node_flags(8, "weipipe-interleave", str(tmp_path))
    assert full[full.index("--num-layers") + 1] == "16" and full[full.index("--global-batch-size") + 1] == "32"
    for gpus, schedule in ((8, "weipipe-zb"), (4, "interleaved"), (3, "1f1b"), (1, "none"), (8, "none")):
        flags, scaled = ex.single_node_run(gpus, schedule, str(tmp_path))
        cfg = parse_config(flags, world_size=gpus)
        assert cfg.schedule_name == schedule and cfg.data.mock_data and "--data-path" not in flags, scaled
        assert cfg.model.num_layers == (16 if schedule == "none" else 2 * gpus)
    for gpus, layout in ((8, (2, 4)), (2, (1, 2)), (1, (1, 1))):
        flags, scaled, world = ex.slurm_run(gpus)
        cfg = parse_config(flags, world_size=world)
        assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == layout
        assert cfg.model.hidden_size == 4096 and cfg.model.seq_length == 32768 and world <= gpus
    result = dict(peak_bytes=110 * 2**30, seconds=9.0, stats=dict(tokens_per_second=5e4, tflops_per_device=300.0))
    assert ex.memory_row(result, {"peak_accelerator_bytes": 100 * 2**30}, "s")[0] is True
    assert ex.memory_row(result, {"peak_accelerator_bytes": 80 * 2**30}, "s")[0] is False
    assert ex.memory_row(result, None, "s")[0] is False
    ok, figure, _ = ex.throughput_row(result, "NVIDIA H200", "s")
    assert ok and "MFU 30.3% of 989" in figure, figure
    assert ex.throughput_row(dict(result, stats=dict(tokens_per_second=1.0, tflops_per_device=1.0)),
                             "NVIDIA H100 80GB HBM3", "s")[0] is False


def test_example_rows_from_their_runs_and_dry_runs(tmp_path, monkeypatch):
    """Each example run's result and its dry run land in its own two rows; on one GPU the
    ring schedules' rows are SKIPPED with the reason, and PP = 1 runs."""
    from tools.acceptance import example_runs as ex

    batches = []

    def fake_batch(host, batch):
        batches.append((batch.world, [r.name for r in batch.runs], batch.env))
        return {r.name: dict(peak_bytes=10 * 2**30 + 7 * len(r.name), seconds=1.0,
                             stats=dict(tokens_per_second=1e4, tflops_per_device=200.0)) for r in batch.runs}

    class FakeDryRun:
        returncode = 0

        def __init__(self, host, name, flags, world):
            assert "--mock-data" in flags and 1 <= world <= host.gpus
            (tmp_path / f"dry-run-{name}.json").write_text(json.dumps({"peak_accelerator_bytes": 10 * 2**30}))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(ex, "run_batch", fake_batch)
    monkeypatch.setattr(ex, "_dry_run", FakeDryRun)
    host = Host(gpus=2, te=False, no_cuda_reason="", logdir=str(tmp_path), deadline=time.monotonic() + 60,
                gpu_name="NVIDIA H200")
    rows = ex.run(host)
    assert set(rows) == set(ex.ROWS) and all(ok for ok, _, _ in rows.values()), rows
    assert batches == [(2, [f"gpu_single_node-{s}" for s in ex.SCHEDULES] + ["pretrain_gpt_slurm"], ex.ENV)]
    assert "P 2, 4 layers" in rows["memory-gpu_single_node-weipipe-zb"][1]
    assert "MFU 20.2% of 989" in rows["throughput-pretrain_gpt_slurm"][1]
    batches.clear()
    rows = ex.run(replace_host(host, gpus=1))
    assert rows["memory-gpu_single_node-1f1b"][0] is None and "needs 2+" in rows["memory-gpu_single_node-1f1b"][1]
    assert rows["throughput-gpu_single_node-none"][0] is True and batches[0][0] == 1


def replace_host(host, **kw):
    from dataclasses import replace

    return replace(host, **kw)


def test_host_syncs_inside_forward_backward_are_recorded_where_they_happen(monkeypatch):
    """GPU defect guarded: a host sync inside forward/backward (``.item()``, a blocking
    copy) stalls the posting of the next sends and prefetches. On CUDA the worker runs the
    schedule's forward_backward under ``set_sync_debug_mode("warn")`` and records each
    warning's site; here CUDA's warning is imitated."""
    import warnings

    import torch

    from tools.acceptance.parity_worker import counting_host_syncs

    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Schedule:
        def forward_backward(self, n):
            assert modes[-1] == "warn"
            for _ in range(n):
                warnings.warn("called a synchronizing CUDA operation")  # what the CUDA sync debug mode emits
            warnings.warn("something else")
            return n

    found = []
    with counting_host_syncs(Schedule, found):
        assert Schedule().forward_backward(2) == 2
    assert Schedule.forward_backward.__name__ == "forward_backward" and modes[-1] == "default"
    assert len(found) == 2 and found[0].startswith("tests/test_gpu_acceptance.py:"), found


def test_delayed_copies_reach_every_copy_service_of_a_run(monkeypatch):
    """GPU defect guarded: an offload copy that is not ordered by events shows only when
    the copy runs late. Every copy service made while the delay is on sleeps on its side
    stream before each copy (CUDA: ``before_copy``), or counts them (CPU); a model's pools
    get theirs at first use, so a whole run is covered."""
    import torch

    from tools.acceptance.copy_delay import SLEEP_CYCLES, delay, delaying_copies
    from megatron_weipipe.fpdt.host_pool import HostBufferPool

    slept = []
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)

    class FakeCudaService:
        cuda = True

        def before_copy(self, stream):
            raise AssertionError("the delay replaces the plain hook")

    counter = [0]
    delay(FakeCudaService(), counter).before_copy("d2h stream")
    assert counter == [1] and slept == [SLEEP_CYCLES]
    counter = [0]
    with delaying_copies(counter):
        pool = HostBufferPool()
        service = pool.copy_streams(torch.device("cpu"))
        buf = pool.take((4,), torch.float32)
        service.to_host(buf, torch.arange(4.0), pool.fence(buf))
        back, _ = service.to_device(buf, torch.device("cpu"), pool.fence(buf))
    assert counter == [2] and torch.equal(back, torch.arange(4.0))
    assert HostBufferPool().copy_streams(torch.device("cpu")).to_host.__name__ == "to_host"  # restored


def test_one_raising_check_leaves_the_others_of_its_group():
    from tools.acceptance.checks import kernels

    out = kernels(None, "cpu", ("fpdt-kernel-cpu-fp16", "fpdt-kernel-cpu-fp32"))  # no fp16 row: KeyError
    assert out["fpdt-kernel-cpu-fp16"][0] is False and out["fpdt-kernel-cpu-fp16"][1].startswith("KeyError")
    assert out["fpdt-kernel-cpu-fp32"][0] is True


def test_overlap_share_counts_copy_time_under_kernels_of_other_streams():
    from types import SimpleNamespace as NS

    from tools.acceptance.kernels import _overlap_share

    def ev(name, start, end, stream, device="DeviceType.CUDA"):
        return NS(name=name, device_type=device, device_resource_id=stream, time_range=NS(start=start, end=end))

    events = [
        ev("Memcpy DtoH (Device -> Pinned)", 0, 100, 9),
        ev("Memcpy HtoD (Pinned -> Device)", 200, 300, 9),
        ev("void flash_fwd_kernel", 50, 120, 7),  # covers 50 of the first copy
        ev("void gemm", 60, 80, 7),  # inside the same span: not counted twice
        ev("void other_on_copy_stream", 200, 300, 9),  # same stream: not overlap
        ev("cudaLaunchKernel", 0, 300, 0, device="DeviceType.CPU"),
    ]
    share, copy_ms = _overlap_share(events)
    assert share == 50 / 200 and copy_ms == 0.2
    assert _overlap_share([])[0] == 0.0
