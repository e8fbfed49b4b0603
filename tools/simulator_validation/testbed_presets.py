"""The link presets of link_testbed.py and the host's matmul rate they are scaled by.

Per GPU and direction (the bandwidth one pipeline neighbour can use), and one-way latency:

- a800-nvlink: A800 SXM4 NVLink, 400 GB/s bidirectional (NVIDIA A800 datasheet: the A100's
  NVLink capped at 400 GB/s), 200 GB/s per direction.
- a800-pcie: PCIe 4.0 x16, 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction (PCI-SIG).
- ib-edr: InfiniBand EDR, 100 Gb/s = 12.5 GB/s per direction (one HCA per GPU).
- h100-ib400: InfiniBand NDR, 400 Gb/s = 50 GB/s per direction (one ConnectX-7 per GPU).
- eth25: 25 GbE, 3.125 GB/s per direction, between A800 nodes (TawPipe's cluster). One NIC per
  node: the two testbed ranks stand for one rank on each of two nodes, the only sender on
  its NIC (a pipeline's or a ring's hop), so it gets the whole NIC. Not in the default sweep.

GPU peaks, dense bf16 tensor-core FLOP/s: A800/A100 312 T (NVIDIA A100 datasheet), H100
SXM5 989 T (NVIDIA H100 datasheet). EFFICIENCY: the fraction of peak a training step's
kernels reach (model FLOP utilisation of Megatron-LM's large runs is 0.4..0.55; 0.5 is
assumed for every GPU). Latency: 5 us one-way for every link (the order of NCCL's
point-to-point latency for small messages on NVLink and InfiniBand; a 1 MB message is
bandwidth-bound on all four links, so the figure matters little).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

EFFICIENCY = 0.5
LATENCY_S = 5e-6
TBF_BURST_BYTES = 64 * 1024  # tc tbf's bucket where the rate is shaped without netem: an idle link passes this at once


@dataclass(frozen=True)
class Preset:
    gpu: str
    peak_flops: float
    link: str
    link_bytes_s: float
    latency_s: float = LATENCY_S

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * EFFICIENCY

    def emulated(self, host_flops: float) -> tuple[float, float]:
        """(bytes/s, one-way latency s) on this host: the cluster's compute:link ratio."""
        scale = host_flops / self.effective_flops
        return self.link_bytes_s * scale, self.latency_s / scale


PRESETS = {
    "a800-nvlink": Preset("A800 SXM4", 312e12, "NVLink 400 GB/s bidir", 200e9),
    "a800-pcie": Preset("A800 SXM4", 312e12, "PCIe 4.0 x16", 31.5e9),
    "ib-edr": Preset("A800 SXM4", 312e12, "InfiniBand EDR 100 Gb/s", 12.5e9),
    "h100-ib400": Preset("H100 SXM5", 989e12, "InfiniBand NDR 400 Gb/s", 50e9),
    "eth25": Preset("A800 SXM4", 312e12, "25 GbE, one NIC per node", 3.125e9),
}
DEFAULT_PRESETS = ("a800-nvlink", "a800-pcie", "ib-edr", "h100-ib400")  # the documented sweep


def host_flops(n: int = 1024, reps: int = 5) -> float:
    """One core's float32 matmul rate (one thread, pinned to this process's first core): the
    best of `reps` timings of an n x n x n product, so other load on a shared host lowers it
    as little as possible."""
    import torch

    cores = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {min(cores)})
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
    return 2 * n**3 / best


def preset_table(flops: float, names=None) -> str:
    lines = [f"host: {flops / 1e9:.1f} GFLOP/s (one core, float32 {1024}^3 matmul, best of 5); GPU effective = "
             f"peak x {EFFICIENCY}; emulated bytes/s = link bytes/s x host FLOP/s / GPU effective FLOP/s; "
             f"emulated latency = {LATENCY_S * 1e6:.0f} us x GPU effective / host",
             "| preset | GPU (peak bf16) | link (per direction) | host / GPU effective | emulated rate | "
             "emulated one-way latency |", "|---|---|---|---|---|---|"]
    for name, p in PRESETS.items():
        if names and name not in names:
            continue
        rate, lat = p.emulated(flops)
        scale = flops / p.effective_flops
        lines.append(f"| {name} | {p.gpu} ({p.peak_flops / 1e12:.0f} TFLOP/s) | {p.link}: {p.link_bytes_s / 1e9:.1f} GB/s "
                     f"| {flops / 1e9:.1f} G / {p.effective_flops / 1e12:.1f} T = {scale:.3g} "
                     f"| {p.link_bytes_s / 1e9:.1f} GB/s x {scale:.3g} = {rate / 1e6:.2f} MB/s ({rate * 8 / 1e6:.1f} Mbit/s) "
                     f"| {lat * 1e3:.2f} ms |")
    return "\n".join(lines)
