"""`tools/simulate.py`: pretrain_gpt.py's flags plus hardware, a table per schedule, a timeline picture.

Bad input (an unknown preset, a layout that cannot work) ends with one line on stderr
and exit status 2, before anything is simulated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from megatron_weipipe.arguments import add_pretrain_flags, config_from_args
from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.errors import ConfigError
from megatron_weipipe.flags import FlagParser, add_flags, from_args
from megatron_weipipe.schedules import registry

from megatron_weipipe.errors import require_simulable
from .options import OPTION_GROUPS, CalibrationOptions, HardwareOptions, OutputOptions, SimulationOptions

EXIT_BAD_INPUT = 2


@dataclass
class SimulatorArgs:
    """Parsed command line: the training run it describes, and the simulator's own options."""

    config: PretrainConfig  # flags as given; per-schedule defaults are filled in by run_specs
    sim: SimulationOptions
    hw: HardwareOptions
    cal: CalibrationOptions
    out: OutputOptions

    @property
    def calibrated(self) -> bool:
        return bool(self.cal.calibrate or self.cal.calibration)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="simulate.py", allow_abbrev=False,
                   description="Project iteration time, traffic and memory of pipeline schedules. Takes "
                               "pretrain_gpt.py's flags (those that do not shape the run are ignored).")
    add_pretrain_flags(p, require=False)
    for prefix, cls, title in OPTION_GROUPS:
        add_flags(p, cls, prefix, title=title)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> SimulatorArgs:
    args = build_parser().parse_args(argv)
    sim, hw, cal, out = (from_args(args, cls, prefix) for prefix, cls, _ in OPTION_GROUPS)
    cfg = config_from_args(args, world_size=1)
    p = cfg.parallel
    p.validate()  # the sizes the world size is computed from
    world = sim.num_gpus or p.model_parallel_size
    require_simulable(world % p.model_parallel_size == 0,
            f"--num-gpus ({world}) must be divisible by tensor x pipeline x context parallel size "
            f"({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x {p.context_parallel_size})")
    return SimulatorArgs(replace(cfg, world_size=world), sim, hw, cal, out)


def schedule_names(a: SimulatorArgs) -> list[str]:
    if a.sim.schedules:
        return [n.strip() for n in a.sim.schedules.split(",") if n.strip()]
    if a.config.parallel.pipeline_schedule:
        return [a.config.parallel.pipeline_schedule]
    if a.config.parallel.pipeline_model_parallel_size == 1:
        return [registry.default_schedule_name(a.config)]
    return list(registry.compared_by_default())


def build_cluster(hw: HardwareOptions):
    from .hardware import HOST_LINKS, Cluster, device_preset, link_preset, parse_links, shared_link

    device = device_preset(hw.gpu)
    overrides = {k: getattr(hw, k) for k in ("peak_tflops", "gemm_efficiency", "attention_efficiency",
                                             "hbm_gbs", "memory_gb") if getattr(hw, k) is not None}
    device = replace(device, **overrides).validate()
    intra, inter = parse_links(hw.link)
    if hw.intra_bandwidth_gbs is not None or hw.intra_latency_us is not None:
        intra = replace(intra, bandwidth_gbs=hw.intra_bandwidth_gbs or intra.bandwidth_gbs,
                        latency_us=intra.latency_us if hw.intra_latency_us is None else hw.intra_latency_us)
    if hw.inter_bandwidth_gbs is not None or hw.inter_latency_us is not None:
        inter = replace(inter, bandwidth_gbs=hw.inter_bandwidth_gbs or inter.bandwidth_gbs,
                        latency_us=inter.latency_us if hw.inter_latency_us is None else hw.inter_latency_us)
    require_simulable(hw.gpus_per_node >= 1, "--gpus-per-node must be at least 1")
    require_simulable(1 <= hw.intra_link_shared_by <= hw.gpus_per_node and 1 <= hw.inter_link_shared_by <= hw.gpus_per_node,
            "--intra-link-shared-by and --inter-link-shared-by must be between 1 and --gpus-per-node")
    intra, inter = shared_link(intra, hw.intra_link_shared_by), shared_link(inter, hw.inter_link_shared_by)
    return Cluster(device=device, intra=intra, inter=inter, gpus_per_node=hw.gpus_per_node,
                   host_link=link_preset(hw.host_link, HOST_LINKS, "--host-link"),
                   host_memory_gb=hw.host_memory_gb).validate()


def run_specs(a: SimulatorArgs) -> list:
    """One RunSpec per compared schedule, each checked by the training rules; raises ConfigError."""
    from .run_spec import for_schedule, spec_from_config
    from .sharding import sharding_from

    names = schedule_names(a)
    for n in names:
        require_simulable(n in registry.simulated_names(),
                          f"--schedules: {n!r} is unknown; choose from {', '.join(registry.simulated_names())}")
    factors = kernel_efficiencies(a.sim.kernel_efficiency, names)
    specs = []
    for n in names:
        entry = registry.simulated(n)
        spec = spec_from_config(for_schedule(a.config, n), virtual_stages=a.sim.virtual_stages,
                                zero3=a.sim.zero3 or entry.projection == registry.FSDP,
                                attention_impl="unfused" if a.calibrated else "flash",
                                weight_pass=a.sim.weipipe_weight_pass,
                                offload_checkpoints=a.sim.fpdt_offload_checkpoints)
        fsdp = sharding_from(a.config, a.sim.hsdp_replicas, a.sim.fsdp_no_reshard, a.sim.fsdp_grad_sync_once,
                             a.sim.fsdp_reduce_dtype)
        specs.append(replace(spec, schedule=n, kernel_efficiency=factors[n], fsdp=fsdp).validate())
    return specs


def kernel_efficiencies(text: str, names) -> dict:
    """--kernel-efficiency: one factor for every schedule ("0.9") or SCHEDULE=FACTOR pairs
    ("weipipe-interleave=0.8,weipipe-zb=0.8"; the others 1.0)."""
    out = {n: 1.0 for n in names}
    text = (text or "1.0").strip()
    try:
        if "=" not in text:
            out = {n: float(text) for n in names}
        else:
            for part in filter(None, (x.strip() for x in text.split(","))):
                name, _, value = part.partition("=")
                require_simulable(name.strip() in out, f"--kernel-efficiency names {name.strip()!r}, which is not among "
                                             f"--schedules ({', '.join(names)})")
                out[name.strip()] = float(value)
    except ValueError:
        require_simulable(False, f"--kernel-efficiency {text!r} must be a number or SCHEDULE=NUMBER pairs")
    for n, f in out.items():
        require_simulable(0 < f <= 10, f"--kernel-efficiency of {n} must be positive (got {f:g})")
    return out


def parse_command(argv: Optional[Sequence[str]] = None):
    """(parsed arguments, cluster, run specs) of a command line; raises ConfigError."""
    a = parse_args(argv)
    return a, build_cluster(a.hw), run_specs(a)


def calibration_for(opts: CalibrationOptions, spec, calibrator=None):
    """This host's calibration for the spec's shape: read from --calibration, or measured
    by ``calibrator`` (training/host_calibration.py, which runs real megatron-core layers)."""
    import os

    from . import calibration as calib

    key = (spec.shape, spec.layers_per_chunk)
    if key not in _CALIBRATIONS:
        if opts.calibration and os.path.exists(opts.calibration) and not opts.calibrate:
            c = calib.load(opts.calibration)
            if opts.calibration_clock and opts.calibration_clock != c.clock:
                c = c.in_clock(opts.calibration_clock)
            _CALIBRATIONS[key] = c
        else:
            require_simulable(calibrator is not None,
                    "--calibrate times real layers on this host: run it through python -m tools.simulate")
            require_simulable(opts.calibrate_ranks >= 1, "--calibrate-ranks must be at least 1")
            reps = opts.calibration_repeats
            if opts.calibrate_ranks > 1:
                c = calibrator.calibrate_concurrently(spec.shape, spec.layers_per_chunk, opts.calibrate_ranks, repeats=reps)
            else:
                c = calibrator.calibrate(spec.shape, spec.layers_per_chunk, repeats=reps)
            if opts.measure_host:
                from dataclasses import replace as _replace

                g = calibrator.gloo_link()
                c = _replace(c, gloo_gbs=g.bandwidth_gbs, gloo_latency_us=g.latency_us,
                             gloo_cpu_s_per_byte=g.cpu_s_per_byte)
            _CALIBRATIONS[key] = c
            calib.save(c, opts.calibration)
    return _CALIBRATIONS[key]


def host_cluster(cal: CalibrationOptions, world: int, calibration):
    """This machine as the cluster: every rank on one host, gloo between them, the cores
    shared with the other jobs the calibration saw."""
    import os

    from .hardware import CPU_HOST, LINKS, Cluster, LinkSpec
    from .calibration import background_tasks

    cores = cal.host_cores or calibration.host_cores or os.cpu_count() or 1
    background = cal.host_background
    if background is None:
        background = background_tasks(calibration.cpu_share, calibration.others_cores, int(cores),
                                      calibration.ranks)
    link = LINKS["loopback"]
    if calibration.gloo_gbs:
        link = LinkSpec("gloo-loopback", calibration.gloo_gbs, calibration.gloo_latency_us or 0.0,
                        calibration.gloo_cpu_s_per_byte)
    if calibration.clock == "wall" and cal.host_cores is None and cal.host_background is None:
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


def costs_for(a: SimulatorArgs, spec, cluster, calibrator=None):
    """FLOP-based costs from the device preset, or this host's calibration."""
    from .costs import FlopOptions, from_calibration, from_flops

    if a.calibrated:
        return from_calibration(calibration_for(a.cal, spec, calibrator), spec.layers_per_chunk, recompute=spec.recompute_share,
                                weight_pass=spec.weight_pass)
    lay = spec.layout
    o = FlopOptions(tp=lay.tp, cp=lay.cp, tp_link=cluster.link(0, 0),
                    cp_link=cluster.slowest_link(lay.context_ranks()), dtype_bytes=spec.compute_bytes,
                    weight_pass=spec.weight_pass, recompute=spec.recompute_share)
    if spec.fpdt is not None:
        from .fpdt import analyse

        fp = analyse(spec.shape, spec.fpdt, cluster, cp=lay.cp, tp=lay.tp, dtype_bytes=spec.compute_bytes)
        o = replace(o, extra_forward=fp.exposed_s_per_layer / 3, extra_backward=fp.exposed_s_per_layer * 2 / 3)
    return from_flops(spec.shape, cluster.device, spec.layers_per_chunk, o)


def main(argv: Optional[Sequence[str]] = None, calibrator=None) -> int:
    """``calibrator``: what measures this host for --calibrate / --measure-host (tools/simulate.py
    passes training/host_calibration.py); without it only a saved --calibration can be used."""
    import warnings

    from .project import simulate_run
    from .report import format_results

    warnings.filterwarnings("ignore")  # megatron-core's TE/apex fallback notices
    try:
        a, cluster, specs = parse_command(argv)
        if a.calibrated:
            cluster = host_cluster(a.cal, a.config.world_size, calibration_for(a.cal, specs[0], calibrator))
        results = [simulate_run(spec, cluster, costs_for(a, spec, cluster, calibrator)) for spec in specs]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_results(results, cluster, calibrated=a.calibrated))
    if a.out.plot:
        from .plot import draw

        draw(results, a.out.plot)
        print(f"timeline written to {a.out.plot}")
    if a.out.json:
        from .report import write_json

        write_json(results, a.out.json)
    return 0
