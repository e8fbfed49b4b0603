"""Devices, links and how ranks sit on nodes.

Presets carry datasheet peaks and a sustained fraction, so the numbers a projection
rests on are visible and overridable from the command line. Link bandwidths are per
GPU and per direction, at the rate a large NCCL transfer reaches (not the marketing
bidirectional figure); latencies are per message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from megatron_weipipe.errors import SimulatorError, require_simulable

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_tflops: float  # dense bf16 tensor-core peak (the MFU denominator)
    gemm_efficiency: float  # sustained fraction of peak for large matmuls
    attention_efficiency: float  # sustained fraction for fused (flash) attention forward
    hbm_gbs: float  # memory bandwidth, for elementwise work and the optimizer step
    memory_gb: float  # device memory, GB (1e9 bytes) as vendors state it
    causal_fraction: float = 0.5  # share of the attention square actually computed
    streams: bool = True  # collectives run beside compute (CUDA streams); a CPU host has none
    backend: str = "nccl"  # its collectives' library (gloo all-reduces the whole tensor to reduce-scatter)

    def validate(self) -> "DeviceSpec":
        require_simulable(self.peak_tflops > 0, f"device {self.name}: peak TFLOP/s must be positive")
        require_simulable(0 < self.gemm_efficiency <= 1 and 0 < self.attention_efficiency <= 1,
                f"device {self.name}: efficiencies must be in (0, 1]")
        require_simulable(self.hbm_gbs > 0 and self.memory_gb > 0, f"device {self.name}: memory figures must be positive")
        return self

    @property
    def gemm_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.gemm_efficiency

    @property
    def attention_rate(self) -> float:
        return self.peak_tflops * 1e12 * self.attention_efficiency


DEVICES: dict[str, DeviceSpec] = {
    # A100/A800 SXM 80GB: 312 TFLOP/s bf16, 2.0 TB/s; FlashAttention-2 reaches ~60% there
    "a100": DeviceSpec("a100", 312.0, 0.62, 0.60, 2039.0, 80.0),
    "a800": DeviceSpec("a800", 312.0, 0.62, 0.60, 2039.0, 80.0),
    # H100 SXM 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s; FA2/cuDNN attention ~50%
    "h100": DeviceSpec("h100", 989.0, 0.60, 0.50, 3350.0, 80.0),
    # H200 SXM 141GB: same compute as H100, 4.8 TB/s
    "h200": DeviceSpec("h200", 989.0, 0.60, 0.50, 4800.0, 141.0),
}

# A CPU host under --calibrate: costs are measured there; these figures only fill the record.
CPU_HOST = DeviceSpec("cpu-host", 0.1, 1.0, 1.0, 20.0, 16.0, streams=False, backend="gloo")


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth_gbs: float  # per GPU, per direction, GB/s (1e9 bytes)
    latency_us: float
    cpu_s_per_byte: float = 0.0  # host CPU a transfer costs, sender and receiver together (gloo on a CPU host)
    burst_bytes: float = 0.0  # a shaped link's token bucket (tc tbf's burst): bytes an idle link passes at once
    # one NIC per node rather than per GPU: GPUs of a node that cross it at once (HSDP's
    # replica all-reduces, one per shard rank) share its bandwidth (Cluster.crossing_link)
    per_node: bool = False

    def validate(self) -> "LinkSpec":
        require_simulable(self.bandwidth_gbs > 0, f"link {self.name}: bandwidth must be positive")
        require_simulable(self.latency_us >= 0, f"link {self.name}: latency must be non-negative")
        require_simulable(self.burst_bytes >= 0, f"link {self.name}: burst must be non-negative")
        return self

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of nbytes over this link."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * GB)


LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("nvlink", 360.0, 3.0),  # H100 NVLink4 + NVSwitch (450 GB/s nominal)
    "nvlink3": LinkSpec("nvlink3", 230.0, 3.0),  # A100 NVLink3 (300 GB/s nominal)
    "nvlink-a800": LinkSpec("nvlink-a800", 160.0, 3.0),  # A800: NVLink capped at 200 GB/s
    "pcie4": LinkSpec("pcie4", 20.0, 8.0),  # GPU-GPU through a PCIe gen4 x16 switch / host bridge
    "pcie5": LinkSpec("pcie5", 40.0, 8.0),
    "ib": LinkSpec("ib", 45.0, 5.0),  # one 400 Gb/s NDR NIC per GPU
    "ib-hdr": LinkSpec("ib-hdr", 22.0, 5.0),  # 200 Gb/s per GPU
    "ib-edr": LinkSpec("ib-edr", 11.0, 5.0),  # 100 Gb/s per GPU
    "ethernet": LinkSpec("ethernet", 10.0, 20.0),  # 100 GbE TCP
    # 25 GbE, one NIC per node, NCCL over sockets (TawPipe's cluster): 3.125 GB/s line rate, ~90% reached
    "eth25": LinkSpec("eth25", 2.8, 25.0, per_node=True),
    "loopback": LinkSpec("loopback", 2.0, 50.0),  # gloo over TCP on one host (calibrate measures it)
}

HOST_LINKS: dict[str, LinkSpec] = {
    "pcie4": LinkSpec("pcie4-h2d", 25.0, 10.0),  # pinned host <-> device copies
    "pcie5": LinkSpec("pcie5-h2d", 50.0, 10.0),
    "c2c": LinkSpec("nvlink-c2c", 400.0, 5.0),  # Grace Hopper
}


def shared_link(link: LinkSpec, users: int) -> LinkSpec:
    """The link as each of `users` GPUs sees it when they use one shared link at once (a PCIe
    switch, a node's NIC): bandwidth / users, latency unchanged."""
    require_simulable(users >= 1, "a shared link needs at least one user")
    if users == 1:
        return link
    return replace(link, name=f"{link.name}/{users}", bandwidth_gbs=link.bandwidth_gbs / users)


def device_preset(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICES:
        raise SimulatorError(f"--gpu {name!r} is unknown; choose one of {', '.join(sorted(DEVICES))}")
    return DEVICES[key]


def link_preset(name: str, table: Optional[dict] = None, flag: str = "--link") -> LinkSpec:
    table = LINKS if table is None else table
    key = name.strip().lower()
    if key not in table:
        raise SimulatorError(f"{flag} {name!r} is unknown; choose from {', '.join(sorted(table))}")
    return table[key]


def parse_links(text: str) -> tuple[LinkSpec, LinkSpec]:
    """'nvlink,ib' -> (intra-node link, inter-node link); one name means both."""
    parts = [p for p in text.split(",") if p.strip()]
    if not 1 <= len(parts) <= 2:
        raise SimulatorError(f"--link {text!r} must be INTRA or INTRA,INTER (e.g. nvlink,ib)")
    intra = link_preset(parts[0])
    inter = link_preset(parts[-1])
    return intra, inter


@dataclass(frozen=True)
class Cluster:
    """Devices and the links between them; global rank g sits on node g // gpus_per_node."""

    device: DeviceSpec
    intra: LinkSpec
    inter: LinkSpec
    gpus_per_node: int = 8
    host_link: LinkSpec = HOST_LINKS["pcie5"]
    host_memory_gb: float = 2048.0  # per node
    cores_per_node: Optional[float] = None  # CPU hosts: ranks share this many cores (None: one device each)
    background_tasks: float = 0.0  # CPU hosts: other CPU-bound tasks sharing those cores

    def validate(self) -> "Cluster":
        self.device.validate()
        self.intra.validate()
        self.inter.validate()
        self.host_link.validate()
        require_simulable(self.gpus_per_node >= 1, "--gpus-per-node must be at least 1")
        require_simulable(self.cores_per_node is None or self.cores_per_node > 0, "--host-cores must be positive")
        require_simulable(self.background_tasks >= 0, "--host-background must be non-negative")
        return self

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        return self.intra if self.node(a) == self.node(b) else self.inter

    def slowest_link(self, ranks) -> LinkSpec:
        """The link a ring over these ranks is paced by (inter-node if the ring leaves a node)."""
        nodes = {self.node(r) for r in ranks}
        return self.inter if len(nodes) > 1 else self.intra

    def crossing_link(self, group, concurrent) -> LinkSpec:
        """The link ``group``'s ring is paced by while the ``concurrent`` groups it belongs to
        (itself included, one per rank of a node) all run their rings at once: a per-node
        inter-node link is shared by the rings of those groups whose ranks sit on one node."""
        link = self.slowest_link(group)
        if link is not self.inter or not self.inter.per_node:
            return link
        first = self.node(group[0])
        users = sum(1 for g in concurrent if any(self.node(r) == first for r in g))
        return shared_link(link, max(users, 1))

    def with_links(self, intra: Optional[LinkSpec] = None, inter: Optional[LinkSpec] = None) -> "Cluster":
        return replace(self, intra=intra or self.intra, inter=inter or self.inter)
