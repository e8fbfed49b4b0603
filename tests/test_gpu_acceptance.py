"""tools/gpu_acceptance.sh on this host: every check that needs no CUDA runs and PASSes
(none may be SKIPPED: --require-cpu-checks), and the CUDA ones say SKIPPED with a reason
when there is no CUDA device. The exit-status rules and skip reasons are checked on the
driver's own functions with a faked host."""

from __future__ import annotations

import json
import os
import subprocess

import gpu_acceptance  # tools/gpu_acceptance.py
from acceptance.checks import Group, Host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CHECKS = {"nccl-ordering", "fpdt-kernel-cpu-fp32", "fpdt-kernel-cpu-bf16", "fpdt-chunked-cpu-fp32",
              "fpdt-chunked-cpu-bf16", "layer-parity-harness-fp32", "layer-parity-harness-bf16",
              *(f"gloo-parity-{s}" for s in ("1f1b", "interleaved", "weipipe-naive", "weipipe-interleave",
                                             "weipipe-zb", "fpdt-cp2"))}


def test_acceptance_script(tmp_path):
    p = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_acceptance.sh"), "--require-cpu-checks", "--json",
                        "--logdir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout)
    rows = {r["check"]: r for r in out["checks"]}
    cpu = {n for n, r in rows.items() if r["needs"] == "cpu"}
    assert cpu == CPU_CHECKS, cpu
    assert all(rows[n]["result"] == "PASS" and rows[n]["figure"] for n in cpu), [rows[n] for n in cpu]
    cuda = [r for r in rows.values() if r["needs"] != "cpu"]
    assert {r["needs"] for r in cuda} == {"cuda", "te", "2+gpus", "te+2gpus"}
    assert {"nccl-parity-weipipe-zb", "nccl-parity-fpdt-cp2", "te-parity-bf16", "fpdt-gpu-bench",
            "fpdt-offload-overlap-cuda-bf16", "fpdt-kernel-cuda-bf16"} <= set(rows)
    if out["gpus"] == 0:
        assert all(r["result"] == "SKIPPED" and r["reason"] for r in cuda), cuda
    assert all(r["result"] in ("PASS", "SKIPPED") for r in cuda)


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
    def g(needs):
        return Group(needs, ("c",), lambda host: {})

    assert g("cpu").skip_reason(_host(tmp_path)) == ""
    assert g("cuda").skip_reason(_host(tmp_path)) == "no CUDA"
    one_gpu = _host(tmp_path, gpus=1, why="")
    assert g("cuda").skip_reason(one_gpu) == ""
    assert g("2+gpus").skip_reason(one_gpu) == "needs 2+ CUDA devices, found 1"
    assert g("te").skip_reason(one_gpu) == "Transformer Engine is not installed"
    assert g("te").skip_reason(_host(tmp_path, gpus=1, te=True, why="")) == ""
    assert g("te+2gpus").skip_reason(_host(tmp_path, gpus=1, te=True, why="")).startswith("needs 2+")


def test_a_raising_check_fails_its_rows_and_skip_marks_rows(tmp_path):
    def boom(host):
        raise RuntimeError("kernel mismatch\nmore")

    rows = gpu_acceptance.run_group(Group("cpu", ("a", "b"), boom), _host(tmp_path), set())
    assert [(r["result"], r["figure"]) for r in rows] == [("FAIL", "RuntimeError: kernel mismatch")] * 2
    partial = gpu_acceptance.run_group(Group("cpu", ("a", "b"), lambda h: {"a": (True, "f", 1.0)}),
                                       _host(tmp_path), set())
    assert [r["result"] for r in partial] == ["PASS", "FAIL"]
    skipped = gpu_acceptance.run_group(Group("cpu", ("a",), boom), _host(tmp_path), {"a"})
    assert skipped[0]["result"] == "SKIPPED" and skipped[0]["reason"] == "excluded by --skip"
    assert gpu_acceptance.exit_code(skipped, require_cpu_checks=True) == 1


def test_one_raising_check_leaves_the_others_of_its_group():
    from acceptance.checks import kernels

    out = kernels(None, "cpu", ("fpdt-kernel-cpu-fp16", "fpdt-kernel-cpu-fp32"))  # no fp16 row: KeyError
    assert out["fpdt-kernel-cpu-fp16"][0] is False and out["fpdt-kernel-cpu-fp16"][1].startswith("KeyError")
    assert out["fpdt-kernel-cpu-fp32"][0] is True


def test_overlap_share_counts_copy_time_under_kernels_of_other_streams():
    from types import SimpleNamespace as NS

    from acceptance.kernels import _overlap_share

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
