"""The planner's first choice in every link-testbed group, against what the testbed measured.

    python -m tools.plan --testbed-check [--calibration-dir DIR]   # (tools/plan.py passes the flags on)
    python -m tools.planner.testbed_check [--calibration-dir DIR] [--measure-link]

A group is one (preset, sequence, model shape, microbatches) of
docs/results/link-testbed.md's measured tables: two ranks over an emulated link. The planner's layouts for
it are those of its own space (space.py: the trainer's start-up code accepts them at two
ranks) that the testbed ran: PP = 2 under each measured pipeline schedule (interleaved at
2 virtual stages), and FSDP2 over DP = 2, plain and under each of its options. It ranks
them by the simulator with this host's costs, exactly as the simulator's testbed check
predicts a row (tools/simulator_validation/testbed_compare.py: layer timings of this host,
the emulated link as tc shapes it, FSDP2's and the training loop's fixed costs), at the
host FLOP/s its sweep recorded. Its first choice is a hit when it is the measured fastest,
or when its measured rounds overlap the fastest's (within the measured spread: the
measurement cannot order the two).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, replace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results", "link-testbed.md")
# the recorded sweep's probes (docs/results/simulator.md, "The link testbed"): host FLOP/s the
# presets were scaled by, gloo's CPU per byte, what a message waits beyond its bytes
RECORDED_FLOPS = 108.9e9
RECORDED_CPU_S_PER_BYTE = 0.51e-9
RECORDED_MESSAGE_S = 2.97e-3

_FLOPS = re.compile(r"^host: (\d+(?:\.\d+)?) GFLOP/s")  # the sweep's own, printed above its tables
_SHAPE = re.compile(r"layers=(\d+) hidden=(\d+) heads=(\d+) micro-batch 1, (\d+) microbatches/iteration")
_ROW = re.compile(r"^\| ([\w-]+) \| (\d+) \| ([\w-]+) \| (\d+) \[(\d+), (\d+)\] \|")


@dataclass(frozen=True)
class Group:
    preset: str
    seq: int
    layers: int
    hidden: int
    heads: int
    microbatches: int
    measured: tuple  # ((schedule, median, min, max), ...) tokens/s over rounds
    flops: float = RECORDED_FLOPS  # the host FLOP/s the sweep scaled its presets by

    def fastest(self) -> tuple:
        return max(self.measured, key=lambda m: m[1])

    def row(self, name: str) -> tuple:
        return next(m for m in self.measured if m[0] == name)


def measured_groups(text: str) -> list[Group]:
    """The groups of the testbed's measured tables (each table follows the line that states
    its shape; a sweep's `host: ... GFLOP/s` line, where printed, holds for its tables until
    the next section, else the recorded sweep's); skipped rows are not measurements."""
    groups: dict = {}
    shape, flops = None, RECORDED_FLOPS
    for line in text.splitlines():
        if line.startswith("## "):
            flops = RECORDED_FLOPS
        f = _FLOPS.match(line)
        if f:
            flops = float(f.group(1)) * 1e9
            continue
        m = _SHAPE.search(line)
        if m:
            shape = tuple(int(x) for x in m.groups())
            continue
        r = _ROW.match(line)
        if r and shape is not None:
            preset, seq, name, med, lo, hi = r.groups()
            key = (preset, int(seq), *shape, flops)
            groups.setdefault(key, []).append((name, float(med), float(lo), float(hi)))
    return [Group(k[0], k[1], *k[2:-1], measured=tuple(v), flops=k[-1]) for k, v in groups.items()]


def testbed_flags(g: Group) -> list[str]:
    """pretrain_gpt.py's flags of the testbed's model (tools/simulator_validation/link_testbed.py)."""
    return ["--num-layers", str(g.layers), "--hidden-size", str(g.hidden), "--num-attention-heads", str(g.heads),
            "--seq-length", str(g.seq), "--max-position-embeddings", str(g.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(g.microbatches), "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tokenizer-type", "ByteLevelTokenizer", "--mock-data", "--train-iters", "1", "--lr", "1e-4"]


def testbed_name(c) -> Optional[str]:
    """The testbed row a planner candidate is (None: a layout the testbed did not run): an
    FSDP2 row is the one whose trainer flags are the candidate's data-parallel mode's."""
    from megatron_weipipe.simulator.testbed import TESTBED_ROWS

    st = c.structure
    if c.rung.name != "none" or st.tp != 1 or st.cp != 1:
        return None
    if st.pp == 1 and st.dp == 2:
        layers = c.config.model.num_layers
        return next((n for n, row in TESTBED_ROWS.items() if row.is_fsdp and set(st.mode.flags)
                     == set(row.trainer_flags(layers)) - {"--pipeline-model-parallel-size", "1"}), None)
    if st.pp == 2 and st.mode.name == "ddp":
        if st.virtual_layers is not None and st.virtual_layers * 4 != c.config.model.num_layers:
            return None  # the testbed's interleaved runs 2 virtual stages per rank
        return st.schedule
    return None


def candidates(g: Group) -> dict:
    """{testbed schedule: candidate} of the planner's space at the group's two ranks."""
    from .space import DATA_PARALLEL_MODES, Rung, accepted, structures

    base = testbed_flags(g)
    out = {}
    for st in structures(2, 2, g.layers, modes=DATA_PARALLEL_MODES):
        c = accepted(base, st, Rung("none", ()), 2)
        if c is not None:
            name = testbed_name(c)
            if name is not None and any(m[0] == name for m in g.measured):
                out[name] = c
    return out


def _compare_args(argv):
    from tools.simulator_validation import testbed_compare

    return testbed_compare._parser().parse_args(argv)


def check(groups: list[Group], calibration_dirs: list[str], measure_link: bool = False, repeats: int = 3) -> list[dict]:
    """Per group: the planner's ranking (predicted tokens/s of each layout) and the verdict."""
    from tools.simulator_validation import testbed_compare

    a = _compare_args(["--flops", str(RECORDED_FLOPS), "--no-latency", "--repeats", str(repeats),
                       "--calibration-dir", *calibration_dirs]
                      + (["--measure-link"] if measure_link else ["--message-delay-us", str(RECORDED_MESSAGE_S * 1e6)]))
    probes = testbed_compare._probes(a, True, {})
    if not measure_link:
        probes.cpu_s_per_byte = RECORDED_CPU_S_PER_BYTE
    from megatron_weipipe.simulator.testbed import TestbedShape

    out = []
    for g in groups:
        shape = TestbedShape(g.layers, g.hidden, g.heads, g.microbatches)
        predicted = {}
        for name, cand in candidates(g).items():
            row = {"preset": g.preset, "seq": g.seq, "schedule": name, "layers": g.layers, "hidden": g.hidden,
                   "heads": g.heads, "microbatches": g.microbatches}
            res, _ = testbed_compare._predict_row(row, a, shape, replace(probes, flops=g.flops), set())
            predicted[name] = (res.tokens_per_s, cand)
        out.append(verdict(g, {k: v[0] for k, v in predicted.items()}))
        out[-1]["launch"] = predicted[out[-1]["choice"]][1].flags
    return out


def verdict(g: Group, predicted: dict) -> dict:
    """The first choice (fastest predicted) against the measured fastest: exact, within the
    measured spread (its rounds overlap the fastest's), or a miss."""
    choice = max(predicted, key=predicted.get)
    best = g.fastest()
    mine = g.row(choice)
    if choice == best[0]:
        status = "exact"
    elif mine[3] >= best[2]:
        status = "within spread"
    else:
        status = "miss"
    return {"group": g, "predicted": predicted, "choice": choice, "fastest": best[0], "status": status,
            "margin": mine[1] / best[1] - 1}


def report(rows: list[dict]) -> str:
    lines = ["| preset | seq | layers | microbatches | planner's first choice (predicted tokens/s) | measured fastest "
             "(median [min, max]) | choice measured | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["group"]
        best, mine = g.fastest(), g.row(r["choice"])
        lines.append(f"| {g.preset} | {g.seq} | {g.layers} | {g.microbatches} | {r['choice']} "
                     f"({r['predicted'][r['choice']]:.0f}) | {best[0]} ({best[1]:.0f} [{best[2]:.0f}, {best[3]:.0f}]) "
                     f"| {mine[1]:.0f} [{mine[2]:.0f}, {mine[3]:.0f}] ({r['margin']:+.1%}) | {r['status']} |")
    hits = sum(r["status"] != "miss" for r in rows)
    exact = sum(r["status"] == "exact" for r in rows)
    lines.append(f"\nfirst choice a hit in {hits}/{len(rows)} groups ({exact} the measured fastest, "
                 f"{hits - exact} within the measured spread)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=RESULTS, help="the testbed's measured tables (markdown)")
    ap.add_argument("--calibration-dir", nargs="+", default=["/tmp/testbed_calibrations"],
                    help="this host's microbenchmarks (timed into it where missing)")
    ap.add_argument("--measure-link", action="store_true",
                    help="probe gloo here instead of the sweep's recorded CPU per byte and message wait")
    ap.add_argument("--repeats", type=int, default=3)
    a, _ = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    with open(a.results) as f:
        groups = measured_groups(f.read())
    rows = check(groups, a.calibration_dir, a.measure_link, a.repeats)
    print(report(rows))
    return 0 if all(r["status"] != "miss" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
