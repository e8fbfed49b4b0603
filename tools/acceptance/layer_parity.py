"""One model under two layer implementations, same weights: logits, loss and gradients agree.

    python -m tools.acceptance.layer_parity --impl-b transformer_engine   # a GPU host with TE
    python -m tools.acceptance.layer_parity --impl-b local                # the harness itself (CPU)

Model A (megatron-core's local layers) is built with one seed, model B with another; every
parameter of B is then copied from A (TE fuses the norms into the next linear layer:
``input_layernorm.*`` -> ``self_attention.linear_qkv.layer_norm_*``, ``pre_mlp_layernorm.*``
-> ``mlp.linear_fc1.layer_norm_*``, megatron-core's own key map). Any parameter of B left
without a source is a failure. Both run one forward and backward on the same tokens; the
errors are norm-relative, ||b - a|| / ||a||, the worst over logits, loss and every
parameter gradient. Prints one JSON object per dtype.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore")

FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --micro-batch-size 2 "
         "--global-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --train-iters 1 "
         "--hidden-dropout 0 --attention-dropout 0 --normalization RMSNorm --swiglu --disable-bias-linear "
         "--position-embedding-type rope --untie-embeddings-and-output-weights --allow-unverified-gpu-paths").split()
# logits/loss/grads, norm-relative; fp32 leaves room for TE's fused kernels and its attention
# backend (flash / cuDNN) summing in another order than the local unfused path.
TOL = {"fp32": 2e-3, "bf16": 5e-2}
TE_NAME_MAP = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def _init_single_process():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_weipipe.platform import detect_platform, install_cpu_adapter

    platform = detect_platform()
    if not platform.is_cuda:
        install_cpu_adapter()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(platform.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    return platform


def _build(impl: str, dtype: str, seed: int, platform):
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt import build_gpt_model, layer_spec

    flags = FLAGS + ["--transformer-impl", impl, "--seed", str(seed)] + (["--bf16"] if dtype == "bf16" else [])
    cfg = parse_config(flags, world_size=1)
    return build_gpt_model(cfg, 1024, True, True, spec=layer_spec(cfg, platform)), cfg


def source_name(name_b: str, names_a) -> str | None:
    """The parameter of model A that model B's ``name_b`` is a copy of."""
    if name_b in names_a:
        return name_b
    for local, fused in TE_NAME_MAP:
        if fused in name_b and name_b.replace(fused, local) in names_a:
            return name_b.replace(fused, local)
    return None


def copy_weights(a, b) -> list[str]:
    """Copy every parameter of ``b`` from ``a``; returns the names of ``b`` with no source."""
    import torch

    pa = dict(a.named_parameters())
    missing = []
    with torch.no_grad():
        for name, p in b.named_parameters():
            src = source_name(name, pa)
            if src is None or pa[src].shape != p.shape:
                missing.append(name)
            else:
                p.copy_(pa[src])
    return missing


def _rel(x, y) -> float:
    x, y = x.detach().double(), y.detach().double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def compare(impl_a: str, impl_b: str, dtype: str, platform) -> dict:
    import torch

    t0 = time.perf_counter()
    a, cfg = _build(impl_a, dtype, 1234, platform)
    b, _ = _build(impl_b, dtype, 4321, platform)
    missing = copy_weights(a, b)
    device = platform.current_device()
    g = torch.Generator().manual_seed(0)
    s, mb = cfg.model.seq_length, cfg.training.micro_batch_size
    tokens = torch.randint(0, 1024, (mb, s + 1), generator=g).to(device)
    pos = torch.arange(s, device=device).unsqueeze(0).expand(mb, s)
    out = {}
    for name, model in (("a", a), ("b", b)):
        logits = model(tokens[:, :-1], pos, None)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        out[name] = (logits, loss, {n: p.grad for n, p in model.named_parameters()})
    la, lb = out["a"], out["b"]
    pa = dict(a.named_parameters())
    errs = {"logits": _rel(lb[0], la[0]), "loss": _rel(lb[1], la[1])}
    for n, grad in lb[2].items():
        src = source_name(n, pa)
        if src is not None and grad is not None and la[2][src] is not None:
            errs[f"grad {n}"] = _rel(grad, la[2][src])
    worst = max(errs, key=errs.get)
    ok = not missing and errs[worst] <= TOL[dtype] and len(errs) == 2 + len(lb[2])
    return dict(dtype=dtype, ok=ok, worst=worst, err=errs[worst], tol=TOL[dtype], missing=missing,
                compared=len(errs), params=len(lb[2]), seconds=time.perf_counter() - t0,
                shape="L2 h256 heads4 s256 b2 RMSNorm SwiGLU RoPE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl-a", default="local")
    ap.add_argument("--impl-b", default="transformer_engine")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = ap.parse_args(argv)
    platform = _init_single_process()
    ok = True
    for dtype in args.dtypes:
        result = compare(args.impl_a, args.impl_b, dtype, platform)
        ok &= result["ok"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
