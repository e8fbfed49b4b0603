"""tools/plan.py: pretrain_gpt.py's model and batch flags and a cluster in, the fastest
layouts that fit out, each with the launch line that trains it.

    python -m tools.plan <pretrain_gpt.py flags without layout flags> \
        --gpu h100 --gpus-per-node 8 --nodes 2 --link nvlink,ib [--top 5] [--confirm 1] [--json out.json]

The cluster flags are tools/simulate.py's (``--gpu``, ``--link``, ``--gpus-per-node``,
``--memory-gb``, ``--host-memory-gb``, ...) plus ``--nodes``. Bad input: one line on
stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_weipipe.errors import ConfigError
from megatron_weipipe.flags import FlagParser, add_flags, from_args, option
from megatron_weipipe.simulator.options import HardwareOptions

EXIT_BAD_INPUT = 2


@dataclass
class PlannerOptions:
    nodes: int = option(1, help="nodes of --gpus-per-node devices each")
    top: int = option(5, help="layouts printed, fastest first")
    confirm: int = option(0, help="dry-run the heaviest rank of the first K layouts (tools/dry_run.py) and compare "
                                  "its peak with the estimator's")
    confirm_timeout: float = option(1800.0, help="seconds each --confirm dry run may take")
    schedules: Optional[str] = option(None, help="comma list of pipeline schedules to consider (default: all the "
                                                 "trainer runs)")
    fpdt_chunks: str = option("65536,16384,8192", help="FPDT chunk sizes the memory ladder tries, comma list")
    usable_memory_fraction: float = option(1.0, help="share of --memory-gb a layout may fill (headroom for the "
                                                     "allocator)")
    json: Optional[str] = option(None, help="write the ranked layouts as JSON")
    papers: bool = option(False, help="print the planner's pick beside each paper's method at the papers' settings "
                                      "(tools/planner/papers.py) and exit")
    testbed_check: bool = option(False, help="check the first choice against the link testbed's measured groups "
                                             "(tools/planner/testbed_check.py) and exit")


GROUPS = (("hw", HardwareOptions, "cluster (tools/simulate.py's)"), ("plan", PlannerOptions, "planner"))


def _parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="plan.py", allow_abbrev=False, add_help=True,
                   description="Rank the layouts pretrain_gpt.py accepts for a model on a cluster. Give pretrain_gpt.py's "
                               "model, batch and run flags (not the layout flags the planner chooses).")
    for prefix, cls, title in GROUPS:
        add_flags(p, cls, prefix, title=title)
    return p


def parse(argv: Sequence[str]):
    """(hardware options, planner options, pretrain_gpt.py flags); raises ConfigError."""
    from .space import given_layout_flags

    known, rest = _parser().parse_known_args(list(argv))
    hw, opts = (from_args(known, cls, prefix) for prefix, cls, _ in GROUPS)
    given = given_layout_flags(rest)
    if given:
        raise ConfigError(f"{given[0]} is the planner's to choose: leave the layout flags out "
                          f"({len(given)} given)")
    if opts.nodes < 1 or opts.top < 1 or opts.confirm < 0:
        raise ConfigError("--nodes and --top must be at least 1, --confirm at least 0")
    if not 0 < opts.usable_memory_fraction <= 1:
        raise ConfigError("--usable-memory-fraction must be in (0, 1]")
    return hw, opts, rest


def fpdt_chunks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--fpdt-chunks {text!r} must be a comma list of token counts") from None


def launch_line(base: Sequence[str], flags: Sequence[str], nodes: int, gpus_per_node: int) -> str:
    return (f"torchrun --nproc-per-node {gpus_per_node} --nnodes {nodes} pretrain_gpt.py "
            + shlex.join(list(base) + list(flags)))


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 or n == 0 else f"{n / 1e6:.1f} MB"


def format_plan(p, base, cluster, nodes: int, top: int) -> str:
    from megatron_weipipe.simulator.report import fmt_time

    world = nodes * cluster.gpus_per_node
    d = cluster.device
    lines = [f"{world} x {d.name} ({nodes} node{'s' if nodes > 1 else ''} x {cluster.gpus_per_node}, "
             f"{d.memory_gb:g} GB each), links {cluster.intra.name} / {cluster.inter.name}: "
             f"{p.structures} structures, {p.refused} refused by pretrain_gpt.py, {p.too_big} fit no rung of the "
             f"memory ladder, {len(p.ranked) + p.bounded} fit: {len(p.ranked)} simulated, {p.bounded} bounded out "
             f"(their compute alone is slower than the top {top}) ({p.seconds:.1f} s)"]
    if not p.ranked:
        lines.append("no layout fits" + (f"; the closest needs {gb(p.smallest_misfit[0])} per rank "
                                         f"({p.smallest_misfit[1]})" if p.smallest_misfit else ""))
        for reason, n in p.rejections.most_common():
            lines.append(f"  refused {n} x: {reason}")
        return "\n".join(lines)
    lines += ["", "| # | tokens/s | MFU | iteration | device / rank | host / rank | layout |", "|---|---|---|---|---|---|---|"]
    best = p.ranked[0].tokens_per_s
    for i, e in enumerate(p.ranked[:top], 1):
        mfu = f"{e.mfu:.1%}" if e.mfu is not None else "-"
        rel = "" if i == 1 else f" ({e.tokens_per_s / best - 1:+.1%})"
        lines.append(f"| {i} | {e.tokens_per_s:,.0f}{rel} | {mfu} | {fmt_time(e.result.iteration_s)} | "
                     f"{gb(e.memory.device)} | {gb(e.memory.host)} | {e.candidate.describe()} |")
    lines.append("")
    for i, e in enumerate(p.ranked[:top], 1):
        lines.append(f"{i}. {launch_line(base, e.candidate.flags, nodes, cluster.gpus_per_node)}")
    return "\n".join(lines)


def plan_dict(p, base, nodes: int, gpus_per_node: int, top: int) -> dict:
    rows = []
    for e in p.ranked[:top]:
        rows.append({"layout": e.candidate.describe(), "flags": list(e.candidate.flags),
                     "launch": launch_line(base, e.candidate.flags, nodes, gpus_per_node),
                     "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "iteration_s": e.result.iteration_s,
                     "device_bytes_per_rank": list(e.memory.per_rank_device), "device_bytes": e.memory.device,
                     "host_bytes": e.memory.host})
    return {"ranked": rows, "structures": p.structures, "refused": p.refused, "too_big": p.too_big,
            "bounded": p.bounded, "simulations": p.simulations, "seconds": p.seconds}


def run_confirm(p, base, world: int, k: int, timeout: float) -> list[str]:
    from .confirm import DEFAULT_TOLERANCE, confirm

    lines = ["", f"dry run of the heaviest rank of the first {k} (tools/dry_run.py --platform cuda), against the "
                  f"estimator on the same layers (agree within {DEFAULT_TOLERANCE:.0%}):"]
    ok = True
    for i, e in enumerate(p.ranked[:k], 1):
        spec = e.result.spec
        heaviest = max(range(len(e.memory.per_rank_device)), key=lambda r: e.memory.per_rank_device[r])
        rank = spec.layout.pipeline_ranks()[heaviest]
        c = confirm(list(base) + list(e.candidate.flags), world, rank, timeout)
        if c.error:
            lines.append(f"{i}. rank {rank}: {c.error}")
            ok = False
            continue
        agree = c.agrees()
        ok = ok and agree
        lines.append(f"{i}. rank {rank}: dry run {c.dry_run} B ({gb(c.dry_run)}), estimator {c.estimator} B "
                     f"(x {c.ratio:.4f}); host {c.dry_run_host} / {c.estimator_host} B; "
                     f"{'agree' if agree else 'DIFFER'}")
    return lines + ([] if ok else ["confirmation FAILED"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    import warnings

    from megatron_weipipe.simulator.cli import build_cluster

    from .search import plan

    warnings.filterwarnings("ignore")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        hw, opts, base = parse(argv)
        if opts.papers:
            from .papers import main as papers_main

            return papers_main()
        if opts.testbed_check:
            from .testbed_check import main as testbed_main

            return testbed_main()
        cluster = build_cluster(hw)
        schedules = [s.strip() for s in opts.schedules.split(",")] if opts.schedules else None
        p = plan(base, cluster, opts.nodes, keep=max(opts.top, opts.confirm), schedules=schedules, fpdt_chunks=fpdt_chunks(opts.fpdt_chunks),
                 usable_fraction=opts.usable_memory_fraction)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_plan(p, base, cluster, opts.nodes, opts.top))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(plan_dict(p, base, opts.nodes, cluster.gpus_per_node, opts.top), f, indent=1)
    if opts.confirm and p.ranked:
        lines = run_confirm(p, base, opts.nodes * cluster.gpus_per_node, opts.confirm, opts.confirm_timeout)
        print("\n".join(lines))
        if lines[-1] == "confirmation FAILED":
            return 1
    return 0
