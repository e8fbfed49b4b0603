"""Throughput, FLOPs, memory and the Megatron-format log line."""

from __future__ import annotations

import datetime

from megatron_weipipe.config import PretrainConfig


def model_flops_per_sample(cfg: PretrainConfig, vocab_size: int) -> float:
    """Training FLOPs of one sample (the whole model), Megatron-LM's convention (its
    num_floating_point_operations): 3 x forward matmul FLOPs, attention counted as the full
    square. Model FLOPs: recomputation, full or selective, adds none (Megatron-LM's expansion
    factor is 3 whatever --recompute-* say). An iteration's are this times its global batch
    size (a ramp's current one)."""
    t = cfg.training
    shape = cfg.model.shape(micro_batch_size=t.micro_batch_size, vocab_size=vocab_size)
    return shape.model_flops_per_microbatch(causal_fraction=1.0) / t.micro_batch_size


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TB"


def training_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    tflops_per_device: float,
    tokens_per_second: float,
    lr: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm,
    skipped: int,
    nan_iterations: int,
    mem_gb: float,
    bytes_sent: dict[str, int] | None,
    num_zeros: float | None = None,
    params_norm: float | None = None,
) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {tflops_per_device:.3f}",
        f"tokens/s: {tokens_per_second:.1f}",
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    for k, v in losses.items():
        parts.append(f"{k}: {v:.6E}")
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped:3d}")
    parts.append(f"number of nan iterations: {nan_iterations:3d}")
    parts.append(f"mem (GB): {mem_gb:.2f}")
    if bytes_sent is not None:  # "0B" on one rank: a one-rank group's collectives send nothing
        moved = " ".join(f"{k}={format_bytes(v)}" for k, v in sorted(bytes_sent.items()) if v)
        parts.append(f"sent/rank/iter: {moved or '0B'}")
    return " | ".join(parts) + " |"


def memory_scalars(platform) -> dict[str, float]:
    """``--log-memory-to-tensorboard``: Megatron-LM's figures of ``torch.cuda.memory_stats``
    on CUDA (host-side allocator counters, no device sync); the peak resident set on a CPU host."""
    if platform.is_cuda:
        import torch

        stats = torch.cuda.memory_stats()
        keys = {"mem-reserved-bytes": "reserved_bytes.all.current",
                "mem-allocated-bytes": "allocated_bytes.all.current",
                "mem-max-allocated-bytes": "allocated_bytes.all.peak",
                "mem-allocated-count": "allocation.all.current"}
        return {name: float(stats.get(key, 0)) for name, key in keys.items()}
    gb, _ = platform.peak_memory_gb()
    return {"mem-peak-rss-bytes": gb * 1e9}
