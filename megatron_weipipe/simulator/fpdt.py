"""FPDT (chunked Ulysses attention with host offload): chunk count, memory, overlap.

Per rank and layer, with S tokens, P context-parallel ranks, chunk C (global tokens
after the all-to-all) and u = S/C chunks (shared/design/FPDT.md):
- forward, chunk i against chunks j <= i: u(u+1)/2 blocks of C x C for a/P heads; with
  offload each block fetches k_j, v_j (C tokens x g/P KV heads, at least one: a KV head
  shared by P/g ranks is on each) from host memory while
  the previous block computes (double buffering);
- backward streams q, o, lse, do and dq of each query chunk through the inner loop;
- on the device: two chunks of q/k/v/o/lse in flight, the fp32 accumulators of one KV
  chunk (dk, dv), the MLP's 4h-wide intermediate and the logits of one chunk, and the
  layer's full-sequence hidden states (S/P tokens);
- on the host: q, k, v, o, lse of every chunk of the layer being computed, dq
  accumulators, and (when activation checkpoints are offloaded, as the paper runs it)
  every layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.fpdt.config import FPDTConfig, kv_heads_per_rank, ulysses_heads_sent

from .hardware import Cluster, GiB
from megatron_weipipe.shape import ModelShape


@dataclass(frozen=True)
class FPDTSpec(FPDTConfig):
    """FPDT as configured for training, plus what the simulator can project beyond it."""

    enabled: bool = True
    offload_checkpoints: bool = False  # layer inputs kept in host memory (the paper's setting)

    def validate(self, shape: ModelShape, cp: int) -> "FPDTSpec":  # type: ignore[override]
        FPDTConfig.validate(self, shape.seq_length, cp)
        return self


@dataclass(frozen=True)
class FPDTReport:
    chunks: int
    device_chunk_bytes: float  # attention chunk buffers + MLP and loss chunk intermediates, one layer
    device_hidden_bytes: float  # full-sequence hidden states of the layer being computed
    checkpoint_bytes: float  # every layer's input (device, or host when offloaded)
    host_bytes_per_rank: float
    block_compute_s: float  # one C x C attention block, forward
    block_fetch_s: float  # k, v of one chunk from host memory
    backward_block_compute_s: float
    backward_block_fetch_s: float  # q, o, lse, do, dq of one chunk in, dq out (at once: two streams)
    exposed_s_per_layer: float  # fetch time not hidden behind compute, forward + backward
    pool_bytes_per_layer: float = 0.0  # bytes of the host buffers one layer's forward/backward pair takes
    pool_backward_bytes: float = 0.0  # ... of which the backward's own (do, dq): one set, reused
    resident_chunk_bytes: float = 0.0  # chunks prefetched back to the device at once (offload)
    # the same buffers by size, {bytes: how many}: what memory.shared_pool_bytes lays out
    # in the pool's power-of-two slabs (residency.pool_bytes) to count what the host pins
    pool_forward_buffers: Optional[dict] = None
    pool_backward_buffers: Optional[dict] = None

    @property
    def prefetch_hidden(self) -> bool:
        return self.block_fetch_s <= self.block_compute_s and self.backward_block_fetch_s <= self.backward_block_compute_s


def analyse(shape: ModelShape, spec: FPDTSpec, cluster: Cluster, *, cp: int, tp: int = 1,
            dtype_bytes: int = 2) -> FPDTReport:
    u = spec.num_chunks(shape.seq_length)
    b, h, d = shape.micro_batch_size, shape.hidden_size, shape.head_dim
    # heads per rank after the all-to-all (a KV head shared by ranks is on each of them)
    a, g = shape.num_attention_heads / tp / cp, kv_heads_per_rank(shape.groups, cp, tp)
    C, e = spec.chunk_size, dtype_bytes
    local = shape.seq_length / cp  # tokens per rank before the all-to-all
    chunk_local = C / cp
    # device: two chunks of q, k, v, o (+ fp32 lse), fp32 dk/dv accumulators of one KV chunk
    attn_chunk = 2 * C * b * (2 * a + 2 * g) * d * e + 2 * C * b * a * 4 + 2 * C * b * g * d * 4
    ffn = shape.ffn * (2 if shape.swiglu else 1) / tp
    mlp_chunk = chunk_local * b * (ffn + shape.ffn / tp) * e * 2  # intermediate and its gradient
    loss_chunk = 2 * chunk_local * b * shape.padded_vocab(tp) / tp * 4
    # projection output before the all-to-all, and what arrives (a KV head once per rank holding it)
    sent = ulysses_heads_sent(shape.num_attention_heads, shape.groups, cp, tp) * d
    qkv_chunk = chunk_local * b * (shape.qkv_width / tp + sent) * e
    device_chunk = attn_chunk + mlp_chunk + loss_chunk + qkv_chunk
    # full-sequence hidden states alive in a layer's forward/backward: input, attention
    # output, residual, norm output, and two gradients
    device_hidden = 6 * local * b * h * e
    checkpoints = shape.num_layers * local * b * h * e
    host_attn = shape.seq_length * b * (2 * a + 2 * g) * d * e + shape.seq_length * b * a * 4 if spec.offload else 0.0
    host_dq = shape.seq_length * b * a * d * 4 if spec.offload else 0.0
    host = host_attn + host_dq + (checkpoints if spec.offload_checkpoints else 0.0)
    rate = cluster.device.attention_rate
    bw = cluster.host_link.bandwidth_gbs * 1e9
    block_flops = 4.0 * C * C * a * d * b
    block_compute = block_flops / rate
    block_fetch = 2 * C * b * g * d * e / bw if spec.offload else 0.0
    bwd_compute = 2.5 * block_compute
    # q, o, do, lse and the fp32 dq come in while the updated dq goes out: two copy streams
    # (fpdt/copy_streams.py), so the link carries both directions at once (bw is per direction)
    bwd_in, bwd_out = C * b * a * d * e * 3 + C * b * a * 4 + C * b * a * d * 4, C * b * a * d * 4
    bwd_fetch = max(bwd_in, bwd_out) / bw if spec.offload else 0.0
    blocks = u * (u + 1) / 2
    exposed = blocks * (max(0.0, block_fetch - block_compute) + max(0.0, bwd_fetch - bwd_compute))
    fwd_bufs, bwd_bufs = pool_buffers(shape, spec, cp=cp, tp=tp, dtype_bytes=dtype_bytes) if spec.offload else ({}, {})
    pool, backward, resident = (offload_bytes(shape, spec, cp=cp, tp=tp, dtype_bytes=dtype_bytes)
                                if spec.offload else (0.0, 0.0, 0.0))
    return FPDTReport(
        pool_bytes_per_layer=pool, pool_backward_bytes=backward, resident_chunk_bytes=resident,
        pool_forward_buffers=fwd_bufs, pool_backward_buffers=bwd_bufs,
        chunks=u, device_chunk_bytes=device_chunk, device_hidden_bytes=device_hidden,
        checkpoint_bytes=checkpoints, host_bytes_per_rank=host, block_compute_s=block_compute,
        block_fetch_s=block_fetch, backward_block_compute_s=bwd_compute, backward_block_fetch_s=bwd_fetch,
        exposed_s_per_layer=exposed,
    )


def offload_bytes(shape: ModelShape, spec: FPDTSpec, *, cp: int, tp: int = 1,
                  dtype_bytes: int = 2) -> tuple[float, float, float]:
    """What fpdt/chunked_attention.py takes from the model's shared HostBufferPool over one layer's
    forward/backward pair, in buffer bytes (``pool_buffers`` has them by size;
    memory.shared_pool_bytes: how many pairs are live at once and the slabs they take), and
    the most chunk state its ChunkStore holds on the device at once: x of two chunks (the
    previous one's weight gradient runs after this chunk's inner loop), k and v of one
    chunk, and q, o, lse, do, dq of two query chunks (double buffering). Returns (pair,
    its backward-only part, device). Backwards run one at a time, so with several layers
    or microbatches in flight the pool holds each one's forward buffers and one set of
    backward buffers (a backward takes the buffers a finished one returned)."""
    u = spec.num_chunks(shape.seq_length)
    b, h, d, e = shape.micro_batch_size, shape.hidden_size, shape.head_dim, dtype_bytes
    a, g = shape.num_attention_heads / tp / cp, kv_heads_per_rank(shape.groups, cp, tp)
    C = spec.chunk_size
    x = C / cp * b * h * e
    kv, qod, lse, dq = 2 * C * b * g * d * e, 3 * C * b * a * d * e, C * b * a * 4, C * b * a * d
    forward, backward = pool_buffers(shape, spec, cp=cp, tp=tp, dtype_bytes=dtype_bytes)
    back = float(sum(n * c for n, c in backward.items()))
    pool = back + sum(n * c for n, c in forward.items())
    resident = 2 * x + kv + 2 * (qod + lse + dq * (4 if u > 2 else e))
    return pool, back, resident


def pool_buffers(shape: ModelShape, spec: FPDTSpec, *, cp: int, tp: int = 1,
                 dtype_bytes: int = 2) -> tuple[dict, dict]:
    """The host buffers of one layer's forward/backward pair by size ({bytes: how many}),
    as fpdt/chunked_attention.py takes them (``offload_bytes`` has their sum): per chunk x and
    o_local (sequence layout), k, v, q, o and the fp32 log-sum-exp in the forward; do of
    every chunk, dq of the later query chunks in the kernel's dtype (u - 1) and as the
    fp32 sum from the second KV chunk on (u - 2; in float32 and float64 the sum overwrites
    the first buffer) in the backward. o_local and do, x and q may share a size, and so
    slabs (residency.slab_layout); bytes are integral here."""
    u = spec.num_chunks(shape.seq_length)
    b, h, d, e = shape.micro_batch_size, shape.hidden_size, shape.head_dim, dtype_bytes
    a, g = shape.num_attention_heads // tp // cp, kv_heads_per_rank(shape.groups, cp, tp)
    C = spec.chunk_size
    L = C // cp
    forward: dict = {}
    backward: dict = {}

    def add(sizes: dict, nbytes: int, count: int) -> None:
        if count > 0:
            sizes[nbytes] = sizes.get(nbytes, 0) + count

    acc = max(e, 4)  # kernels.acc_dtype: float32 below it, the input dtype from it on
    for nbytes in (L * b * h * e, L * b * a * cp * d * e, C * b * g * d * e, C * b * g * d * e,
                   C * b * a * d * e, C * b * a * d * e, C * b * a * acc):  # x, o_local, k, v, q, o, lse
        add(forward, nbytes, u)
    add(backward, C * b * a * d * e, u)  # do
    add(backward, C * b * a * d * e, u - 1)  # dq, first contribution
    if acc != e:  # the sum in the accumulation dtype takes a buffer of its own (else it reuses the first)
        add(backward, C * b * a * d * acc, max(u - 2, 0))
    return forward, backward


def fmt_gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"
