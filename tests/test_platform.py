"""The CPU adapter: megatron-core's CUDA-only calls land on the CPU, in a fresh interpreter."""

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the adapter is only applied on CPU hosts")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cuda_calls_run_on_cpu():
    out = _run(
        """
        import torch
        from megatron_weipipe.platform import install_cpu_adapter, detect_platform
        assert detect_platform().backend == "gloo"
        install_cpu_adapter(); install_cpu_adapter()  # idempotent
        a = torch.zeros(3, device="cuda")
        b = torch.empty(2, device=torch.cuda.current_device())
        c = torch.ones(2).cuda().to("cuda:0")
        assert a.device.type == b.device.type == c.device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_rng_tracker_fork_is_reproducible_and_isolated():
    out = _run(
        """
        import torch
        from megatron_weipipe.platform import install_cpu_adapter
        install_cpu_adapter()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        def seed_tracker(s):
            get_cuda_rng_tracker().reset(); get_cuda_rng_tracker().add('model-parallel-rng', s)
        def draws():
            torch.manual_seed(0)
            seed_tracker(7)
            outside = torch.rand(2)
            with get_cuda_rng_tracker().fork():
                inside = torch.rand(2)
            after = torch.rand(2)
            return outside, inside, after
        x, y = draws(), draws()
        assert all(torch.equal(p, q) for p, q in zip(x, y))
        # The fork draws from its own stream: the stream outside continues as if it never ran.
        torch.manual_seed(0); seed_tracker(7)
        o = torch.rand(2); a = torch.rand(2)
        assert torch.equal(o, x[0]) and torch.equal(a, x[2]) and not torch.equal(x[1], a)
        print("ok")
        """
    )
    assert out.strip() == "ok"
