"""FPDT block kernels for CUDA, checked on the CPU: GQA copies, op adapters, the choice.

No CUDA runs here. torch's CUDA attention ops are replaced by CPU stand-ins with their
signatures and layouts (tests/fpdt_fake_cuda_ops.py), the real ops' schemas and meta
kernels check the argument binding, and ``auto``'s device probe is a fake. What each
test guards on a GPU is in its docstring.
"""

from __future__ import annotations

import functools
import importlib
import logging

import pytest
import torch

from megatron_weipipe.errors import ConfigError
from megatron_weipipe.fpdt import AttentionSpec, FPDTConfig, fpdt_attention
from megatron_weipipe.fpdt import chunked_attention as fpdt_attention_module
from megatron_weipipe.fpdt import kernels
from megatron_weipipe.fpdt.config import KERNELS
from megatron_weipipe.fpdt.documents import Documents
from fpdt_fake_cuda_ops import FakeCudaOps
from fpdt_reference import reference_attention

HIDDEN, HEADS, GROUPS, S, U = 64, 8, 2, 64, 4  # g = 4 query heads per KV head, 4 chunks


def _kernel_class(name: str):
    cls = getattr(kernels, name, None)
    assert cls is not None, f"fpdt.kernels has no {name}"
    return cls


def _fresh_gqa_probes(monkeypatch):
    try:
        monkeypatch.setattr(importlib.import_module("megatron_weipipe.fpdt.cuda_kernels"), "_GQA_PROBES", {})
    except ImportError:
        pass


def _layer(seed=0):
    spec = AttentionSpec(HIDDEN, HEADS, HIDDEN // HEADS, GROUPS)
    g = torch.Generator().manual_seed(seed)
    d64 = torch.float64
    x = torch.randn(S, 1, HIDDEN, generator=g, dtype=d64)
    wq = torch.randn(spec.qkv_size, HIDDEN, generator=g, dtype=d64) * HIDDEN**-0.5
    wp = torch.randn(HIDDEN, spec.proj_input_size, generator=g, dtype=d64) * spec.proj_input_size**-0.5
    dy = torch.randn(S, 1, HIDDEN, generator=g, dtype=d64)
    return spec, x, wq, wp, dy


def _grads(fn, x, wq, wp, dy):
    x, wq, wp = (t.detach().clone().requires_grad_(True) for t in (x, wq, wp))
    out = fn(x, wq, wp)
    out.backward(dy.to(out.dtype))
    return [t.detach().double() for t in (out, x.grad, wq.grad, wp.grad)]


def _run_fpdt(monkeypatch, kern, documents=None):
    """FPDT (U chunks, P = 1) forward + backward through ``kern``, float32: (out, dx, dWqkv, dWproj)."""
    spec, x, wq, wp, dy = _layer()
    monkeypatch.setattr(fpdt_attention_module, "select_kernel", lambda *a, **k: kern)
    cfg = FPDTConfig(chunk_size=S // U)
    cast = [t.float() for t in (x, wq, wp, dy)]
    return _grads(lambda a, b, c: fpdt_attention(a, b, None, c, None, spec, cfg, documents=documents), *cast)


@functools.lru_cache(maxsize=1)
def _reference():
    """Computed before any op is replaced (the reference imports megatron-core and torch._decomp)."""
    spec, x, wq, wp, dy = _layer()
    return _grads(lambda a, b, c: reference_attention(a, b, None, c, None, spec), x, wq, wp, dy)


def _assert_close(got, want, tol=1e-5):
    for name, g, r in zip(("out", "dx", "dWqkv", "dWproj"), got, want):
        err = ((g - r).abs().max() / r.abs().max()).item()
        assert err <= tol, (name, err)


def test_cpu_flash_without_native_gqa_expands_kv_once_per_chunk_loop(monkeypatch):
    """GPU defect: a kernel without grouped-head support got K/V repeat_interleave'd on
    every block call, u(u+1)/2 copies of g x the KV chunk per pass (HBM traffic and a
    transient g-fold K/V per call). Now only the diagonal block of each KV chunk expands,
    u per pass; the full blocks fold query heads into rows. Same values as the reference."""
    want = _reference()
    cpu_flash = _kernel_class("CpuFlashKernel")
    monkeypatch.setattr(cpu_flash, "native_gqa", classmethod(lambda cls: False))
    calls = []
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        real = getattr(torch.ops.aten, name)
        key_pos = 1 if name.endswith("cpu") else 2

        def record(*args, _real=real, _name=name, _pos=key_pos, **kw):
            calls.append((_name.endswith("backward"), args[_pos].shape[1]))
            return _real(*args, **kw)

        monkeypatch.setattr(torch.ops.aten, name, record)
    got = _run_fpdt(monkeypatch, cpu_flash())
    monkeypatch.undo()
    pairs = U * (U + 1) // 2
    for backward in (False, True):
        mine = [h for bwd, h in calls if bwd == backward]
        assert len(mine) == pairs
        assert sum(h == HEADS for h in mine) == U, ("backward" if backward else "forward", mine)
    _assert_close(got, want)


@pytest.mark.parametrize("name", ["CudaFlashKernel", "CudnnKernel", "CudaEfficientKernel"])
@pytest.mark.parametrize("native", [False, True])
def test_cuda_adapters_on_stand_in_ops(monkeypatch, name, native):
    """GPU defect: the CUDA adapters (flash's auxiliary outputs, cuDNN's [b,h,s,1] lse, the
    memory-efficient kernel's lse padded to 32 rows and [b,s,h,d] strides) had never run;
    and flash expanded K/V for GQA on every block call. With ops that take grouped heads
    (flash, cuDNN: probed) no K/V copy is made; without, one per KV chunk per pass."""
    want = _reference()
    _fresh_gqa_probes(monkeypatch)
    fake = FakeCudaOps(native_gqa=native).install(monkeypatch)
    kern = _kernel_class(name)()
    got = _run_fpdt(monkeypatch, kern)
    _assert_close(got, want)
    op = {"CudaFlashKernel": "flash", "CudnnKernel": "cudnn", "CudaEfficientKernel": "efficient"}[name]
    grouped = native and name != "CudaEfficientKernel"  # the memory-efficient op is never given grouped heads
    pairs = U * (U + 1) // 2
    for suffix in ("", "_backward"):
        # the one-off grouped-heads probe (2 query heads, 1 KV head): a forward call, and a
        # backward one when the forward took the grouped heads
        probe = int(name != "CudaEfficientKernel" and (native or not suffix))
        assert fake.expanded(op + suffix, HEADS) == (0 if grouped else U), (suffix, fake.calls)
        assert fake.count(op + suffix) == pairs + probe, fake.calls


def test_adapter_on_document_squares(monkeypatch):
    """GPU defect: packed documents call the kernel on document rectangles of a block, the
    causal ones square; a top-left-aligned causal kernel (cuDNN, memory-efficient) on them
    must give what the math kernel gives."""
    _fresh_gqa_probes(monkeypatch)
    FakeCudaOps(native_gqa=False).install(monkeypatch)
    docs = Documents(torch.tensor([[0, 5, 23, 40, 64]]))
    got = _run_fpdt(monkeypatch, _kernel_class("CudaEfficientKernel")(), documents=docs)
    want = _run_fpdt(monkeypatch, kernels.MathKernel(), documents=Documents(torch.tensor([[0, 5, 23, 40, 64]])))
    _assert_close(got, want)
    with pytest.raises(ValueError, match="square"):
        q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8)
        kernels.CudaEfficientKernel().forward(q, k, k, True, 1.0)


class FakeProbe:
    """``auto``'s device facts without a device: a capability and per-kernel self-check
    results (an error figure, or an exception the kernel's probe raises)."""

    def __init__(self, capability=(9, 0), results=None):
        self.cap, self.results, self.checked = capability, results or {}, []

    def capability(self, device):
        return self.cap

    def prepare(self, kernel, device, dtype, head_dim):
        pass

    def check(self, name, device, dtype, head_dim):
        self.checked.append(name)
        r = self.results.get(name, 1e-6)
        if isinstance(r, Exception):
            raise r
        return r


def _fake_cuda(monkeypatch, **probe):
    fake = FakeProbe(**probe)
    monkeypatch.setattr(kernels, "DEFAULT_PROBE", fake, raising=False)
    monkeypatch.setattr(kernels, "_CHOSEN", {}, raising=False)
    monkeypatch.setattr(kernels, "_logged", set(), raising=False)
    return fake


def test_auto_on_cuda_fp32_is_not_the_math_kernel(monkeypatch):
    """GPU defect: fp32 on CUDA fell back to the math kernel, whose [b, h, C, C] scores at
    the default 64K chunk (16 GiB per head) run out of memory; now the memory-efficient
    kernel, linear in C."""
    _fake_cuda(monkeypatch)
    assert kernels.select_kernel("auto", "cuda", torch.float32, 128).name == "cuda_efficient"


def test_auto_on_cuda_half_tries_cudnn_then_flash(monkeypatch, caplog):
    """GPU defect: only torch's flash kernel was tried on CUDA; cuDNN's attention (faster
    on Hopper) was never used. Order: cuDNN first from sm90, flash first before it, the
    memory-efficient kernel last; a kernel that fails its probe is passed over with one
    logged line."""
    _fake_cuda(monkeypatch)
    assert kernels.select_kernel("auto", "cuda", torch.bfloat16, 128).name == "cudnn"
    _fake_cuda(monkeypatch, capability=(8, 0))
    assert kernels.select_kernel("auto", "cuda", torch.float16, 128).name == "cuda_flash"
    _fake_cuda(monkeypatch, results={"cudnn": RuntimeError("cuDNN Frontend error: no valid engine")})
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.select_kernel("auto", "cuda", torch.bfloat16, 128).name == "cuda_flash"
        kernels.select_kernel("auto", "cuda", torch.bfloat16, 128)  # decided once, logged once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cuda_flash" in lines[0] and "cudnn: RuntimeError" in lines[0], lines
    fake = _fake_cuda(monkeypatch, results={"cudnn": 0.4, "cuda_flash": 0.4})  # wrong values: self-check fails
    assert kernels.select_kernel("auto", "cuda", torch.bfloat16, 128).name == "cuda_efficient"
    assert fake.checked == ["cudnn", "cuda_flash", "cuda_efficient"]
    _fake_cuda(monkeypatch)
    for d in (100, 320):  # not a multiple of 8; over 256
        assert kernels.select_kernel("auto", "cuda", torch.bfloat16, d).name == "cuda_efficient"


def test_math_left_on_cuda_refuses_long_chunk(monkeypatch):
    """GPU defect: with no fused kernel left the math kernel ran silently and ran out of
    memory on a long chunk; now start-up of the first call fails in one line naming
    --fpdt-chunk-size, and a short chunk still runs on math."""
    _fake_cuda(monkeypatch, results={"cuda_efficient": RuntimeError("no kernel image")})
    with pytest.raises(ConfigError, match="--fpdt-chunk-size to at most") as e:
        kernels.select_kernel("auto", "cuda", torch.float32, 128, (1, 32, 65536, 65536))
    assert "\n" not in str(e.value) and "cuda_efficient: RuntimeError" in str(e.value)
    assert kernels.select_kernel("auto", "cuda", torch.float32, 128, (1, 32, 1024, 1024)).name == "math"
    with pytest.raises(ConfigError, match="--fpdt-chunk-size"):
        kernels.select_kernel("math", "cuda", torch.float64, 128, (1, 8, 65536, 65536))
    assert kernels.select_kernel("math", "cpu", torch.float64, 8, (1, 8, 65536, 65536)).name == "math"  # CPU: not refused


def test_kernel_names_and_the_cuda_list_for_the_acceptance():
    """GPU defect: the acceptance could only check the kernel ``auto`` picked; it needs
    every CUDA kernel per dtype to compare each with the math kernel."""
    assert kernels.cuda_kernels(torch.bfloat16, 128) == ("cudnn", "cuda_flash", "cuda_efficient")
    assert kernels.cuda_kernels(torch.float16, 64, (8, 6)) == ("cuda_flash", "cudnn", "cuda_efficient")
    assert kernels.cuda_kernels(torch.float32, 128) == ("cuda_efficient",)
    assert kernels.cuda_kernels(torch.float64, 128) == ()
    assert set(KERNELS) - {"auto"} == set(kernels.KERNEL_CLASSES)
    for bad in (("cudnn", "cpu", torch.bfloat16), ("cuda_efficient", "cuda", torch.float64),
                ("cuda_flash", "cuda", torch.float32)):
        with pytest.raises(ValueError):
            kernels.select_kernel(bad[0], bad[1], bad[2], 64)


def test_op_schemas_bind_and_outputs_map():
    """GPU defect: the adapters call private aten ops whose arguments change between torch
    releases (pyproject allows >= 2.4). They bind by schema names: this torch's schemas
    bind, an older cuDNN schema without attn_bias binds, an unknown required argument or a
    missing scale is refused in a sentence; and on torch's meta kernels each adapter's
    forward and backward return the shapes FPDT expects, grouped heads folded or native."""
    ck = importlib.import_module("megatron_weipipe.fpdt.cuda_kernels")
    for cls in ck.CUDA_KERNELS.values():
        assert cls.schema_problem() is None, cls.name
    old = torch._C.parse_schema(
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, "
        "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, "
        "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor philox_seed, "
        "Tensor philox_offset, Tensor debug_attn_mask)")
    vals = dict(query=1, key=2, value=3, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=True, scale=0.5)
    assert ck.bind(old, vals, ck.AtenKernel.FWD_NEED) == dict(query=1, key=2, value=3, dropout_p=0.0, is_causal=True,
                                                              scale=0.5)
    with pytest.raises(ck.SchemaMismatch, match="window"):
        ck.bind(torch._C.parse_schema("aten::f(Tensor query, int window) -> Tensor"), vals)
    with pytest.raises(ck.SchemaMismatch, match="scale"):
        ck.bind(torch._C.parse_schema("aten::f(Tensor query, Tensor key, Tensor value, bool is_causal) -> Tensor"),
                vals, ck.AtenKernel.FWD_NEED)
    res = ck.name_results(torch._C.parse_schema("aten::f() -> (Tensor output, Tensor rng_state, Tensor unused)"), (1, 2, 3))
    assert res == {"output": 1, "philox_seed": 2, "philox_offset": 3}

    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = m(2, 4, 100, 64), m(2, 2, 100, 64), m(2, 2, 100, 64), m(2, 4, 100, 64)
    for cls in ck.CUDA_KERNELS.values():
        for native in (False, True) if cls.probe_gqa else (False,):
            kern = cls()
            kern.native_gqa_for = lambda q, n=native: n
            for causal in (False, True):
                o, lse = kern.forward(q, k, v, causal, 0.125)
                grads = kern.backward(do, q, k, v, o.contiguous(), lse, causal, 0.125)
                shapes = [tuple(t.shape) for t in (o, lse, *grads)]
                assert shapes == [(2, 4, 100, 64), (2, 4, 100), (2, 4, 100, 64), (2, 2, 100, 64), (2, 2, 100, 64)], \
                    (cls.name, native, causal, shapes)
                assert lse.dtype == torch.float32


def test_lse_layouts_round_trip():
    """GPU defect: cuDNN returns the log-sum-exp as [b, h, sq, 1] and the memory-efficient
    kernel as [b, h, ceil(sq/32)*32] with unwritten padding; read wrongly, the chunk merge
    and the backward use garbage. Each layout maps to [b, h, sq] and back exactly, padding +inf."""
    ck = importlib.import_module("megatron_weipipe.fpdt.cuda_kernels")
    lse = torch.randn(2, 3, 40)
    padded = torch.full((2, 3, 64), float("nan"))
    padded[..., :40] = lse
    for raw, layout in ((lse, ck.LseLayout(40)), (lse[..., None], ck.LseLayout(40, True)), (padded, ck.LseLayout(64))):
        assert ck.LseLayout.of(raw, 40) == layout
        assert torch.equal(layout.to_bhs(raw, 40), lse)
        back = layout.from_bhs(lse)
        assert back.shape == raw.shape and back.is_contiguous()
        assert torch.equal(back[..., :40, 0] if layout.trailing_one else back[..., :40], lse)
    assert torch.isinf(ck.LseLayout(64).from_bhs(lse)[..., 40:]).all()
    with pytest.raises(ck.SchemaMismatch):
        ck.LseLayout.of(torch.empty(2, 3, 0), 40)  # an op that computed no lse
