"""FPDT (chunked Ulysses attention with host offload): chunk count, memory, overlap.

Per rank and layer, with S tokens, P context-parallel ranks, chunk C (global tokens
after the all-to-all) and u = S/C chunks (shared/design/FPDT.md):
- forward, chunk i against chunks j <= i: u(u+1)/2 blocks of C x C for a/P heads; with
  offload each block fetches k_j, v_j (C tokens x g/P KV heads) from host memory while
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

from megatron_weipipe.fpdt.config import FPDTConfig

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
    backward_block_fetch_s: float  # q, o, lse, do, dq of one chunk, both ways
    exposed_s_per_layer: float  # fetch time not hidden behind compute, forward + backward
    pool_bytes_per_layer: float = 0.0  # host buffers one layer's forward/backward pair takes
    pool_backward_bytes: float = 0.0  # ... of which the backward's own (do, dq): one set, reused
    resident_chunk_bytes: float = 0.0  # chunks prefetched back to the device at once (offload)

    @property
    def prefetch_hidden(self) -> bool:
        return self.block_fetch_s <= self.block_compute_s and self.backward_block_fetch_s <= self.backward_block_compute_s


def analyse(shape: ModelShape, spec: FPDTSpec, cluster: Cluster, *, cp: int, tp: int = 1,
            dtype_bytes: int = 2) -> FPDTReport:
    u = spec.num_chunks(shape.seq_length)
    b, h, d = shape.micro_batch_size, shape.hidden_size, shape.head_dim
    a, g = shape.num_attention_heads / tp / cp, shape.groups / tp / cp  # heads per rank after the all-to-all
    C, e = spec.chunk_size, dtype_bytes
    local = shape.seq_length / cp  # tokens per rank before the all-to-all
    chunk_local = C / cp
    # device: two chunks of q, k, v, o (+ fp32 lse), fp32 dk/dv accumulators of one KV chunk
    attn_chunk = 2 * C * b * (2 * a + 2 * g) * d * e + 2 * C * b * a * 4 + 2 * C * b * g * d * 4
    ffn = shape.ffn * (2 if shape.swiglu else 1) / tp
    mlp_chunk = chunk_local * b * (ffn + shape.ffn / tp) * e * 2  # intermediate and its gradient
    loss_chunk = 2 * chunk_local * b * shape.padded_vocab(tp) / tp * 4
    qkv_chunk = chunk_local * b * shape.qkv_width / tp * e * 2  # projection output before / after all-to-all
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
    bwd_fetch = (C * b * a * d * e * 3 + C * b * a * 4 + C * b * a * d * 4 * 2) / bw if spec.offload else 0.0
    blocks = u * (u + 1) / 2
    exposed = blocks * (max(0.0, block_fetch - block_compute) + max(0.0, bwd_fetch - bwd_compute))
    pool, backward, resident = (offload_bytes(shape, spec, cp=cp, tp=tp, dtype_bytes=dtype_bytes)
                                if spec.offload else (0.0, 0.0, 0.0))
    return FPDTReport(
        pool_bytes_per_layer=pool, pool_backward_bytes=backward, resident_chunk_bytes=resident,
        chunks=u, device_chunk_bytes=device_chunk, device_hidden_bytes=device_hidden,
        checkpoint_bytes=checkpoints, host_bytes_per_rank=host, block_compute_s=block_compute,
        block_fetch_s=block_fetch, backward_block_compute_s=bwd_compute, backward_block_fetch_s=bwd_fetch,
        exposed_s_per_layer=exposed,
    )


def offload_bytes(shape: ModelShape, spec: FPDTSpec, *, cp: int, tp: int = 1,
                  dtype_bytes: int = 2) -> tuple[float, float, float]:
    """What fpdt/attention.py takes from the model's shared HostBufferPool over one layer's
    forward/backward pair (memory.shared_pool_bytes: how many pairs are live at once), and the most chunk state its ChunkStore
    holds on the device at once. Per chunk (C tokens after the all-to-all, L = C/P before):
    the input x and the output o in sequence layout (L x h and L x a d), k and v, q, o, do
    in head layout, the fp32 log-sum-exp; dq of the later query chunks, first in the
    kernel's dtype (u - 1 buffers) and from the second KV chunk on as the fp32 sum (u - 2).
    On the device in the backward: x of two chunks (the previous one's weight gradient
    runs after this chunk's inner loop), k and v of one chunk, and q, o, lse, do, dq of
    two query chunks (double buffering). Returns (pair, its backward-only part, device).
    Backwards run one at a time, so with several layers or microbatches in flight the
    pool holds each one's forward buffers and one set of backward buffers (a backward
    takes the buffers a finished one returned)."""
    u = spec.num_chunks(shape.seq_length)
    b, h, d, e = shape.micro_batch_size, shape.hidden_size, shape.head_dim, dtype_bytes
    a, g = shape.num_attention_heads / tp / cp, shape.groups / tp / cp
    C = spec.chunk_size
    L = C / cp
    x, olocal = L * b * h * e, L * b * a * cp * d * e
    kv, qod, lse, dq = 2 * C * b * g * d * e, 3 * C * b * a * d * e, C * b * a * 4, C * b * a * d
    backward = u * qod / 3 + (u - 1) * dq * e + max(u - 2, 0) * dq * 4
    pool = u * (x + olocal + kv + 2 * qod / 3 + lse) + backward
    resident = 2 * x + kv + 2 * (qod + lse + dq * (4 if u > 2 else e))
    return pool, backward, resident


def fmt_gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"
