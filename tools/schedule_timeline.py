#!/usr/bin/env python
"""Print (and optionally draw) the timeline of a pipeline schedule.

    python -m tools.schedule_timeline --schedule weipipe-interleave -P 4 -G 2 --png out.png
    python -m tools.schedule_timeline --from-trace DIR [--json]

Schedules: every one of the registry with a plan: 1f1b, interleaved (Megatron; N = G*P
microbatches unless -N is given, V virtual stages), weipipe-naive, weipipe-interleave,
weipipe-zb, and any WeiPipe variant added there. The text output is a
tick table (rows = ticks, 0-indexed) plus ticks, idle ticks per rank and the bubble
fraction measured by the simulator (F=1, B=2, I=W=1); the PNG draws the simulated
timeline with the bubble fraction in its title. Bad arguments end with one line on
stderr and exit 2.

`--from-trace DIR` reads the per-rank Chrome traces of `pretrain_gpt.py
--schedule-trace DIR` and prints each rank's measured busy and idle seconds, the
measured bubble (idle / (busy + idle) over all ranks and every traced iteration but the
first, optimizer step excluded; timing/measured.py), the mean measured cost of each
compute kind, the planned bubble at those costs (the simulator on the schedule's plan)
and at unit costs, and the last iteration's measured timeline beside the planned one.
`--json` prints the same as one JSON object (`measured_bubble`, `ranks[].busy_s`,
`ranks[].idle_s`, `planned_bubble`, `clock`, ...). The traces' clock is printed ("host"
or "cuda_event"); a directory mixing clocks is refused, and host time from a CUDA run
(launch times, free receives) is warned about on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_weipipe.schedules import registry
from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Kind, ScheduleError
from megatron_weipipe.schedules.timing.closed_forms import idle_ticks
from megatron_weipipe.schedules.timing.tick_simulator import simulate
from megatron_weipipe.schedules.generate.megatron_timeline import build, tick_table
from megatron_weipipe.schedules.check.validate import validate
from megatron_weipipe.schedules.timing import measured as measured_mod

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


def planned_from_trace(m) -> tuple:
    """(schedule, timing at the measured costs, timing at unit costs), or Nones when the
    traced schedule has no plan (e.g. 'none')."""
    name, meta = m.schedule, m.meta
    if name not in registry.plan_names() or "pipeline_size" not in meta or "num_microbatches" not in meta:
        return None, None, None
    P, N = int(meta["pipeline_size"]), int(meta["num_microbatches"])
    weipipe = registry.entry(name).family == registry.WEIPIPE
    sched = build(name, P, N // P if weipipe else 1, N=None if weipipe else N, V=meta.get("virtual_stages") or 2)
    costs = {k: m.mean_cost_s.get(k.value, 0.0) for k in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT,
                                                            Kind.BACKWARD_WEIGHT, Kind.LOSS)}
    if not weipipe:  # Megatron's forward_step includes the loss
        costs[Kind.LOSS] = 0.0
    return sched, simulate(sched, costs), simulate(sched)


def planned_rows(timing, scale: float, width: int) -> list[str]:
    """The simulated timeline in the text format of measured.last_window_rows; `scale`
    = planned makespan / measured window, so both rows share one time axis."""
    letters = {Kind.FORWARD: "F", Kind.LOSS: "L", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I",
               Kind.BACKWARD_WEIGHT: "W"}
    cols = max(1, min(width, round(width * scale)))
    rows = []
    for timed in timing.per_rank:
        row = ["."] * cols
        for t in timed:
            ch = letters.get(t.action.kind)
            if ch is None or t.end <= t.start:
                continue
            a, b = t.start / timing.makespan * cols, t.end / timing.makespan * cols
            for i in range(int(a), min(cols, int(b) + 1)):
                if min(b, i + 1) - max(a, i) >= 0.5:
                    row[i] = ch
        rows.append("".join(row))
    return rows


def from_trace(directory: str, as_json: bool, width: int) -> int:
    try:
        traces = measured_mod.load(directory)
        m = measured_mod.measure(traces)
    except measured_mod.TraceError as e:
        print(f"schedule_timeline: {e}", file=sys.stderr)
        return 2
    if m.clock_warning:
        print(f"schedule_timeline: warning: {m.clock_warning}", file=sys.stderr)
    sched, at_costs, unit = planned_from_trace(m)
    out = m.to_dict()
    out["planned_bubble"] = at_costs.bubble_fraction if at_costs else None
    out["planned_makespan_s"] = at_costs.makespan if at_costs else None
    out["planned_bubble_unit_costs"] = unit.bubble_fraction if unit else None
    if as_json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"schedule {m.schedule}: {len(traces)} rank traces, iterations {m.iterations} measured "
          f"(the first is left out), mean iteration {out['mean_iteration_s']:.4f} s, timed by {m.clock}")
    print("| rank | busy s | idle s | idle % | of which: recv wait s | send post s | bookkeeping s |")
    print("|---|---|---|---|---|---|---|")
    for r in m.ranks:
        print(f"| {r.rank} | {r.busy_s:.4f} | {r.idle_s:.4f} | {100 * r.idle_s / max(r.busy_s + r.idle_s, 1e-12):.1f} "
              f"| {r.wait_s:.4f} | {r.send_s:.4f} | {r.other_s:.4f} |")
    print(f"measured bubble {m.measured_bubble:.4f}")
    print("mean cost per action (s): " + ", ".join(f"{k} {v:.5f}" for k, v in m.mean_cost_s.items()))
    if at_costs:
        print(f"planned bubble at the measured costs {at_costs.bubble_fraction:.4f} "
              f"(makespan {at_costs.makespan:.4f} s); at unit costs (F=1, B=2, I=W=1) {unit.bubble_fraction:.4f}")
    rows, span = measured_mod.last_window_rows(traces, width)
    print(f"\nlast iteration, measured ({span:.4f} s):")
    for t, row in zip(traces, rows):
        print(f"  rank {t.rank:>2} |{row}|")
    if at_costs and sched.num_ranks == len(traces):
        print(f"planned at the measured costs ({at_costs.makespan:.4f} s, same time axis):")
        for r, row in enumerate(planned_rows(at_costs, at_costs.makespan / max(span, 1e-12), width)):
            print(f"  rank {r:>2} |{row}|")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=registry.plan_names())
    ap.add_argument("-P", type=int, help="ring / pipeline ranks")
    ap.add_argument("-G", type=int, help="microbatches per WeiPipe rank")
    ap.add_argument("--from-trace", metavar="DIR", default=None,
                    help="measured busy/idle/bubble from pretrain_gpt.py --schedule-trace DIR")
    ap.add_argument("--json", action="store_true", help="with --from-trace: one JSON object")
    ap.add_argument("--width", type=int, default=100, help="characters of the text timelines")
    ap.add_argument("-N", type=int, default=None, help="Megatron microbatches (default G*P)")
    ap.add_argument("-V", type=int, default=2, help="virtual stages per rank for 'interleaved'")
    ap.add_argument("--png", default=None, help="write the drawn timeline here")
    args = ap.parse_args(argv)
    if args.from_trace:
        return from_trace(args.from_trace, args.json, args.width)
    if args.schedule is None or args.P is None or args.G is None:
        ap.error("--schedule, -P and -G are required without --from-trace")
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
