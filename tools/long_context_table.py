#!/usr/bin/env python
"""Long-context settings counted by the dry run: does each fit, and the longest that does.

    python -m tools.long_context_table headline [--rows 1m-1gpu 2m 4m 16m] [--sharding dist-opt|fsdp2] [--jobs N]
    python -m tools.long_context_table single-rank [--start 65536]       # 8B on 1 rank of 80 GB
    python -m tools.long_context_table single-rank --state-on-host --chunk 16384 --host-budget-gb 250
    python -m tools.long_context_table small --budget-gb 2 [--jobs N]     # h=256 L=4: longest S per attention

Every figure comes from `python -m tools.dry_run --json` run as a subprocess (accelerator bytes by
role, host bytes of the offload pools, sent bytes, and the simulator's estimator beside
them). "Fits" means the dry run's accelerator peak is at most the budget (80 GB = 80e9 B
for the headline) and the host bytes at most the rank's share of a node's RAM (a DGX H100:
8 GPUs, 2 TB; a job of n < 8 ranks has the node to itself, so 2 TB / n each; 250 GB per
rank from 8 on). Each row names the limit that stops it: device, host or none. The longest sequence is bisected: doubling from a start until
a length does not fit, then halving the gap on a grid of `lower / --refine` tokens.
Each row prints the exact dry-run command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
NODE_RAM = 2e12  # DGX H100: 2 TB of system memory, 8 GPUs
GPUS_PER_NODE = 8
CATS = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers", "fpdt_chunk_state")

LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
             "--num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256 --tokenizer-type NullTokenizer "
             "--mock-data --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16 "
             "--micro-batch-size 1 --global-batch-size 1 --lr 1e-4 --train-iters 1").split()
RECOMPUTE_OFFLOAD = "--recompute-granularity full --recompute-method uniform --offload-layer-inputs".split()
STATE_ON_HOST = ["--use-torch-fsdp2", "--optimizer-cpu-offload"]  # FSDP2's CPUOffloadPolicy: weights, grads, Adam
SHARDING = {"dist-opt": ["--use-distributed-optimizer"], "fsdp2": ["--use-torch-fsdp2"], "none": []}
SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --position-embedding-type rope "
         "--tokenizer-type ByteLevelTokenizer "
         "--mock-data --hidden-dropout 0 --attention-dropout 0 --bf16 --micro-batch-size 1 "
         "--global-batch-size 1 --lr 1e-4 --train-iters 1").split()


def seq_flags(s: int) -> list[str]:
    return ["--seq-length", str(s), "--max-position-embeddings", str(s)]


def fpdt_flags(s: int, cp: int, chunk: int) -> list[str]:
    return ["--context-parallel-size", str(cp), "--fpdt", "--fpdt-chunk-size", str(min(chunk, s)), "--fpdt-offload"]


def command(flags: list[str], world: int, attention: str) -> list[str]:
    return [sys.executable, "-m", "tools.dry_run", *flags, "--world-size", str(world), "--rank", "0",
            "--attention", attention, "--json"]


def show(cmd: list[str]) -> str:
    return "python -m tools.dry_run " + shlex.join(cmd[3:])


def dry_run(flags: list[str], world: int, attention: str = "flash", timeout: float = 3600) -> dict:
    """One dry run; its JSON plus the command and the wall seconds of the subprocess."""
    cmd = command(flags, world, attention)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    wall = time.time() - t0
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"dry run exited {p.returncode}: {tail}\n  {show(cmd)}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out.update(command=show(cmd), wall_s=round(wall, 1), world=world)
    return out


def with_layers(flags: list[str], n: int) -> list[str]:
    i = flags.index("--num-layers")
    return flags[:i + 1] + [str(n)] + flags[i + 2:]


def _numbers(r: dict, prefix=""):
    for k, v in r.items():
        if isinstance(v, dict):
            yield from _numbers(v, f"{prefix}{k}.")
        elif isinstance(v, int) and not isinstance(v, bool) and k not in ("rank", "world_size", "world"):
            yield prefix + k, v


def _put(r: dict, key: str, v: int) -> None:
    *path, last = key.split(".")
    for p in path:
        r = r[p]
    r[last] = v


def scaled_run(flags: list[str], world: int, layers: int, probes=(1, 2, 3), attention="flash", timeout=3600,
               jobs: int = 3) -> dict:
    """The dry run of `layers` layers from runs at `probes` layers (equal steps), used only
    where every count is affine in the layer count: each figure's differences between
    consecutive probes must be equal to the byte; the figure is then extended to `layers`.
    Adds `scaling`: the probes, the figures that were not exactly affine (left unscaled:
    the row then says so), and the probe commands."""
    with ThreadPoolExecutor(jobs) as ex:
        runs = list(ex.map(lambda n: dry_run(with_layers(flags, n), world, attention, timeout), probes))
    step = probes[1] - probes[0]
    assert all(b - a == step for a, b in zip(probes, probes[1:])), "probes must be equally spaced"
    out = json.loads(json.dumps(runs[-1]))
    inexact = []
    series = [dict(_numbers(r)) for r in runs]
    for key, last in series[-1].items():
        vals = [sv[key] for sv in series]
        diffs = {b - a for a, b in zip(vals, vals[1:])}
        if len(diffs) != 1:
            inexact.append(key)
            continue
        _put(out, key, last + diffs.pop() * (layers - probes[-1]) // step)
    out["wall_s"] = round(sum(r["wall_s"] for r in runs), 1)
    out["command"] = show(command(flags, world, attention))
    out["scaling"] = {"probes": list(probes), "inexact": inexact, "commands": [r["command"] for r in runs],
                      "figures": [{k: r[k] for k in ("peak_accelerator_bytes", "host_bytes", "sent_bytes")}
                                  | {"activations": r["categories"]["activations"]} for r in runs]}
    if "peak_accelerator_bytes" in inexact:  # state scaled exactly + the last probe's other roles at its peak
        out["peak_accelerator_bytes"] = sum(out["categories"].values())
        out["scaling"]["peak_composed"] = True
    return out


def bisect_longest(fits, start: int, refine: int = 8, limit: int = 1 << 26):
    """Longest n in the grid for which fits(n) holds, assuming fits is monotone (true then
    false). Doubles (or halves) from `start` to bracket [ok, bad), then bisects on a grid of
    ok / refine. Returns (longest fitting or 0, shortest seen not fitting or None, trace)."""
    trace = []

    def probe(n):
        r = bool(fits(n))
        trace.append((n, r))
        return r

    ok, bad, n = 0, None, start
    if probe(n):
        ok = n
        while n * 2 <= limit:
            n *= 2
            if not probe(n):
                bad = n
                break
            ok = n
        if bad is None:
            return ok, None, trace
    else:
        bad = n
        while n > 1 and ok == 0:
            n //= 2
            if n < max(1, start >> 4):
                return 0, bad, trace
            if probe(n):
                ok = n
            else:
                bad = n
    step = max(1, ok // refine)
    while bad - ok > step:
        mid = ok + ((bad - ok) // 2 // step) * step
        if mid <= ok:
            break
        if probe(mid):
            ok = mid
        else:
            bad = mid
    return ok, bad, trace


def headline_rows(sharding: str, chunk: int, chunk_16m: int = 262144) -> dict:
    """name -> (label, flags, world). 1m-1gpu always keeps the model state on the host (the
    one way 8B fits one 80 GB rank); 16m is CP 32 over 4 nodes."""
    base = LLAMA3_8B + RECOMPUTE_OFFLOAD + SHARDING[sharding]
    one = LLAMA3_8B + RECOMPUTE_OFFLOAD + STATE_ON_HOST
    return {
        "1m-1gpu": ("8B, 1M tokens, 1 GPU, state on host", one + seq_flags(1 << 20) + fpdt_flags(1 << 20, 1, 16384), 1),
        "2m": ("8B, 2M tokens, 4 ranks", base + seq_flags(1 << 21) + fpdt_flags(1 << 21, 4, chunk), 4),
        "4m": ("8B, 4M tokens, 8 ranks", base + seq_flags(1 << 22) + fpdt_flags(1 << 22, 8, 2 * chunk), 8),
        "16m": ("8B, 16M tokens, 32 ranks", base + seq_flags(1 << 24) + fpdt_flags(1 << 24, 32, chunk_16m), 32),
    }


def host_budget(world: int) -> float:
    """A rank's share of one node's RAM: the job's ranks on a node split its 2 TB."""
    return NODE_RAM / min(world, GPUS_PER_NODE)


def stopped_by(r: dict, budget: float, host: float | None = None) -> str:
    """Which limit a row breaks: 'device', 'host', both, or 'none' (it fits)."""
    host = host_budget(r["world"]) if host is None else host
    over = [n for n, bad in (("device", r["peak_accelerator_bytes"] > budget), ("host", r["host_bytes"] > host)) if bad]
    return " and ".join(over) or "none"


def row_lines(name: str, r: dict, budget: float, host: float | None = None) -> list[str]:
    e = r["estimator"]
    per_node = r["host_bytes"] * min(r["world"], GPUS_PER_NODE)
    eight = (f"; {GPUS_PER_NODE // r['world']} such jobs: {r['host_bytes'] * GPUS_PER_NODE / GB:.1f} GB"
             if r["world"] < GPUS_PER_NODE else "")
    cats = ", ".join(f"{c} {r['categories'][c] / GB:.1f} ({e['categories'][c] / GB:.1f})" for c in CATS)
    fits = "yes" if r["peak_accelerator_bytes"] <= budget else "no"
    top = max(CATS, key=lambda c: r["categories"][c])
    return [f"| {name} | {r['peak_accelerator_bytes']} ({r['peak_accelerator_bytes'] / GB:.1f} GB) | "
            f"{e['peak_accelerator_bytes'] / GB:.1f} GB | {cats} | {r['host_bytes'] / GB:.1f} GB "
            f"({e['host_bytes'] / GB:.1f} GB) | {per_node / GB:.1f} GB of {NODE_RAM / GB:.0f} GB: "
            f"{'yes' if per_node <= NODE_RAM else 'no'}{eight} | {r['sent_bytes'] / GB:.1f} GB "
            f"({e['sent_bytes'] / GB:.1f} GB) | {fits} (largest: {top}) | {stopped_by(r, budget, host)} | "
            f"{r['wall_s']:.0f} s |",
            f"  `{r['command']}`"] + ([
            f"  (scaled to 32 layers from dry runs of {r['scaling']['probes']} layers; not exactly affine, so "
            f"taken from the last probe: {r['scaling']['inexact'] or 'none'}; per probe (peak, activations, "
            f"host, sent GB): {_probe_figures(r)}"
            + ("; peak = the scaled state + the last probe's other roles at its peak" if
               r["scaling"].get("peak_composed") else "") + ")"] if "scaling" in r else [])


def _probe_figures(r: dict) -> str:
    return ", ".join("(" + " / ".join(f"{f[k] / GB:.1f}" for k in ("peak_accelerator_bytes", "activations",
                                                                     "host_bytes", "sent_bytes")) + ")"
                     for f in r["scaling"]["figures"])


HEAD = ("| setting | accelerator peak, dry run | estimator | per role, GB: dry run (estimator) | host per rank "
        "(estimator) | host per node (DGX H100, 2 TB) | sent (estimator) | fits 80 GB? | stopped by | dry-run wall |\n"
        "|---|---|---|---|---|---|---|---|---|---|")


def run_row(flags, world, a) -> dict:
    if a.scale_from:
        return scaled_run(flags, world, int(flags[flags.index("--num-layers") + 1]), tuple(a.scale_from),
                          timeout=a.timeout)
    return dry_run(flags, world, timeout=a.timeout)


def cmd_headline(a) -> int:
    rows = headline_rows(a.sharding, a.chunk, a.chunk_16m)
    todo = [k for k in a.rows]
    with ThreadPoolExecutor(a.jobs) as ex:
        res = dict(zip(todo, ex.map(lambda k: run_row(rows[k][1], rows[k][2], a), todo)))
    print(f"sharding: {a.sharding} (1m-1gpu: {' '.join(STATE_ON_HOST)}); FPDT chunk {a.chunk} tokens at 2M, "
          f"{2 * a.chunk} at 4M, {a.chunk_16m} at 16M, 16384 at 1M on 1 GPU; --fpdt-offload, full recompute, "
          f"--offload-layer-inputs, --attention flash; budget 80e9 B, host 2 TB per node of 8 GPUs")
    print(HEAD)
    for k in todo:
        print("\n".join(row_lines(rows[k][0], res[k], 80 * GB)))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f)
    return 0


def cmd_single_rank(a) -> int:
    base = LLAMA3_8B + RECOMPUTE_OFFLOAD + (STATE_ON_HOST if a.state_on_host else [])
    host = a.host_budget_gb * GB if a.host_budget_gb else NODE_RAM
    seen = {}

    def counted(r):  # with --state-off-accelerator: less the gradients and optimizer state at the peak
        off = r["categories"]["gradients"] + r["categories"]["optimizer_state"] if a.state_off_accelerator else 0
        return r["peak_accelerator_bytes"] - off

    def ok_at(s):
        return counted(seen[s]) <= 80 * GB and seen[s]["host_bytes"] <= host

    def fits(s):
        seen[s] = run_row(base + seq_flags(s) + fpdt_flags(s, 1, a.chunk), 1, a)
        return ok_at(s)

    first = fits(a.start)
    state = sum(seen[a.start]["categories"][c] for c in ("parameters", "gradients", "optimizer_state"))
    if not a.state_off_accelerator and state > 80 * GB:
        ok, bad, trace = 0, a.start, [(a.start, first)]
        print(f"model state alone is {state / GB:.1f} GB on the accelerator (> 80 GB, the same at every "
              f"length): no sequence fits")
    else:
        ok, bad, trace = bisect_longest(lambda s: ok_at(s) if s in seen else fits(s), a.start, a.refine, a.limit)
    what = "peak less gradients and optimizer state" if a.state_off_accelerator else "accelerator peak"
    print(f"8B on 1 rank{' (' + ' '.join(STATE_ON_HOST) + ')' if a.state_on_host else ''}, FPDT CP=1 chunk "
          f"{a.chunk}, --fpdt-offload, full recompute, --offload-layer-inputs, counting the {what} against 80e9 B "
          f"and host bytes against {host / GB:.0f} GB: longest fitting {ok or 'none'}, first not fitting {bad}; "
          f"probes {trace}")
    print(HEAD)
    for s in sorted(seen):
        print("\n".join(row_lines(f"8B, S={s}, 1 rank", seen[s], 80 * GB, host)))
    return 0


def small_setting(kind: str, s: int) -> tuple[list[str], int, str]:
    """(flags, world size, --attention) of one part-5 row at length s."""
    attention = "flash" if kind.endswith("+flash") else "local"
    kind = kind.removesuffix("+flash")
    chunk = min(16384, max(1, s // 8))
    if kind == "plain":
        return SMALL + seq_flags(s), 1, attention
    if kind == "ulysses":
        return SMALL + seq_flags(s) + ["--context-parallel-size", "2"], 2, attention
    if kind == "fpdt":
        return SMALL + seq_flags(s) + fpdt_flags(s, 2, chunk), 2, attention
    if kind == "fpdt+offload":
        return SMALL + seq_flags(s) + fpdt_flags(s, 2, chunk) + RECOMPUTE_OFFLOAD, 2, attention
    raise ValueError(kind)


def longest_small(kind: str, budget: float, start: int, refine: int, timeout: float) -> dict:
    seen = {}

    def fits(s):
        flags, world, att = small_setting(kind, s)
        seen[s] = dry_run(flags, world, att, timeout=timeout)
        return seen[s]["peak_accelerator_bytes"] <= budget

    try:
        ok, bad, trace = bisect_longest(fits, start, refine)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failed row does not lose the others
        return {"kind": kind, "error": str(e), "longest": 0, "first_bad": None, "trace": [], "at_ok": None,
                "at_bad": None, "wall_s": 0}
    print(json.dumps({"kind": kind, "longest": ok, "first_bad": bad, "trace": trace}), file=sys.stderr, flush=True)
    return {"kind": kind, "longest": ok, "first_bad": bad, "trace": trace, "at_ok": seen.get(ok),
            "at_bad": seen.get(bad), "wall_s": round(sum(r["wall_s"] for r in seen.values()), 1)}


def cmd_small(a) -> int:
    budget = a.budget_gb * GB
    starts = dict(zip(a.kinds, a.starts or [4096] * len(a.kinds)))
    with ThreadPoolExecutor(a.jobs) as ex:
        res = list(ex.map(lambda k: longest_small(k, budget, starts[k], a.refine, a.timeout), a.kinds))
    print(f"h=256, 4 layers, 4 heads, byte-level vocab, micro-batch 1, bf16; budget {a.budget_gb:g} GB "
          f"(1e9 B) of dry-run accelerator bytes; grid: lower power of two / {a.refine}")
    print("| attention | longest S | first S over | peak at longest (GB) | largest role at first over | "
          "probes | dry-run wall (all probes) |\n|---|---|---|---|---|---|---|")
    for r in res:
        if "error" in r:
            print(f"| {r['kind']} | dry run failed: {r['error'].splitlines()[0]} | | | | | |")
            continue
        ok, bad = r["at_ok"], r["at_bad"]
        top = (max(CATS, key=lambda c: bad["categories"][c]) + f" {bad['categories'][max(CATS, key=lambda c: bad['categories'][c])] / GB:.2f} GB") if bad else "-"
        print(f"| {r['kind']} | {r['longest']} | {r['first_bad']} | "
              f"{ok['peak_accelerator_bytes'] / GB:.3f} | {top} | {len(r['trace'])} | {r['wall_s']:.0f} s |"
              if ok else f"| {r['kind']} | none | {r['first_bad']} | - | {top} | {len(r['trace'])} | {r['wall_s']:.0f} s |")
    for r in res:
        if r["at_ok"]:
            print(f"  {r['kind']} at {r['longest']}: `{r['at_ok']['command']}`")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("headline")
    h.add_argument("--rows", nargs="+", choices=("1m-1gpu", "2m", "4m", "16m"), default=["2m", "4m"])
    h.add_argument("--sharding", choices=tuple(SHARDING), default="dist-opt")
    h.add_argument("--chunk", type=int, default=65536)
    h.add_argument("--chunk-16m", type=int, default=262144,
                   help="FPDT chunk of the 16m row (64 chunks; 65536 runs 16x the dry run's chunk loop)")
    s1 = sub.add_parser("single-rank")
    s1.add_argument("--start", type=int, default=65536)
    s1.add_argument("--chunk", type=int, default=65536)
    s1.add_argument("--limit", type=int, default=1 << 24)
    s1.add_argument("--state-off-accelerator", action="store_true",
                    help="count the peak less gradients and optimizer state (as if they lived on the host)")
    s1.add_argument("--state-on-host", action="store_true",
                    help="run with --use-torch-fsdp2 --optimizer-cpu-offload (the state really on the host)")
    s1.add_argument("--host-budget-gb", type=float,
                    help="host bytes a fitting length may use (250: a rank's share of a 2 TB node of 8 GPUs; "
                         "default the whole node's 2 TB)")
    sm = sub.add_parser("small")
    sm.add_argument("--budget-gb", type=float, default=2.0)
    sm.add_argument("--kinds", nargs="+", default=["plain", "ulysses", "fpdt", "fpdt+offload"])
    sm.add_argument("--starts", nargs="+", type=int)
    for p in (h, s1):
        p.add_argument("--scale-from", nargs=3, type=int, metavar="L",
                       help="dry-run these layer counts (equal steps) and extend each exactly affine figure to 32")
    sm.set_defaults(scale_from=None)
    for p in (h, s1, sm):
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--timeout", type=float, default=3600)
        p.add_argument("--json-out")
    for p in (s1, sm):
        p.add_argument("--refine", type=int, default=8)
    a = ap.parse_args(argv)
    if a.what == "small" and a.starts and len(a.starts) != len(a.kinds):
        print("long_context_table: --starts needs one length per --kinds entry", file=sys.stderr)
        return 2
    try:
        return {"headline": cmd_headline, "single-rank": cmd_single_rank, "small": cmd_small}[a.what](a)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"long_context_table: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
