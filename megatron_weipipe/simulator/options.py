"""What the simulator takes beyond pretrain_gpt.py's flags: what-if options, hardware,
calibration on this host, output. Flags are generated from these fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.weight_pass import SIMULATED_WEIGHT_PASSES, WeightPass
from megatron_weipipe.flags import option
from megatron_weipipe.schedules import registry


@dataclass
class SimulationOptions:
    num_gpus: Optional[int] = option(None, help="world size (default TP x PP x CP: one replica)")
    schedules: Optional[str] = option(
        None, help=f"comma list of schedules to compare (default: --pipeline-schedule if given, else none at PP=1, "
                   f"otherwise {', '.join(registry.compared_by_default())}); baselines training does not run: "
                   "zb-h1 (zero-bubble 1F1B), floor (N x the slowest stage), fsdp (ZeRO-3 over the same GPUs, PP=1)")
    virtual_stages: int = option(2, help="model chunks per rank for interleaved when "
                                         "--num-layers-per-virtual-pipeline-stage is not given")
    zero3: bool = option(False, help="memory as DeepSpeed ZeRO-3 keeps it (weights, grads, Adam sharded over DP x CP)")
    weipipe_weight_pass: str = option(
        WeightPass.STORED, choices=SIMULATED_WEIGHT_PASSES,
        help="how weipipe-zb's split backward is priced: stored (I does both gradients, W adds them), replay (W "
             "is a second autograd pass), ideal (per-layer weight-gradient kernels, as GPT training's deferred "
             "weight GEMMs run; FLOP-based costs only)")
    kernel_efficiency: str = option(
        "1.0", help="compute speed of a schedule's kernels relative to the cost model (compute seconds are divided by "
                    "it): one factor for all, or SCHEDULE=FACTOR pairs, e.g. weipipe-interleave=0.8,weipipe-zb=0.8")
    hsdp_replicas: Optional[int] = option(
        None, help="fsdp: replicate the model across this many groups of consecutive ranks and shard it inside "
                   "each (HSDP; default: --num-distributed-optimizer-instances with --use-torch-fsdp2, else 1)")
    fsdp_no_reshard: bool = option(
        False, help="fsdp: keep each unit's gathered weights from its forward to its backward (one all-gather per "
                    "unit and microbatch; also set by --torch-fsdp2-no-reshard-after-forward)")
    fsdp_grad_sync_once: bool = option(
        False, help="fsdp: reduce gradients after the last microbatch only, accumulating them unsharded (also set "
                    "by --torch-fsdp2-no-grad-sync-per-microbatch)")
    fsdp_reduce_dtype: str = option(
        "fp32", choices=("fp32", "bf16"),
        help="fsdp: the dtype gradients are reduce-scattered and all-reduced in (DeepSpeed ZeRO-3 in fp16/bf16 "
             "reduces in the model's dtype)")
    fpdt_offload_checkpoints: bool = option(
        False, help="layer-input checkpoints in host memory (implies full recomputation)")


@dataclass
class HardwareOptions:
    gpu: str = option("h100", help="device preset")
    link: str = option("nvlink,ib", help="INTRA[,INTER] link presets")
    gpus_per_node: int = option(8, help="devices per node")
    host_link: str = option("pcie5", help="device <-> host link for FPDT offload")
    host_memory_gb: float = option(2048.0, help="host memory per node")
    peak_tflops: Optional[float] = option(None, help="device peak")
    gemm_efficiency: Optional[float] = option(None, help="sustained matmul fraction")
    attention_efficiency: Optional[float] = option(None, help="sustained attention fraction")
    hbm_gbs: Optional[float] = option(None, help="HBM GB/s")
    memory_gb: Optional[float] = option(None, help="device memory GB")
    intra_bandwidth_gbs: Optional[float] = option(None, help="intra-node link GB/s")
    intra_latency_us: Optional[float] = option(None, help="intra-node link latency")
    inter_bandwidth_gbs: Optional[float] = option(None, help="inter-node link GB/s")
    inter_latency_us: Optional[float] = option(None, help="inter-node link latency")
    intra_link_shared_by: int = option(
        1, help="GPUs of a node using the intra-node link at once (a PCIe switch): each gets its bandwidth / this")
    inter_link_shared_by: int = option(
        1, help="GPUs of a node using the inter-node link at once (one NIC per node): each gets its bandwidth / this")


@dataclass
class CalibrationOptions:
    calibrate: bool = option(False, help="time real megatron-core layers of this shape here and use them as the costs")
    calibration: Optional[str] = option(None, help="JSON file: read if it exists, else written by --calibrate")
    host_cores: Optional[float] = option(None, help="with --calibrate: cores the ranks share (default: this host's)")
    host_background: Optional[float] = option(
        None, help="with --calibrate: other CPU-bound tasks on the host (default: seen while calibrating)")
    calibrate_ranks: int = option(
        1, help="with --calibrate: this many processes calibrate at once, as the ranks of a run on this host compute "
                "at once (their CPU times carry the contention; the CPU they got per wall second gives the other "
                "load)")
    calibration_repeats: int = option(5, help="rounds of every timed piece")
    calibration_clock: Optional[str] = option(
        None, choices=("cpu", "wall"),
        help="use the calibration's CPU seconds with fair sharing of the host's cores (default), or its wall "
             "seconds as they are (the contention it saw, no sharing modelled)")
    measure_host: bool = option(False, help="with --calibrate: measure gloo's send/recv speed between two "
                                            "processes here")


@dataclass
class OutputOptions:
    plot: Optional[str] = option(None, help="PNG timeline of every schedule")
    json: Optional[str] = option(None, help="write results as JSON")


# (argparse destination prefix, dataclass, --help title)
OPTION_GROUPS = (
    ("sim", SimulationOptions, "simulation"),
    ("hw", HardwareOptions, "hardware"),
    ("cal", CalibrationOptions, "calibration (this host)"),
    ("out", OutputOptions, "output"),
)
