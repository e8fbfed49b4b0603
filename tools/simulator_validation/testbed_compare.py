#!/usr/bin/env python
"""Measured (the link testbed's --json) vs predicted tokens/s of every testbed row.

    python -m tools.simulator_validation.testbed_compare --testbed-json rows.json \
        [--flops HOST_FLOPS] [--calibration-dir DIR [DIR ...]] [--repeats 3] [--measure-link] \
        [--layers 2 --hidden 32 --heads 2 --microbatches 4]     # the testbed's shape flags

The prediction (megatron_weipipe/simulator/testbed.py) uses only microbenchmarks of this
host:
- one calibration per sequence length of the testbed's model (megatron_weipipe/training/host_calibration.py:
  layer forward / backward, embedding, head, optimizer step), saved in --calibration-dir
  and reused. Several directories, e.g. timed before and after the sweep, are averaged,
  since this host's speed drifts by some 10% over tens of minutes;
- the testbed's own preset arithmetic (testbed_presets.py: emulated rate and latency
  from the host's matmul FLOP/s, --flops or measured the way the testbed measures it);
- the trainer's fixed costs (fsdp2_overhead.py): FSDP2's per unit and pass, and the
  training loop's per iteration (--no-loop leaves the loop's out);
- with --measure-link, gloo's CPU cost per byte (the link probe) and what a message waits
  beyond its bytes (message_delay.py).
A --save file of a sweep that calibrated in-run (link_testbed.py --calibrate-repeats,
the default) holds, per preset and sequence, each rank's layer timings from the minute
before that sequence's runs. Those replace the directories' layer, embedding and head
timings; the optimizer step and the other microbenchmarks still come from the directories
(--no-in-run ignores the in-run timings). The measured rows are read, never fitted.

Reads the `--json` list or a `--save` file (rows, the host FLOP/s the testbed scaled by,
and its notes: without tc netem it shapes the rate alone, and the prediction then leaves
the latency out, as `--no-latency` does). Per row: measured and predicted tokens/s (the
prediction from the mean of the calibration sets, with the range the sets give one by
one), the error, bytes sent measured / predicted, and whether the order of the schedules
(fastest first) at that preset and sequence is the same for every pair that both sides
order: a pair whose measured rounds overlap, or whose predictions from the calibration
sets overlap, is a tie. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def calibration_for(seq: int, shape, directory: str, repeats: int):
    """This host's timings of the testbed model at `seq` (a 1F1B stage's layers), cached."""
    from megatron_weipipe.simulator import calibration as calib

    path = os.path.join(directory, f"testbed-L{shape.layers}-h{shape.hidden}-a{shape.heads}-s{seq}.json")
    if os.path.exists(path):
        return calib.load(path)
    from megatron_weipipe.training import host_calibration

    cal = host_calibration.calibrate(shape.model(seq), max(1, shape.layers // 2), repeats=repeats)
    calib.save(cal, path)
    return cal


def _trainer_probe_paths(shape, directory: str, row: str = "fsdp") -> dict:
    """The cached probes: FSDP2's fixed costs of the testbed row ``row`` (plain FSDP2, or
    under its options), the training loop's seconds per iteration."""
    name = f"L{shape.layers}-h{shape.hidden}-a{shape.heads}.json"
    fsdp2 = "fsdp2" if row == "fsdp" else f"fsdp2-{row}"
    return {"fsdp2": os.path.join(directory, f"{fsdp2}-{name}"), "loop": os.path.join(directory, f"loop-{name}")}


def _probe_trainer(shape, directory: str, row: str = "fsdp") -> None:
    """Time fsdp2_overhead.py here for the FSDP2 row ``row`` (over a veth pair as the
    testbed runs where namespaces are permitted, else loopback) and write what the directory
    lacks of its two results: FSDP2's fixed costs and the training loop's seconds per iteration."""
    from tools.simulator_validation import fsdp2_overhead, netns

    args = ["--layers", str(shape.layers), "--hidden", str(shape.hidden), "--heads", str(shape.heads), "--rounds", "4",
            "--row", row]
    veth = ["--netns"] if netns.available() is None else []  # None: namespaces are permitted here
    over, res = fsdp2_overhead.fsdp2_overhead(fsdp2_overhead.parse_args(args + veth))
    paths = _trainer_probe_paths(shape, directory, row)
    for kind, text in (("fsdp2", over.to_json()), ("loop", json.dumps({"seconds": res["loop_s"]}))):
        if not os.path.exists(paths[kind]):
            with open(paths[kind], "w") as f:
                f.write(text)


def fsdp2_for(shape, directory: str, row: str = "fsdp"):
    """FSDP2's fixed costs of the testbed's model on this host under the FSDP2 row ``row``,
    cached (`_probe_trainer`)."""
    from megatron_weipipe.simulator.calibration import Fsdp2Overhead

    path = _trainer_probe_paths(shape, directory, row)["fsdp2"]
    if not os.path.exists(path):
        _probe_trainer(shape, directory, row)
    with open(path) as f:
        return Fsdp2Overhead.from_json(f.read())


def loop_for(shape, directory: str) -> float:
    """The training loop's own seconds per iteration on this host, cached (`_probe_trainer`)."""
    path = _trainer_probe_paths(shape, directory)["loop"]
    if not os.path.exists(path):
        _probe_trainer(shape, directory)
    with open(path) as f:
        return json.load(f)["seconds"]


def message_delay_for(directory: str, probes: int = 3) -> float:
    """What a gloo message waits here beyond its bytes (message_delay.py: the median of
    ``probes`` runs' means, over a veth pair where namespaces are permitted), cached."""
    import statistics

    from tools.simulator_validation import message_delay, netns

    path = os.path.join(directory, "message-delay.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["seconds"]
    a = message_delay.parse_args(["--reps", "60"] + ([] if netns.available() is None else ["--loopback"]))
    means = [message_delay.mean_delay(message_delay.measure(a.sizes, a.compute_ms, a.reps, a.loopback))
             for _ in range(probes)]
    with open(path, "w") as f:
        json.dump({"seconds": statistics.median(means), "probe_means": means, "loopback": a.loopback}, f)
    return statistics.median(means)


def in_run_calibrations(saved: dict) -> dict:
    """{(preset, seq): [HostCalibration per rank]} from a --save file's "calibrations"."""
    from megatron_weipipe.simulator.calibration import HostCalibration

    return {(preset, int(seq)): [HostCalibration.from_json(json.dumps(c)) for c in ranks]
            for preset, by_seq in saved.items() for seq, ranks in by_seq.items()}


def table(compared: list[dict], predicted_bytes: dict, predicted_work: dict) -> str:
    lines = ["| preset | seq | microbatches | schedule | measured tokens/s | predicted [over calibration sets] | "
             "error | MiB sent/rank/iter measured / "
             "predicted | computing s/iter measured / predicted (slowest rank) | order of schedules |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in compared:
        key = (r["preset"], r["seq"], r["microbatches"], r["schedule"])
        sent = "-" if r["bytes_sent"] is None else f"{r['bytes_sent'] / 2**20:.2f}"
        busy = "-" if r["computing_s"] is None else f"{r['computing_s']:.2f}"
        lo, hi = r["predicted_range"]
        lines.append(f"| {r['preset']} | {r['seq']} | {r['microbatches']} | {r['schedule']} | {r['measured']:.0f} "
                     f"| {r['predicted']:.0f} "
                     f"[{lo:.0f}, {hi:.0f}] | "
                     f"{r['error']:+.1%} | {sent} / {predicted_bytes[key] / 2**20:.2f} | "
                     f"{busy} / {predicted_work[key]:.2f} | {'same' if r['order_matches'] else 'DIFFERS'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from megatron_weipipe.simulator.testbed import TestbedShape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--testbed-json", help="python -m tools.simulator_validation.link_testbed --json output")
    ap.add_argument("--predict", nargs="+", metavar="PRESET:SEQ",
                    help="without --testbed-json: only the predicted rows of these presets and sequences")
    ap.add_argument("--flops", type=float, default=None, help="host FLOP/s the testbed scaled by (default: measured)")
    ap.add_argument("--calibration-dir", nargs="+", default=["/tmp/testbed_calibrations"],
                    help="where this host's microbenchmarks are cached (timed into it where missing); several "
                         "are averaged (e.g. timed before and after the sweep)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--testbed-root", default=ROOT,
                    help="the checkout whose testbed_presets.py holds the presets (default: this one)")
    ap.add_argument("--no-latency", action="store_true",
                    help="the testbed shaped the rate alone (no tc netem): predict without the emulated latency "
                         "(read from the notes of a --save file)")
    ap.add_argument("--measure-link", action="store_true",
                    help="probe gloo here: its CPU cost per byte (host_calibration's link probe) and what a "
                         "message waits beyond its bytes (message_delay.py)")
    ap.add_argument("--message-delay-us", type=float, default=None,
                    help="what a message waits beyond its bytes, instead of the probe's (default without "
                         "--measure-link: 0)")
    ap.add_argument("--no-loop", action="store_true",
                    help="leave out the training loop's own time per iteration (fsdp2_overhead.py's DDP runs)")
    ap.add_argument("--no-in-run", action="store_true",
                    help="ignore the --save file's in-run calibrations: layer timings from the directories alone")
    ap.add_argument("--layers", type=int, default=TestbedShape.layers, help="the testbed's --layers")
    ap.add_argument("--hidden", type=int, default=TestbedShape.hidden, help="the testbed's --hidden")
    ap.add_argument("--heads", type=int, default=TestbedShape.heads, help="the testbed's --heads")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="the batch of rows that do not state theirs (a sweep from before --microbatches took several)")
    return ap


def _read_rows(a) -> tuple[list, bool, dict]:
    """The rows to predict (--testbed-json's, or --predict's placeholders), whether the
    testbed left the latency out, and the --save file's in-run calibrations. A --save
    file's host FLOP/s fills ``a.flops`` where the flags give none."""
    from megatron_weipipe.errors import SimulatorError

    no_latency, in_run = a.no_latency, {}
    if a.testbed_json:
        with open(a.testbed_json) as f:
            rows = json.load(f)
        if isinstance(rows, dict) and "rows" in rows:  # --save's file: rows, the host FLOP/s, notes
            a.flops = a.flops or rows.get("flops")
            no_latency = no_latency or any("latency is not applied" in n for n in rows.get("notes", ()))
            in_run = {} if a.no_in_run else in_run_calibrations(rows.get("calibrations", {}))
            rows = rows["rows"]
    elif a.predict:
        from megatron_weipipe.simulator.testbed import TESTBED_ROWS

        names = [n for n, row in TESTBED_ROWS.items() if not row.virtual_stages or a.layers % 4 == 0]
        rows = [{"preset": ps.partition(":")[0], "seq": int(ps.partition(":")[2]), "schedule": n,
                 "tokens_per_s": float("nan"), "bytes_sent": None} for ps in a.predict for n in names]
    else:
        raise SimulatorError("give --testbed-json FILE, or --predict PRESET:SEQ ...")
    if not isinstance(rows, list) or not all({"preset", "seq", "schedule", "tokens_per_s"} <= set(r) for r in rows):
        raise SimulatorError(f"{a.testbed_json}: not a list of rows with preset, seq, schedule, tokens_per_s")
    for r in rows:  # a sweep from before the testbed took several batches ran the one of the flags
        r.setdefault("microbatches", a.microbatches)
    return rows, no_latency, in_run


def _presets(testbed_root: str):
    """The testbed's preset arithmetic of the checkout at ``testbed_root``: this checkout's
    module, or another checkout's tools/simulator_validation/testbed_presets.py, loaded by its path."""
    from megatron_weipipe.errors import SimulatorError

    if os.path.realpath(testbed_root) == os.path.realpath(ROOT):
        from tools.simulator_validation import testbed_presets
        return testbed_presets
    import importlib.util

    path = os.path.join(testbed_root, "tools", "simulator_validation", "testbed_presets.py")
    if not os.path.exists(path):
        raise SimulatorError(f"{path} (the testbed's preset arithmetic) is not in that checkout")
    spec = importlib.util.spec_from_file_location("testbed_presets_of_testbed_root", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class _Probes:
    """What every row's prediction shares: the host's and link's microbenchmarks."""

    presets: dict
    flops: float
    burst: float
    cpu_s_per_byte: float
    waits: list
    message_s: float
    no_latency: bool
    in_run: dict


def _probes(a, no_latency: bool, in_run: dict) -> _Probes:
    presets = _presets(a.testbed_root)
    flops = a.flops or presets.host_flops()
    for d in a.calibration_dir:
        os.makedirs(d, exist_ok=True)
    burst = presets.TBF_BURST_BYTES if no_latency else 0.0  # without netem the testbed shapes the rate with tbf
    cpb, waits = 0.0, [0.0] * len(a.calibration_dir)
    if a.measure_link:
        from megatron_weipipe.training import host_calibration

        cpb = host_calibration.gloo_link().cpu_s_per_byte
        waits = [message_delay_for(d) for d in a.calibration_dir]
    if a.message_delay_us is not None:
        waits = [a.message_delay_us * 1e-6] * len(a.calibration_dir)
    return _Probes(presets.PRESETS, flops, burst, cpb, waits, sum(waits) / len(waits), no_latency, in_run)


def _predict_row(r: dict, a, shape, p: _Probes, loop_seen: set):
    """One row's prediction from the mean of the calibration sets, and the tokens/s of each set."""
    from megatron_weipipe.errors import SimulatorError
    from megatron_weipipe.simulator import calibration as calib
    from megatron_weipipe.simulator.calibration import Fsdp2Overhead
    from megatron_weipipe.simulator.testbed import TestbedShape, predict_testbed_row, testbed_row

    if r["preset"] not in p.presets:
        raise SimulatorError(f"row preset {r['preset']!r} is not one of {', '.join(p.presets)}")
    rate, latency = p.presets[r["preset"]].emulated(p.flops)
    latency = 0.0 if p.no_latency else latency
    row_shape = TestbedShape(*(int(r.get(k, v)) for k, v in (
        ("layers", shape.layers), ("hidden", shape.hidden), ("heads", shape.heads),
        ("microbatches", shape.microbatches))))  # a row that states its shape wins over the flags
    cals = [calibration_for(r["seq"], row_shape, d, a.repeats) for d in a.calibration_dir]
    fsdp = testbed_row(r["schedule"]).is_fsdp
    fsdp2s = [fsdp2_for(row_shape, d, r["schedule"]) if fsdp else None for d in a.calibration_dir]
    loops = [0.0 if a.no_loop else loop_for(row_shape, d) for d in a.calibration_dir]
    loop_seen.add(sum(loops) / len(loops))

    def predict(cal, fsdp2, wait, loop):
        return predict_testbed_row(r["schedule"], r["seq"], rate, latency, cal, row_shape,
                                   cpu_s_per_byte=p.cpu_s_per_byte, burst_bytes=p.burst, fsdp2=fsdp2,
                                   message_s=wait, loop_s=loop)

    fsdp2 = Fsdp2Overhead.mean_of(fsdp2s) if fsdp else None
    # one calibration set per directory, and per round of its FSDP2 probe (the probe's spread)
    sets = [(cal, each, wait, loop) for cal, f2, wait, loop in zip(cals, fsdp2s, p.waits, loops)
            for each in (f2.each_round() if f2 else [None])]
    ranks = p.in_run.get((r["preset"], r["seq"]))
    if ranks:  # the layers timed in the minute before this sequence's runs; the step from the directories
        if ranks[0].shape != row_shape.model(r["seq"]):
            raise SimulatorError(f"{r['preset']} {r['seq']}: the in-run calibration is of another shape")
        sets = [(replace(c, optimizer_per_param=cal.optimizer_per_param), *rest) for c in ranks
                for cal, *rest in sets]  # rank x directory
    res = predict(calib.mean_of([s[0] for s in sets]), fsdp2, p.message_s, sum(loops) / len(loops))
    return res, [predict(*one).tokens_per_s for one in sets]


def _print_predicted(predicted: dict, pbytes: dict, pwork: dict, command: str) -> None:
    print(f"# {command}")
    print("| preset | seq | microbatches | schedule | predicted tokens/s | x 1F1B | MiB sent/rank/iter | "
          "computing s/iter |")
    print("|---|---|---|---|---|---|---|---|")
    for key, tps in predicted.items():
        preset, seq, mb, name = key
        base = predicted.get((preset, seq, mb, "1f1b"))
        print(f"| {preset} | {seq} | {mb} | {name} | {tps:.0f} | {f'{tps / base:.2f}' if base else '-'} | "
              f"{pbytes[key] / 2**20:.2f} | {pwork[key]:.2f} |")


def _print_compared(compared: list, pbytes: dict, pwork: dict, a, p: _Probes, loop_seen: set, command: str) -> None:
    print(f"# {command}")
    print(f"# host {p.flops / 1e9:.1f} GFLOP/s; calibrations in {' + '.join(a.calibration_dir)} (CPU seconds, one "
          f"thread{', averaged' if len(a.calibration_dir) > 1 else ''})"
          f"{f', layer timings in-run ({len(p.in_run)} preset-sequences, each rank)' if p.in_run else ''}; "
          f"gloo CPU {p.cpu_s_per_byte * 1e9:.2f} ns per byte; {p.message_s * 1e3:.2f} ms per message beyond its "
          f"bytes; training loop {' / '.join(f'{x * 1e3:.2f}' for x in sorted(loop_seen))} ms per iteration; "
          f"emulated latency {'not applied' if p.no_latency else 'applied'}"
          f"{f', tc tbf burst {p.burst / 1024:.0f} KiB' if p.burst else ''}")
    print(table(compared, pbytes, pwork))
    errs = [abs(r["error"]) for r in compared]
    if errs:
        groups = {(r["preset"], r["seq"], r["microbatches"]): r for r in compared}
        checked = sum(r["pairs"][0] for r in groups.values())
        print(f"\nrows: {len(errs)}; |error| median {sorted(errs)[len(errs) // 2]:.1%}, max {max(errs):.1%}; "
              f"within 15%: {sum(e <= 0.15 for e in errs)}/{len(errs)}; order of schedules the same in "
              f"{sum(r['order_matches'] for r in groups.values())}/{len(groups)} (preset, seq, microbatches) groups "
              f"({sum(r['pairs'][1] for r in groups.values())} of the {checked} pairs that both the rounds and the "
              f"calibration sets separate ordered alike)")


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_weipipe.errors import SimulatorError
    from megatron_weipipe.simulator.testbed import TestbedShape, compare_rows, row_key

    a = _parser().parse_args(argv)
    try:
        rows, no_latency, in_run = _read_rows(a)
        probes = _probes(a, no_latency, in_run)
        shape = TestbedShape(a.layers, a.hidden, a.heads, a.microbatches)
        predicted, spread, pbytes, pwork, loop_seen = {}, {}, {}, {}, set()
        for r in rows:
            if not r.get("tokens_per_s"):
                continue
            res, each = _predict_row(r, a, shape, probes, loop_seen)
            key = row_key(r)
            predicted[key] = res.tokens_per_s
            spread[key] = (res.tokens_per_s, min(each), max(each))
            pbytes[key] = sum(sum(c.values()) for c in res.counter) / len(res.counter)  # the mean over ranks, as the testbed reports
            pwork[key] = max(res.work)
    except (OSError, ValueError, RuntimeError, SimulatorError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = f"python -m tools.simulator_validation.testbed_compare {' '.join(sys.argv[1:] if argv is None else argv)}"
    if not a.testbed_json:
        _print_predicted(predicted, pbytes, pwork, command)
        return 0
    _print_compared(compare_rows(rows, spread), pbytes, pwork, a, probes, loop_seen, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
