"""One transformer layer built from the FPDT blocks, for the benchmarks in bench/.

pre-norm layer: x + attn(norm(x)), then + mlp(norm(.)), Megatron layout [s, b, h].
method:
  plain         one rank, whole sequence, unchunked attention and MLP (ulysses_attention at P=1)
  ulysses       plain Ulysses over the CP group, unchunked MLP
  fpdt          FPDT attention (chunk_size) + chunked MLP, state on the device
  fpdt_offload  the same with chunk state in host memory
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_weipipe.fpdt.chunked_attention import fpdt_attention, ulysses_attention
from megatron_weipipe.fpdt.config import AttentionSpec, FPDTConfig, RotaryConfig
from megatron_weipipe.fpdt.mlp import chunked_mlp, reference_mlp
from megatron_weipipe.fpdt.offload import HostBufferPool, OffloadStats

METHODS = ("plain", "ulysses", "fpdt", "fpdt_offload")


@dataclass(frozen=True)
class LayerShape:
    hidden: int = 256
    heads: int = 4
    groups: int = 2
    head_dim: int = 64
    ffn: int = 1024
    batch: int = 1

    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.hidden, self.heads, self.head_dim, self.groups, rotary=RotaryConfig(base=500000.0))


LLAMA3_8B = LayerShape(hidden=4096, heads=32, groups=8, head_dim=128, ffn=14336, batch=1)


def make_params(shape: LayerShape, dtype, device, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    spec = shape.spec()

    def w(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(True)

    return dict(
        norm1=torch.ones(shape.hidden, device=device, dtype=dtype, requires_grad=True),
        wq=w(spec.qkv_size, shape.hidden, scale=shape.hidden**-0.5),
        wp=w(shape.hidden, spec.proj_input_size, scale=spec.proj_input_size**-0.5),
        norm2=torch.ones(shape.hidden, device=device, dtype=dtype, requires_grad=True),
        w1=w(2 * shape.ffn, shape.hidden, scale=shape.hidden**-0.5),
        w2=w(shape.hidden, shape.ffn, scale=shape.ffn**-0.5),
    )


class Layer:
    """Callable layer; keeps the host buffer pool across iterations like a model would."""

    def __init__(self, shape: LayerShape, params: dict, method: str, cp_group=None, chunk_size: int | None = None, kernel="auto"):
        if method not in METHODS:
            raise ValueError(f"method={method!r} is not one of {METHODS}")
        self.shape, self.p, self.method, self.cp_group = shape, params, method, cp_group
        self.spec = shape.spec()
        self.kernel = kernel
        self.fpdt = FPDTConfig(chunk_size=chunk_size, offload=method == "fpdt_offload", kernel=kernel)
        self.pool = HostBufferPool(pin_memory=params["wq"].is_cuda)
        self.stats = OffloadStats()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p, spec = self.p, self.spec
        h = F.rms_norm(x, (x.shape[-1],), p["norm1"])
        if self.method in ("plain", "ulysses"):
            a = ulysses_attention(h, p["wq"], None, p["wp"], None, spec, self.cp_group, kernel=self.kernel)
        else:
            a = fpdt_attention(h, p["wq"], None, p["wp"], None, spec, self.fpdt, self.cp_group, pool=self.pool, stats=self.stats)
        x = x + a
        h = F.rms_norm(x, (x.shape[-1],), p["norm2"])
        if self.method in ("plain", "ulysses"):
            m = reference_mlp(h, p["w1"], None, p["w2"], None, "swiglu")
        else:
            S = x.shape[0] * (1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group))
            m = chunked_mlp(h, p["w1"], None, p["w2"], None, "swiglu", num_chunks=self.fpdt.mlp_num_chunks(S))
        return x + m


def attention_flops(seq: int, batch: int, heads: int, head_dim: int, causal: bool = True) -> float:
    """Model FLOPs of the attention core, forward + backward (backward = 2x forward,
    not counting recomputation): 4*b*S^2*H*d per forward, halved when causal."""
    fwd = 4.0 * batch * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
    return 3.0 * fwd


def layer_flops(seq: int, shape: LayerShape) -> float:
    """Model FLOPs of one layer forward + backward: 6 * tokens * weight count + attention core."""
    spec = shape.spec()
    weights = spec.qkv_size * shape.hidden + shape.hidden * spec.proj_input_size + 3 * shape.ffn * shape.hidden
    return 6.0 * seq * shape.batch * weights + attention_flops(seq, shape.batch, shape.heads, shape.head_dim)


def timed(fn, group=None) -> float:
    """Seconds ``fn()`` takes, the slowest rank's when ``group`` is given (barrier first)."""
    import time

    import torch.distributed as dist

    from megatron_weipipe.host_values import all_reduce_values
    from megatron_weipipe.platform import detect_platform

    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    if group is None:
        return seconds
    return all_reduce_values([seconds], detect_platform(), group=group, op=dist.ReduceOp.MAX)[0]


def rss_bytes() -> int:
    """Current resident set of this process."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def longest_fitting(fits, start: int, step: int, limit: int) -> int:
    """Largest multiple of ``step`` in [start, limit] for which fits(n) is True: doubling,
    then bisection. 0 when even ``start`` does not fit."""
    if not fits(start):
        return 0
    lo = start
    hi = None
    n = start * 2
    while n <= limit:
        if fits(n):
            lo, n = n, n * 2
        else:
            hi = n
            break
    if hi is None:
        return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
