#!/usr/bin/env python
"""Print (and optionally draw) the timeline of a pipeline schedule.

    python tools/schedule_timeline.py --schedule weipipe-interleave -P 4 -G 2 --png out.png

Schedules: every one of the registry with a plan: 1f1b, interleaved (Megatron; N = G*P
microbatches unless -N is given, V virtual stages), weipipe-naive, weipipe-interleave,
weipipe-zb, and any WeiPipe variant added there. The text output is a
tick table (rows = ticks, 0-indexed) plus ticks, idle ticks per rank and the bubble
fraction measured by the simulator (F=1, B=2, I=W=1); the PNG draws the simulated
timeline with the bubble fraction in its title. Bad arguments end with one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_weipipe.schedules import registry  # noqa: E402
from megatron_weipipe.schedules.plan.actions import COMPUTE_KINDS, Kind, ScheduleError  # noqa: E402
from megatron_weipipe.schedules.plan.metrics import idle_ticks  # noqa: E402
from megatron_weipipe.schedules.plan.simulate import simulate  # noqa: E402
from megatron_weipipe.schedules.plan.timeline import build, tick_table  # noqa: E402
from megatron_weipipe.schedules.plan.validate import validate  # noqa: E402

COLORS = {
    Kind.FORWARD: "#4C72B0",
    Kind.BACKWARD: "#DD8452",
    Kind.BACKWARD_INPUT: "#C44E52",
    Kind.BACKWARD_WEIGHT: "#55A868",
}


def describe(sched, timing) -> str:
    lines = [
        f"schedule {sched.name}: ranks={sched.num_ranks} microbatches={sched.microbatches}"
        + (f" virtual_stages={sched.virtual_stages}" if sched.family == "megatron" else " (per rank)"),
        f"ticks {sched.num_ticks()}; idle ticks per rank {list(idle_ticks(sched))}",
        f"makespan {timing.makespan:g} (F=1, B=2, I=W=1); bubble fraction {timing.bubble_fraction:.4f}",
        "",
        tick_table(sched),
    ]
    return "\n".join(lines)


def draw(sched, timing, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    P = sched.num_ranks
    fig, ax = plt.subplots(figsize=(max(6.0, timing.makespan * 0.28), 0.6 * P + 1.4))
    for rank, timed in enumerate(timing.per_rank):
        for t in timed:
            a = t.action
            if a.kind not in COMPUTE_KINDS or t.end <= t.start:
                continue
            ax.broken_barh([(t.start, t.end - t.start)], (rank - 0.4, 0.8),
                           facecolors=COLORS.get(a.kind, "grey"), edgecolor="white", linewidth=0.6)
            ax.text((t.start + t.end) / 2, rank, a.label(), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in range(P)])
    ax.set_xlim(0, timing.makespan)
    ax.set_xlabel("time (F = 1, B = 2, I = W = 1)")
    ax.set_title(f"{sched.name}  P={P}  microbatches={sched.microbatches}  "
                 f"bubble {100 * timing.bubble_fraction:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", required=True, choices=registry.plan_names())
    ap.add_argument("-P", type=int, required=True, help="ring / pipeline ranks")
    ap.add_argument("-G", type=int, required=True, help="microbatches per WeiPipe rank")
    ap.add_argument("-N", type=int, default=None, help="Megatron microbatches (default G*P)")
    ap.add_argument("-V", type=int, default=2, help="virtual stages per rank for 'interleaved'")
    ap.add_argument("--png", default=None, help="write the drawn timeline here")
    args = ap.parse_args(argv)
    try:
        sched = build(args.schedule, args.P, args.G, N=args.N, V=args.V)
        validate(sched)
    except ScheduleError as e:
        print(f"schedule_timeline: {e}", file=sys.stderr)
        return 2
    timing = simulate(sched)
    print(describe(sched, timing))
    if args.png:
        draw(sched, timing, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    sys.exit(main())
