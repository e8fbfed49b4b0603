"""The planner's pick at the papers' settings, beside each paper's own method run here.

    python -m tools.plan --papers

Each setting is the paper's model, sequence, batch and cluster as pretrain_gpt.py flags and
simulator presets (assumptions named where a paper does not say); its method is the nearest
layout this package trains, built from the planner's own space (space.py), priced by the
same estimator and simulator as the planner's pick. The model flags are those of
tools/simulator_validation/doc_tables.py, whose tables in docs/results/simulator.md use them.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Optional

from tools.simulator_validation.doc_tables import LLAMA3_8B, WEIPIPE_CLUSTERS, WEIPIPE_MODEL

RUN = "--train-iters 10 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer"
LLAMA3_8B_MODEL = LLAMA3_8B.split(" --gpu")[0]  # the model flags, without doc_tables' cluster


@dataclass(frozen=True)
class Setting:
    name: str
    model: str  # pretrain_gpt.py flags (model, sequence, batch)
    cluster: str  # the simulator's cluster flags, --nodes included
    method: str  # the paper's method, in words
    layout: tuple[str, ...]  # its nearest layout here (layout flags)
    rung: tuple[str, ...] = ()  # its memory saving (recomputation, FPDT)


def _seq(n: int) -> str:
    return f"--seq-length {n} --max-position-embeddings {n}"


FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform")


def settings() -> list[Setting]:
    out = []
    for cluster, hw in WEIPIPE_CLUSTERS.items():
        if "slow" in cluster:
            continue
        for gpus in (8, 16, 32):
            out.append(Setting(
                f"WeiPipe run_scale, {cluster}", f"{WEIPIPE_MODEL} --global-batch-size {4 * gpus}",
                f"{hw} --nodes {gpus // 8}", "WeiPipe-Interleave, a ring of every GPU",
                ("--pipeline-model-parallel-size", str(gpus), "--pipeline-schedule", "weipipe-interleave")))
    out.append(Setting(
        "TawPipe (WeiPipe's model assumed), 3 nodes x 8, 25 GbE", f"{WEIPIPE_MODEL} --global-batch-size 192",
        "--gpu a800 --link nvlink-a800,eth25 --gpus-per-node 8 --nodes 3",
        "TawPipe (not trained here; nearest: a WeiPipe-Interleave ring per node, data parallel across)",
        ("--pipeline-model-parallel-size", "8", "--pipeline-schedule", "weipipe-interleave")))
    out.append(Setting(
        "FPDT: Llama-3 8B, 2M tokens, 4 x A100 80 GB", f"{LLAMA3_8B_MODEL} {_seq(2 * 2**20)}",
        "--gpu a100 --link nvlink3,ib --host-link pcie4 --gpus-per-node 4 --nodes 1",
        "FPDT: Ulysses over 4, 64K chunks offloaded, ZeRO-3",
        ("--context-parallel-size", "4", "--use-torch-fsdp2"),
        FULL + ("--fpdt", "--fpdt-chunk-size", "65536", "--fpdt-offload", "--offload-layer-inputs")))
    for gpus, seq, label in ((1, 2**19, "500K"), (8, 7 * 2**19, "3.5M (ALST: 3.7M)"), (32, 15 * 2**20, "15M")):
        nodes, per = max(1, gpus // 8), min(gpus, 8)
        out.append(Setting(
            f"ALST: Llama-3 8B, {label} tokens, {gpus} x H100", f"{LLAMA3_8B_MODEL} {_seq(seq)}",
            f"--gpu h100 --link nvlink,ib --gpus-per-node {per} --nodes {nodes}",
            "ALST: Ulysses over every GPU, tiled compute, activations and optimizer state offloaded, ZeRO-3",
            ("--context-parallel-size", str(gpus), "--use-torch-fsdp2", "--optimizer-cpu-offload"),
            FULL + ("--fpdt", "--fpdt-chunk-size", "65536", "--fpdt-offload", "--offload-layer-inputs")))
    return out


def paper_layout(s: Setting, base: list[str], world: int):
    """The paper's method as a candidate of the planner's space (None if the trainer refuses it)."""
    from .space import trainer_config, Candidate, Rung, Structure, DATA_PARALLEL_MODES

    flags = tuple(s.layout) + tuple(s.rung)
    try:
        cfg = trainer_config(base + list(flags), world)
    except Exception as e:  # the trainer's one line
        return None, str(e)
    p = cfg.parallel
    mode = max((m for m in DATA_PARALLEL_MODES if all(f in flags for f in m.flags) and
                (m.flags or not (p.use_torch_fsdp2 or p.use_distributed_optimizer))),
               key=lambda m: len(m.flags))  # the most specific mode the flags name
    st = Structure(p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                   cfg.data_parallel_size, p.pipeline_schedule if p.pipeline_model_parallel_size > 1 else None,
                   p.num_layers_per_virtual_pipeline_stage, mode)
    return Candidate(st, Rung("paper", tuple(s.rung)), flags, cfg), ""


def run(s: Setting) -> dict:
    from megatron_weipipe.simulator.cli import build_cluster

    from .cli import parse
    from .evaluate import Evaluator
    from .search import plan

    base_argv = shlex.split(f"{s.model} {RUN}")
    hw, opts, base = parse(base_argv + shlex.split(s.cluster))
    cluster = build_cluster(hw)
    world = opts.nodes * cluster.gpus_per_node
    ev = Evaluator(cluster)
    p = plan(base, cluster, opts.nodes, keep=1, evaluator=ev)
    paper, refused = paper_layout(s, base, world)
    row = {"setting": s, "world": world, "plan": p, "paper": None, "paper_note": refused}
    if paper is not None:
        mem = ev.memory(paper)
        if ev.fits(mem, world):
            row["paper"] = ev.evaluate(paper, mem)
        else:
            row["paper_note"] = f"does not fit: {mem.device / 1e9:.1f} GB per rank, host {mem.host / 1e9:.1f} GB"
    return row


def report(rows: list[dict]) -> str:
    lines = ["| setting | GPUs | paper's method | its layout here: tokens/s | planner's pick | tokens/s | pick / paper |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p = r["setting"], r["plan"]
        paper = r["paper"]
        theirs = f"{paper.tokens_per_s:,.0f}" if paper else f"refused here: {r['paper_note']}" \
            if "fit" not in r["paper_note"] else r["paper_note"]
        if p.ranked:
            best = p.ranked[0]
            pick, tps = best.candidate.describe(), f"{best.tokens_per_s:,.0f}"
            ratio = f"{best.tokens_per_s / paper.tokens_per_s:.2f}" if paper else "-"
        else:
            miss = p.smallest_misfit
            pick, tps, ratio = "nothing fits" + (f" (closest {miss[0] / 1e9:.0f} GB/rank)" if miss else ""), "-", "-"
        lines.append(f"| {s.name} | {r['world']} | {s.method} | {theirs} | {pick} | {tps} | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    rows = []
    for s in settings():
        rows.append(run(s))
        print(f"# {s.name}: {rows[-1]['plan'].seconds:.1f} s", file=sys.stderr)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
