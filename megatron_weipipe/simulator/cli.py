"""`tools/simulate.py`: flags in Megatron's names, a table per schedule, a timeline picture.

Bad input (an unknown preset, a layout that cannot work) ends with one line on stderr
and exit status 2, before anything is simulated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Optional, Sequence

from .errors import SimulatorError, require

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (and exit status 2) like every other error."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simulate.py", allow_abbrev=False,
                                description="Project iteration time, traffic and memory of pipeline schedules.")
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--num-query-groups", type=int, default=None)
    m.add_argument("--kv-channels", type=int, default=None)
    m.add_argument("--ffn-hidden-size", type=int, default=None)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--micro-batch-size", type=int, default=1)
    m.add_argument("--global-batch-size", type=int, default=None)
    m.add_argument("--vocab-size", type=int, default=32000)
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--normalization", default="LayerNorm")
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--position-embedding-type", default="learned_absolute")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--recompute-granularity", default=None, choices=[None, "full"])
    m.add_argument("--fp32", action="store_true", help="fp32 weights and activations (default bf16)")
    m.add_argument("--no-dropout", action="store_true")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--num-gpus", type=int, default=None, help="world size (default TP x PP x CP: one replica)")
    par.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank for interleaved")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--zero3", action="store_true",
                     help="memory as DeepSpeed ZeRO-3 keeps it (weights, grads, Adam sharded over DP x CP)")
    par.add_argument("--weipipe-grad-dtype", default="fp32", choices=["fp32", "bf16"])
    par.add_argument("--weipipe-weight-pass", default="stored", choices=["stored", "replay", "ideal"],
                     help="how weipipe-zb's split backward runs: stored (the runtime's GPT training: I does both "
                          "gradients, W adds them), replay (W is a second autograd pass), ideal (a per-layer "
                          "weight-gradient kernel)")
    par.add_argument("--schedules", default=None,
                     help="comma list of none, 1f1b, interleaved, weipipe-naive, weipipe-interleave, weipipe-zb")
    par.add_argument("--fpdt", action="store_true")
    par.add_argument("--fpdt-chunk-size", type=int, default=65536)
    par.add_argument("--fpdt-offload", action="store_true")
    par.add_argument("--fpdt-offload-checkpoints", action="store_true",
                     help="layer-input checkpoints in host memory (implies --recompute-granularity full)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu", default="h100")
    hw.add_argument("--link", default="nvlink,ib", help="INTRA[,INTER] link presets")
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--host-link", default="pcie5", help="device <-> host link for FPDT offload")
    hw.add_argument("--host-memory-gb", type=float, default=2048.0, help="host memory per node")
    for name, help_ in (("peak-tflops", "device peak"), ("gemm-efficiency", "sustained matmul fraction"),
                        ("attention-efficiency", "sustained attention fraction"), ("hbm-gbs", "HBM GB/s"),
                        ("memory-gb", "device memory GB"), ("intra-bandwidth-gbs", ""), ("intra-latency-us", ""),
                        ("inter-bandwidth-gbs", ""), ("inter-latency-us", "")):
        hw.add_argument(f"--{name}", type=float, default=None, help=help_ or None)
    cal = p.add_argument_group("calibration (this host)")
    cal.add_argument("--calibrate", action="store_true",
                     help="time real megatron-core layers of this shape here and use them as the costs")
    cal.add_argument("--calibration", default=None, help="JSON file: read if it exists, else written by --calibrate")
    cal.add_argument("--host-cores", type=float, default=None,
                     help="with --calibrate: cores the ranks share (default: this host's)")
    cal.add_argument("--host-background", type=float, default=None,
                     help="with --calibrate: other CPU-bound tasks on the host (default: seen while calibrating)")
    cal.add_argument("--calibrate-ranks", type=int, default=1,
                     help="with --calibrate: this many processes calibrate at once, as the ranks of a run on this "
                          "host compute at once (their CPU times carry the contention; the CPU they got per wall "
                          "second gives the other load)")
    cal.add_argument("--calibration-repeats", type=int, default=5, help="rounds of every timed piece")
    cal.add_argument("--calibration-clock", default=None, choices=["cpu", "wall"],
                     help="use the calibration's CPU seconds with fair sharing of the host's cores (default), or "
                          "its wall seconds as they are (the contention it saw, no sharing modelled)")
    cal.add_argument("--measure-host", action="store_true",
                     help="with --calibrate: measure gloo's send/recv speed between two processes here")
    out = p.add_argument_group("output")
    out.add_argument("--plot", default=None, help="PNG timeline of every schedule")
    out.add_argument("--json", default=None, help="write results as JSON")
    return p


def config_from_args(args):
    """(shape, layout, cluster, run specs) from parsed flags; raises SimulatorError."""
    from .fpdt import FPDTSpec
    from .hardware import HOST_LINKS, Cluster, device_preset, link_preset, parse_links
    from .layout import Layout
    from .project import RunSpec, SCHEDULE_NAMES
    from .shape import ModelShape

    shape = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size, swiglu=args.swiglu,
        normalization=args.normalization, add_bias_linear=not args.disable_bias_linear,
        position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
    ).validate()
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp)):
        require(v >= 1, f"{flag} must be at least 1")
    world = args.num_gpus or tp * pp * cp
    require(world % (tp * pp * cp) == 0,
            f"--num-gpus ({world}) must be divisible by tensor x pipeline x context parallel size "
            f"({tp} x {pp} x {cp})")
    layout = Layout(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp)).validate()
    device = device_preset(args.gpu)
    overrides = {k: getattr(args, k) for k in ("peak_tflops", "gemm_efficiency", "attention_efficiency",
                                               "hbm_gbs", "memory_gb") if getattr(args, k) is not None}
    device = replace(device, **overrides).validate()
    intra, inter = parse_links(args.link)
    if args.intra_bandwidth_gbs is not None or args.intra_latency_us is not None:
        intra = replace(intra, bandwidth_gbs=args.intra_bandwidth_gbs or intra.bandwidth_gbs,
                        latency_us=intra.latency_us if args.intra_latency_us is None else args.intra_latency_us)
    if args.inter_bandwidth_gbs is not None or args.inter_latency_us is not None:
        inter = replace(inter, bandwidth_gbs=args.inter_bandwidth_gbs or inter.bandwidth_gbs,
                        latency_us=inter.latency_us if args.inter_latency_us is None else args.inter_latency_us)
    require(args.gpus_per_node >= 1, "--gpus-per-node must be at least 1")
    cluster = Cluster(device=device, intra=intra, inter=inter, gpus_per_node=args.gpus_per_node,
                      host_link=link_preset(args.host_link, HOST_LINKS, "--host-link"),
                      host_memory_gb=args.host_memory_gb).validate()
    if args.schedules:
        names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    else:
        names = ["none"] if pp == 1 else ["1f1b", "interleaved", "weipipe-interleave", "weipipe-zb"]
    for n in names:
        require(n in SCHEDULE_NAMES, f"--schedules: {n!r} is unknown; choose from {', '.join(SCHEDULE_NAMES)}")
    gbs = args.global_batch_size or args.micro_batch_size * layout.dp * max(pp, 1)
    fpdt = None
    if args.fpdt:
        fpdt = FPDTSpec(chunk_size=args.fpdt_chunk_size, offload=args.fpdt_offload,
                        offload_checkpoints=args.fpdt_offload_checkpoints)
    recompute = args.recompute_granularity == "full" or args.fpdt_offload_checkpoints
    specs = [RunSpec(shape=shape, layout=layout, global_batch_size=gbs, schedule=n,
                     virtual_stages=args.virtual_stages, recompute=recompute,
                     compute_bytes=4 if args.fp32 else 2,
                     weipipe_grad_bytes=2 if args.weipipe_grad_dtype == "bf16" else 4,
                     sequence_parallel=args.sequence_parallel,
                     distributed_optimizer=args.use_distributed_optimizer, zero3=args.zero3,
                     attention_impl="unfused" if args.calibrate or args.calibration else "flash",
                     dropout=not args.no_dropout, fpdt=fpdt, weight_pass=args.weipipe_weight_pass).validate()
             for n in names]
    return shape, layout, cluster, specs


def calibration_for(args, spec):
    """This host's calibration for the spec's shape: read from --calibration, or measured."""
    import os

    from . import calibrate as cal

    key = (spec.shape, spec.layers_per_chunk)
    if key not in _CALIBRATIONS:
        if args.calibration and os.path.exists(args.calibration) and not args.calibrate:
            c = cal.load(args.calibration)
            if args.calibration_clock and args.calibration_clock != c.clock:
                c = c.in_clock(args.calibration_clock)
            _CALIBRATIONS[key] = c
        else:
            require(args.calibrate_ranks >= 1, "--calibrate-ranks must be at least 1")
            reps = args.calibration_repeats
            if args.calibrate_ranks > 1:
                c = cal.calibrate_concurrently(spec.shape, spec.layers_per_chunk, args.calibrate_ranks, repeats=reps)
            else:
                c = cal.calibrate(spec.shape, spec.layers_per_chunk, repeats=reps)
            if args.measure_host:
                from dataclasses import replace as _replace

                from .hostprobe import gloo_link

                g = gloo_link()
                c = _replace(c, gloo_gbs=g.bandwidth_gbs, gloo_latency_us=g.latency_us,
                             gloo_cpu_s_per_byte=g.cpu_s_per_byte)
            _CALIBRATIONS[key] = c
            cal.save(c, args.calibration)
    return _CALIBRATIONS[key]


def host_cluster(args, world: int, calibration):
    """This machine as the cluster: every rank on one host, gloo between them, the cores
    shared with the other jobs the calibration saw."""
    import os

    from .hardware import CPU_HOST, LINKS, Cluster, LinkSpec
    from .hostprobe import background_tasks

    cores = args.host_cores or calibration.host_cores or os.cpu_count() or 1
    background = args.host_background
    if background is None:
        background = background_tasks(calibration.cpu_share, calibration.others_cores, int(cores),
                                      calibration.ranks)
    link = LINKS["loopback"]
    if calibration.gloo_gbs:
        link = LinkSpec("gloo-loopback", calibration.gloo_gbs, calibration.gloo_latency_us or 0.0,
                        calibration.gloo_cpu_s_per_byte)
    if calibration.clock == "wall" and args.host_cores is None and args.host_background is None:
        cores, background = None, 0.0  # the wall times already carry the contention
        # and so does the host CPU of messages: seconds of CPU take 1 / share of a wall second
        link = replace(link, cpu_s_per_byte=link.cpu_s_per_byte / max(calibration.cpu_share, 0.05))
    shared = (f"on {cores:g} cores with {background:.1f} other busy tasks" if cores
              else f"timed {calibration.ranks} at a time, wall clock")
    print(f"host: {world} ranks {shared} (calibration got {calibration.cpu_share:.0%} of a core); gloo "
          f"{link.bandwidth_gbs:.2f} GB/s, {link.latency_us:.0f} us per message")
    return Cluster(device=CPU_HOST, intra=link, inter=link, gpus_per_node=max(world, 1), cores_per_node=cores,
                   background_tasks=background).validate()


_CALIBRATIONS: dict = {}


def costs_for(args, spec, cluster):
    """FLOP-based costs from the device preset, or this host's calibration."""
    from .costs import FlopOptions, from_calibration, from_flops

    if args.calibrate or args.calibration:
        return from_calibration(calibration_for(args, spec), spec.layers_per_chunk, recompute=spec.recompute,
                                weight_pass=args.weipipe_weight_pass)
    lay = spec.layout
    o = FlopOptions(tp=lay.tp, cp=lay.cp, tp_link=cluster.link(0, 0),
                    cp_link=cluster.slowest_link(lay.context_ranks()), dtype_bytes=spec.compute_bytes,
                    weight_pass=args.weipipe_weight_pass, recompute=spec.recompute)
    if spec.fpdt is not None:
        from .fpdt import analyse

        fp = analyse(spec.shape, spec.fpdt, cluster, cp=lay.cp, tp=lay.tp, dtype_bytes=spec.compute_bytes)
        o = replace(o, extra_forward=fp.exposed_s_per_layer / 3, extra_backward=fp.exposed_s_per_layer * 2 / 3)
    return from_flops(spec.shape, cluster.device, spec.layers_per_chunk, o)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import warnings

    from .project import simulate_run
    from .report import format_results

    warnings.filterwarnings("ignore")  # megatron-core's TE/apex fallback notices
    args = build_parser().parse_args(argv)
    try:
        _, layout, cluster, specs = config_from_args(args)
        if args.calibrate or args.calibration:
            cluster = host_cluster(args, layout.world, calibration_for(args, specs[0]))
        results = [simulate_run(spec, cluster, costs_for(args, spec, cluster)) for spec in specs]
    except SimulatorError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_results(results, cluster, calibrated=bool(args.calibrate or args.calibration)))
    if args.plot:
        from .plot import draw

        draw(results, args.plot)
        print(f"timeline written to {args.plot}")
    if args.json:
        from .report import write_json

        write_json(results, args.json)
    return 0
