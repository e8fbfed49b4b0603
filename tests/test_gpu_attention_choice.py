"""On a GPU host no schedule's layers hold the s x s attention scores unless asked for.

GPU defect guarded (issue 25): ``Platform.attention_backend`` returned ``auto`` unchanged on
CUDA, so megatron-core's local layers (what WeiPipe always builds on a GPU) got its unfused
``DotProductAttention``: examples/gpu_single_node.sh (16K tokens, 32 heads) built
[32, 16K, 16K] scores per layer with fp32 softmax copies and ran out of memory on 80 GB.
And ``masked_softmax_fusion`` was on for every GPU, so bf16 attention at s <= 4096 called
apex's compiled ``scaled_*softmax_cuda`` kernels, which a pip install lacks.

Decided for a faked CUDA host (``Platform("cuda", "nccl", transformer_engine=False/True)``),
nothing touches CUDA. The cases are every schedule of the registry (each at the first
parallel layout its start-up rules accept) under each data-parallel mode and the
Ulysses / FPDT long-context paths, and every --attention-backend value, so a schedule
added later is checked too. The local layers are built and run forward and backward on
the CPU under a dispatch mode that records every tensor with two sequence-length axes:
any attention that materialises s x s, whatever its class, is caught (and the
``unfused`` / ``local`` cases, which ask for it, must show it, so the detector works).
"""

from __future__ import annotations

import pytest
from harness import run_distributed
from harness.runs import tiny_gpt_args

S = 48  # sequence length: no other dimension of the tiny model (2, 4, 8, 32, 128) equals it
BASE = dict(bf16=True, group_query_attention=True, num_query_groups=2, seq_length=S, global_batch_size=8)
# Parallel layouts tried in order; a schedule runs at the first its rules accept.
LAYOUTS = ((1, {}), (2, dict(pipeline_model_parallel_size=2)),
           (2, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)))
DP_MODES = {"ddp": ({}, 1), "distributed-optimizer": (dict(use_distributed_optimizer=True), 2),
            "fsdp2": (dict(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True), 2)}
LONG_CONTEXT = {"": ({}, 1), "ulysses": (dict(context_parallel_size=2), 2),
                "fpdt": (dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16), 2)}
REQUESTS = {"auto": {}, "flash": dict(attention_backend="flash"), "fused": dict(attention_backend="fused"),
            "use-flash-attn": dict(use_flash_attn=True), "unfused": dict(attention_backend="unfused"),
            "local": dict(attention_backend="local")}
ASKED_FOR_SCORES = ("unfused", "local")


def _config(schedule: str, flags: dict, world_factor: int):
    """The configuration of ``schedule`` at the first layout it accepts, or None."""
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.config import ConfigError

    for world, layout in LAYOUTS:
        try:
            return parse_config(tiny_gpt_args(**{**BASE, **layout, **flags, "pipeline_schedule": schedule}),
                                world_size=world * world_factor)
        except ConfigError:
            continue
    return None


def _cases():
    """(label, request, long-context kind, cfg): every schedule x data-parallel mode x
    long-context path at ``auto``, and every schedule at every --attention-backend request."""
    from megatron_weipipe.schedules import registry

    cases = []
    for schedule in registry.names():
        assert _config(schedule, {}, 1) is not None, f"{schedule}: no layout in LAYOUTS passes its rules"
        for dp, (dp_flags, dp_world) in DP_MODES.items():
            for lc, (lc_flags, lc_world) in LONG_CONTEXT.items():
                cfg = _config(schedule, {**dp_flags, **lc_flags}, dp_world * lc_world)
                if cfg is not None:
                    cases.append((f"{schedule}/{dp}/{lc or 'plain'}/auto", "auto", lc, cfg))
        for request, flags in REQUESTS.items():
            cases.append((f"{schedule}/{request}", request, "", _config(schedule, flags, 1)))
        cases.append((f"{schedule}/fp32", "auto", "", _config(schedule, dict(bf16=False), 1)))
    return cases


def _platforms():
    from megatron_weipipe.platform import Platform

    return {"cuda": Platform("cuda", "nccl", transformer_engine=False),
            "cuda+te": Platform("cuda", "nccl", transformer_engine=True)}


def _te_spec_marker(monkeypatch):
    """Transformer Engine is not installed here: its spec builder returns a marker."""
    from megatron.core.models.gpt import gpt_layer_specs

    marker = object()
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda *a, **k: marker)
    return marker


def test_layer_specs_on_a_gpu_host_choose_fused_attention(monkeypatch):
    """Every plain (not long-context) spec on a faked GPU host: Transformer Engine's layers,
    or local layers whose core attention is not megatron-core's unfused one."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_weipipe.model.gpt import layer_spec

    marker = _te_spec_marker(monkeypatch)
    wrong = []
    for label, request, lc, cfg in _cases():
        if lc:
            continue  # long-context specs: test_built_layers_hold_no_s_by_s_tensors
        for host, platform in _platforms().items():
            spec = layer_spec(cfg, platform)
            if spec is marker:
                if host != "cuda+te" or request == "local":
                    wrong.append(f"{label} on {host}: Transformer Engine layers")
                continue
            core = spec.submodules.self_attention.submodules.core_attention
            if (core is DotProductAttention) != (request in ASKED_FOR_SCORES):
                wrong.append(f"{label} on {host}: {core.__name__}")
    assert not wrong, "unfused attention where not asked (or fused where asked):\n" + "\n".join(wrong)


def test_transformer_config_on_a_gpu_host(monkeypatch):
    """The TransformerConfig the faked GPU host builds: fused masked softmax off where its
    kernels do not import (as here) and with --no-masked-softmax-fusion; TE layers get
    --attention-backend as megatron-core's attention_backend (mapped to NVTE_*_ATTN)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_weipipe.model.gpt import build_transformer_config
    from megatron_weipipe.model.layer_choice import choose_layers
    from megatron_weipipe.platform import Platform

    fused_requests = {"auto": AttnBackend.auto, "flash": AttnBackend.flash, "fused": AttnBackend.fused,
                      "use-flash-attn": AttnBackend.flash, "unfused": AttnBackend.unfused}
    for label, request, _lc, cfg in _cases():
        for host, platform in _platforms().items():
            tconf = build_transformer_config(cfg, platform=platform)
            assert tconf.masked_softmax_fusion is False, f"{label} on {host}: fused softmax without its kernels"
            if choose_layers(cfg, platform).transformer_engine:
                assert tconf.attention_backend == fused_requests[request], (label, host, tconf.attention_backend)
    cfg = _config("none", {}, 1)
    with_kernels = Platform("cuda", "nccl", transformer_engine=False, fused_softmax=True)
    assert build_transformer_config(cfg, platform=with_kernels).masked_softmax_fusion is True
    off = _config("none", dict(no_masked_softmax_fusion=True), 1)
    assert build_transformer_config(off, platform=with_kernels).masked_softmax_fusion is False
    assert not Platform("cpu", "gloo", fused_softmax=True).masked_softmax_fusion_available()
    assert not Platform("cuda", "nccl").masked_softmax_fusion_available()  # the real probe: no apex here


def _build_and_run(rank, world):
    """In a 1-rank process: build every case's layer as build_gpt_model would on each faked
    GPU host; for local layers run forward + backward and report the tensors with two
    sequence axes and how SDPA was called; for long-context layers the classes and the
    fused CUDA block kernels FPDT's ``auto`` would try for the run's dtype."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from megatron_weipipe.model.gpt import build_transformer_config, compute_dtype, model_layer_spec
    from megatron_weipipe.model.long_context import build_settings
    from megatron_weipipe.platform import install_cpu_adapter

    install_cpu_adapter()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    marker = object()
    gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec = lambda *a, **k: marker

    class SequenceSquares(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and sum(d == S for d in t.shape) >= 2:
                    self.shapes.add(tuple(t.shape))
            return out

    sdpa_calls = []
    plain_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        backends = torch.backends.cuda  # the flags sdpa_kernel sets (global, also on a CPU build)
        sdpa_calls.append({"math": backends.math_sdp_enabled(), "flash": backends.flash_sdp_enabled(),
                           "gqa": bool(kwargs.get("enable_gqa", False)), "kv_heads": k.size(1),
                           "q_heads": q.size(1), "mask": kwargs.get("attn_mask") is not None,
                           "half": q.dtype in (torch.bfloat16, torch.float16)})
        return plain_sdpa(q, k, v, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    results = []
    for label, request, lc, cfg, host, platform in cases_and_platforms():
        r = {"label": f"{label} on {host}", "request": request, "lc": lc}
        try:
            settings = build_settings(cfg) if lc else None
            spec = model_layer_spec(cfg, platform, settings)
            if spec is marker:
                r["kind"] = "te"
                results.append(r)
                continue
            attn = spec.submodules.self_attention
            r["core"] = attn.submodules.core_attention.__name__
            r["unfused_core"] = attn.submodules.core_attention is DotProductAttention
            if lc:
                r["kind"] = "long-context"
                r["attention_module"] = attn.module.__name__
                head_dim = cfg.model.hidden_size // cfg.model.num_attention_heads
                from megatron_weipipe.fpdt.kernels import cuda_kernels

                # FPDT's block kernels: "auto" tries these on CUDA (fpdt/kernels.py probes them there)
                r["fpdt_kernel"] = cfg.fpdt.kernel
                r["cuda_block_kernels"] = list(cuda_kernels(compute_dtype(cfg), head_dim))
                results.append(r)
                continue
            r["kind"] = "local"
            tconf = build_transformer_config(cfg, num_layers=1, platform=platform)
            r["masked_softmax_fusion"] = tconf.masked_softmax_fusion
            tconf.bias_dropout_fusion = False  # a torch.compile'd add; not attention, and slow on CPU
            vp_stage = 0 if tconf.virtual_pipeline_model_parallel_size else None
            layer = build_module(spec, config=tconf, layer_number=1, vp_stage=vp_stage)
            layer.train()
            dtype = compute_dtype(cfg)
            x = torch.randn(S, 2, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
            del sdpa_calls[:]
            mode = SequenceSquares()
            with mode:
                out, _ = layer(x, attention_mask=None)
                out.float().sum().backward()
            r["squares"] = sorted(mode.shapes)
            r["sdpa"] = list(sdpa_calls)
            if request == "auto" and r["sdpa"]:  # a document mask: K/V repeated, still no math kernel
                mask = torch.ones(2, 1, S, S, dtype=torch.bool).triu(1)
                del sdpa_calls[:]
                with torch.no_grad():
                    layer(x, attention_mask=mask)
                r["sdpa_masked"] = list(sdpa_calls)
        except Exception as e:  # noqa: BLE001  reported per case
            r["error"] = f"{type(e).__name__}: {e}"[:300]
        results.append(r)
    parallel_state.destroy_model_parallel()
    return results


def cases_and_platforms():
    return [(label, request, lc, cfg, host, platform)
            for label, request, lc, cfg in _cases() for host, platform in _platforms().items()]


def test_built_layers_hold_no_s_by_s_tensors():
    """Local layers run forward + backward without any [.., s, s] tensor unless unfused/local
    was asked for (then they have one); SDPA runs with its math kernel off, grouped K/V
    heads passed as they are (no copies) without a mask and repeated with one; the
    long-context layers build no unfused core attention (their forward is FPDT's, never
    the core attention's) and a fused CUDA block kernel serves their dtype."""
    results = run_distributed(_build_and_run, 1, timeout=600)[0]
    wrong = []
    for r in results:
        label, asked = r["label"], r["request"] in ASKED_FOR_SCORES
        if "error" in r:
            wrong.append(f"{label}: {r['error']}")
        elif r["kind"] == "te":
            continue
        elif r["unfused_core"] != asked:
            wrong.append(f"{label}: core attention {r['core']}")
        elif r["kind"] == "long-context":
            if (r["attention_module"] != "LongContextSelfAttention" or r["fpdt_kernel"] != "auto"
                    or not r["cuda_block_kernels"]):
                wrong.append(f"{label}: {r['attention_module']}, kernel {r['fpdt_kernel']}, CUDA block kernels "
                             f"{r['cuda_block_kernels']}")
        elif bool(r["squares"]) != asked:
            wrong.append(f"{label}: s x s tensors {r['squares']} (asked for: {asked})")
        elif r["masked_softmax_fusion"]:
            wrong.append(f"{label}: fused masked softmax without its kernels")
        elif not asked:
            calls = r["sdpa"] + r.get("sdpa_masked", [])
            if not r["sdpa"] or any(c["math"] or not c["flash"] for c in calls):
                wrong.append(f"{label}: SDPA kernels {calls}")
            # flash takes grouped heads as they are (no mask, fp16/bf16); elsewhere they are repeated
            elif any(c["gqa"] != (c["half"] and not c["mask"])
                     or c["kv_heads"] != (BASE["num_query_groups"] if c["gqa"] else c["q_heads"]) for c in calls):
                wrong.append(f"{label}: grouped K/V heads {calls}")
    assert results and not wrong, "\n".join(wrong)
    kinds = {r["kind"] for r in results}
    assert {"te", "local", "long-context"} <= kinds, kinds
