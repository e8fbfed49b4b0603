"""Text tables (markdown) and JSON of projected runs."""

from __future__ import annotations

import json
from typing import Sequence

from megatron_weipipe.batch_sizes import schedule_flag

from .hardware import GB, Cluster, GiB
from . import host_state
from .project import ScheduleResult, state_bytes


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def _links(r: ScheduleResult) -> str:
    """Bytes sent per iteration by the busiest rank, per link."""
    totals: dict[str, float] = {}
    for row in r.bytes_per_link:
        for link, n in row.items():
            totals[link] = max(totals.get(link, 0.0), n)
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(totals.items())) or "0"


def final_batch_note(cfg) -> str:
    """Under a batch-size ramp or step schedule: the projection is of an iteration at the final size."""
    steps = None if cfg is None else cfg.batch_size_steps
    if steps is None:
        return ""
    return (f" (the final batch size of {schedule_flag(cfg.training)}; iterations before {steps.final_from} "
            f"consumed samples train {steps.sizes[0]} to {steps.sizes[-2]})")


def format_results(results: Sequence[ScheduleResult], cluster: Cluster, calibrated: bool = False) -> str:
    if not results:
        return "no schedules"
    spec = results[0].spec
    s, lay = spec.shape, spec.layout
    lines = [
        f"model: L={s.num_layers} h={s.hidden_size} heads={s.num_attention_heads} groups={s.groups} "
        f"ffn={s.ffn} vocab={s.padded_vocab(lay.tp)} seq={s.seq_length} micro-batch={s.micro_batch_size}; "
        f"{s.total_params() / 1e9:.3f} B parameters",
        f"layout: TP={lay.tp} PP={lay.pp} CP={lay.cp} DP={lay.dp} ({lay.world} ranks), global batch "
        f"{spec.global_batch_size} = {spec.num_microbatches} microbatches per replica{final_batch_note(spec.config)}",
    ]
    if calibrated:
        lines.append("costs: measured on this host (--calibrate); MFU column shows achieved GFLOP/s per rank")
    else:
        d = cluster.device
        lines.append(
            f"hardware: {d.name} ({d.peak_tflops:g} TFLOP/s peak, {d.gemm_efficiency:.0%} matmul / "
            f"{d.attention_efficiency:.0%} attention sustained, {d.memory_gb:g} GB), {cluster.gpus_per_node} per node; "
            f"intra {cluster.intra.name} {cluster.intra.bandwidth_gbs:g} GB/s, inter {cluster.inter.name} "
            f"{cluster.inter.bandwidth_gbs:g} GB/s")
    lines += ["",
              "| schedule | iteration | tokens/s | MFU | bubble | sent per rank per iteration (max) | "
              "peak memory per rank | fits |",
              "|---|---|---|---|---|---|---|---|"]
    cap = cluster.device.memory_gb * GB
    for r in results:
        flops = s.model_flops_per_microbatch() * r.spec.num_microbatches * lay.dp
        if calibrated:
            eff = f"{flops / r.iteration_s / lay.world / 1e9:.1f} GF/s"
        else:
            eff = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        fits = "-" if calibrated else ("yes" if r.peak_memory <= cap else "NO")
        lines.append(
            f"| {r.spec.schedule} | {fmt_time(r.iteration_s)} | {r.tokens_per_s:,.0f} | {eff} | {r.bubble:.1%} | "
            f"{_links(r)} | {fmt_bytes(r.peak_memory)} | {fits} |")
    lines.append("")
    for r in results:
        mem = ", ".join(fmt_bytes(m.total) for m in r.memory)
        worst = max(r.memory, key=lambda m: m.total)
        lines.append(
            f"{r.spec.schedule}: memory per rank [{mem}]; heaviest: state {fmt_bytes(worst.model_state)}, "
            f"activations {fmt_bytes(worst.activations)}, weight/grad buffers {fmt_bytes(worst.buffers)}, "
            f"transient {fmt_bytes(worst.transient)}")
        tail = "; ".join(f"{k} {fmt_time(v)}" for k, v in r.phases.items() if v > 0)
        lines.append(f"  pipeline {fmt_time(r.pipeline_s)}" + (f"; {tail}" if tail else ""))
    line = host_state.summary_line(spec, results[0].memory[0].params, state_bytes(spec), cluster.host_link,
                                results[0].iteration_s)
    if line is not None:
        lines += ["", line]
    fp = results[0].fpdt
    if fp is not None:
        hosts = cluster.gpus_per_node
        lines += [
            "",
            f"FPDT: chunk {spec.fpdt.chunk_size} tokens -> {fp.chunks} chunks; offload "
            f"{'on' if spec.fpdt.offload else 'off'}",
            f"  device per rank: chunk buffers {fmt_bytes(fp.device_chunk_bytes)}, layer hidden states "
            f"{fmt_bytes(fp.device_hidden_bytes)}, layer-input checkpoints {fmt_bytes(fp.checkpoint_bytes)} "
            f"({'host' if spec.fpdt.offload_checkpoints else 'device'})",
            f"  host memory: {fmt_bytes(fp.host_bytes_per_rank)} per rank, "
            f"{fmt_bytes(fp.host_bytes_per_rank * min(hosts, lay.world))} per node "
            f"(node has {cluster.host_memory_gb:g} GB)",
            f"  prefetch: forward block {fmt_time(fp.block_compute_s)} compute vs {fmt_time(fp.block_fetch_s)} "
            f"fetch, backward {fmt_time(fp.backward_block_compute_s)} vs {fmt_time(fp.backward_block_fetch_s)} -> "
            f"{'hidden' if fp.prefetch_hidden else 'NOT hidden'} ({fmt_time(fp.exposed_s_per_layer)} exposed per "
            f"layer and microbatch)",
        ]
    return "\n".join(lines)


def result_dict(r: ScheduleResult) -> dict:
    return {
        "schedule": r.spec.schedule,
        "iteration_s": r.iteration_s,
        "pipeline_s": r.pipeline_s,
        "tokens_per_s": r.tokens_per_s,
        "mfu": r.mfu,
        "bubble": r.bubble,
        "bytes_per_link": [dict(d) for d in r.bytes_per_link],
        "counter": [dict(d) for d in r.counter],
        "memory": [{"params": m.params, "model_state": m.model_state, "activations": m.activations,
                    "buffers": m.buffers, "transient": m.transient, "total": m.total} for m in r.memory],
        "phases": r.phases,
        "work_s": list(r.work),
    }


def write_json(results: Sequence[ScheduleResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump([result_dict(r) for r in results], f, indent=1)
