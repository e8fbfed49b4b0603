"""Tables for docs/results/simulator.md: CPU-host validation, WeiPipe's and FPDT's settings.

Every projected row comes with the `python -m tools.simulate` command that prints it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from megatron_weipipe.schedules import registry
from megatron_weipipe.simulator.cli import costs_for, parse_command
from megatron_weipipe.simulator.project import simulate_run

# The WeiPipe paper's scaling run (authors' script): Llama-style blocks, L=32, h=1024, 32 heads,
# micro-batch 2, seq 16384, two microbatches per GPU, pure pipeline of all GPUs; 1F1B with
# activation checkpointing, WeiPipe without; training the embedding and output layer too.
WEIPIPE_MODEL = ("--num-layers 32 --hidden-size 1024 --num-attention-heads 32 --seq-length 16384 "
                 "--micro-batch-size 2 --vocab-size 32000 --swiglu --ffn-hidden-size 2752 --normalization RMSNorm "
                 "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
                 "--hidden-dropout 0 --attention-dropout 0 --bf16")
WEIPIPE_CLUSTERS = {
    # assumed: A800-SXM nodes of 8 (NVLink capped at 200 GB/s per direction), 200 Gb/s IB per GPU
    "NVLink": "--gpu a800 --link nvlink-a800,ib-hdr --gpus-per-node 8",
    # assumed: 8 PCIe GPUs per node (gen4 switch), 100 Gb/s IB between nodes
    "PCIe + IB": "--gpu a800 --link pcie4,ib-edr --gpus-per-node 8",
    # sensitivity: GPU-to-GPU copies through the host bridge, a NIC shared by the node
    "PCIe + IB, slow links (6 / 3 GB/s)": "--gpu a800 --link pcie4,ib-edr --gpus-per-node 8 "
                                           "--intra-bandwidth-gbs 6 --inter-bandwidth-gbs 3",
}
WEIPIPE_PAPER = {"NVLink": 0.309, "PCIe + IB": 0.82, "PCIe + IB, slow links (6 / 3 GB/s)": 0.82}

LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 "
             "--ffn-hidden-size 14336 --vocab-size 128256 --swiglu --normalization RMSNorm --disable-bias-linear "
             "--position-embedding-type rope --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16 "
             "--micro-batch-size 1 --global-batch-size 1 --gpu a100 --link nvlink3,ib --host-link pcie4")


def run_command(flags: str):
    args, cluster, specs = parse_command(shlex.split(flags))
    return [simulate_run(spec, cluster, costs_for(args, spec, cluster)) for spec in specs], cluster


def cpu_table(rows: list[dict]) -> str:
    lines = ["| P | seq | schedule | rounds | measured (median) | predicted (median) | error (median; per round) | "
             "measured spread | CPU/iter measured | CPU/iter error | CPU share: calibration / run | "
             "bytes = counter | logged sent/rank/iter (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{e:+.0%}" for e in r["errors"])
        lines.append(
            f"| {r['ranks']} | {r['seq_length']} | {r['schedule']} | {r['rounds']} | {r['measured_ms']:.0f} ms | "
            f"{r['predicted_ms']:.0f} ms | {r['error']:+.1%} ({per}) | {r['spread']:.0%} | "
            f"{r['measured_cpu_ms']:.0f} ms | {r['cpu_error']:+.1%} | "
            f"{r['calibration_share']:.0%} / {r['share']:.0%} | "
            f"{'exact' if r['bytes_exact'] else 'DIFFERS'} | {r['log_sent']} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Variant:
    name: str
    megatron_flags: str
    weipipe_flags: str


WEIPIPE_VARIANTS = (
    Variant("as the paper ran it: 1F1B recomputes, WeiPipe does not", "--recompute-granularity full --recompute-method uniform", ""),
    Variant("neither recomputes", "", ""),
    Variant("neither recomputes, vocabulary 512 (no output-layer load on 1F1B's last stage)",
            "--vocab-size 512", "--vocab-size 512"),
)


def weipipe_table(gpus=(8, 16, 32)) -> str:
    lines = ["| cluster | GPUs | variant | 1F1B iteration | WeiPipe-Interleave iteration | WeiPipe-zb (ideal W) | "
             "predicted gain (Interleave) | paper (up to) | prediction - paper | peak memory 1F1B / WeiPipe |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    commands = []
    best: dict = {}
    for cluster, hw in WEIPIPE_CLUSTERS.items():
        for n in gpus:
            for v in WEIPIPE_VARIANTS:
                base = f"{WEIPIPE_MODEL} {hw} --pipeline-model-parallel-size {n} --global-batch-size {4 * n}"
                mega = f"{base} --schedules 1f1b {v.megatron_flags}".strip()
                wei = f"{base} --schedules weipipe-interleave {v.weipipe_flags}".strip()
                zbc = f"{base} --schedules weipipe-zb --weipipe-weight-pass ideal {v.weipipe_flags}".strip()
                (one,), _ = run_command(mega)
                (inter,), _ = run_command(wei)
                (zb,), _ = run_command(zbc)
                gain = one.iteration_s / inter.iteration_s - 1
                key = (cluster, v.name)
                if key not in best or gain > best[key][0]:
                    best[key] = (gain, n)
                lines.append(
                    f"| {cluster} | {n} | {v.name} | {one.iteration_s:.2f} s | {inter.iteration_s:.2f} s | "
                    f"{zb.iteration_s:.2f} s | {gain:+.1%} | {WEIPIPE_PAPER[cluster]:+.1%} | "
                    f"{(gain - WEIPIPE_PAPER[cluster]) * 100:+.0f} pp | "
                    f"{one.peak_memory / 2**30:.0f} / {inter.peak_memory / 2**30:.0f} GiB |")
                if n == gpus[-1] and v is WEIPIPE_VARIANTS[0]:
                    commands += [f"python -m tools.simulate {c}" for c in (mega, wei, zbc)]
    note = ("Commands of the 32-GPU rows of the first variant; the other rows change "
            "--pipeline-model-parallel-size N --global-batch-size 4N, drop --recompute-granularity full --recompute-method uniform "
            "(second variant) and add --vocab-size 512 (third).")
    head = ["| cluster | paper (up to) | " + " | ".join(v.name for v in WEIPIPE_VARIANTS) + " |",
            "|---" * (2 + len(WEIPIPE_VARIANTS)) + "|"]
    for cluster in WEIPIPE_CLUSTERS:
        cells = [f"{best[(cluster, v.name)][0]:+.0%} at {best[(cluster, v.name)][1]} GPUs "
                 f"({(best[(cluster, v.name)][0] - WEIPIPE_PAPER[cluster]) * 100:+.0f} pp)" for v in WEIPIPE_VARIANTS]
        head.append(f"| {cluster} | {WEIPIPE_PAPER[cluster]:+.1%} | " + " | ".join(cells) + " |")
    return "\n".join(["Largest predicted gain of WeiPipe-Interleave over 1F1B (GPUs 8, 16, 32):", ""] + head
                     + ["", "All rows:", ""] + lines + ["", note, ""] + [f"    {c}" for c in commands])


FPDT_ROWS = (
    ("8B, 2M tokens, 4 GPUs: FPDT 64K chunks, offload, checkpoints on host, ZeRO-3 (paper)",
     "--seq-length 2097152 --context-parallel-size 4 --fpdt --fpdt-chunk-size 65536 --fpdt-offload "
     "--fpdt-offload-checkpoints --zero3", "fits (paper)"),
    ("same, Megatron distributed optimizer instead of ZeRO-3",
     "--seq-length 2097152 --context-parallel-size 4 --fpdt --fpdt-chunk-size 65536 --fpdt-offload "
     "--fpdt-offload-checkpoints --use-distributed-optimizer", "-"),
    ("same as the paper, checkpoints kept on the device",
     "--seq-length 2097152 --context-parallel-size 4 --fpdt --fpdt-chunk-size 65536 --fpdt-offload "
     "--recompute-granularity full --recompute-method uniform --zero3", "-"),
    ("8B, 2M tokens, 4 GPUs, plain Ulysses (one chunk), ZeRO-3",
     "--seq-length 2097152 --context-parallel-size 4 --fpdt --fpdt-chunk-size 2097152 "
     "--recompute-granularity full --recompute-method uniform --zero3", "does not fit (paper)"),
    ("8B, 4M tokens, 8 GPUs: FPDT 64K chunks, offload, checkpoints on host, ZeRO-3 (paper)",
     "--seq-length 4194304 --context-parallel-size 8 --fpdt --fpdt-chunk-size 65536 --fpdt-offload "
     "--fpdt-offload-checkpoints --zero3", "fits, 68 GB HBM (paper blog)"),
)


def fpdt_table() -> str:
    lines = ["| setting | chunks | device peak per rank | fits in 80 GB | host memory per node | prefetch | "
             "iteration | MFU | paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    commands = []
    for name, flags, claim in FPDT_ROWS:
        cmd = f"{LLAMA3_8B} {flags}"
        (r,), cluster = run_command(cmd)
        fp = r.fpdt
        per_node = fp.host_bytes_per_rank * min(cluster.gpus_per_node, r.spec.layout.world)
        fits = r.peak_memory <= cluster.device.memory_gb * 1e9
        hidden = ("hidden" if fp.prefetch_hidden else "exposed") if r.spec.fpdt.offload else "no offload"
        lines.append(
            f"| {name} | {fp.chunks} | {r.peak_memory / 2**30:.1f} GiB | {'yes' if fits else 'NO'} | "
            f"{per_node / 2**30:.0f} GiB | {hidden} | {r.iteration_s:.0f} s | {r.mfu:.1%} | {claim} |")
        commands.append(f"python -m tools.simulate {cmd}")
    return "\n".join(lines + ["", "Commands:", ""] + [f"    {c}" for c in commands])


# The same setting against each baseline the paper measured (or should have): 1F1B as the
# paper ran it (full recomputation), 1F1B and ZB-H1 without recomputation (both fit), FSDP
# (ZeRO-3 over the same GPUs), and the floor of any activation pipeline; then with what the
# first table assumes away. NVSwitch gives every GPU its own links, and in a pipeline or a
# ring only one GPU of a node sends to the next node at a time, so the node-shared link is
# the PCIe one: all 8 GPUs of a node send to their neighbours at once, through a switch
# shared by 2 GPUs or, at worst, one uplink for all 8. And WeiPipe's kernels (flat weight
# views, no fused optimizer of its own) at 80% of Megatron's speed.
BASELINE_SETTINGS = {
    "NVLink": {"as before (per-GPU links, equal kernels)": ("", ""),
               "WeiPipe kernels at 80%": ("", "--kernel-efficiency 0.8")},
    "PCIe + IB": {"as before (per-GPU links, equal kernels)": ("", ""),
                  "PCIe shared by 2 GPUs": ("--intra-link-shared-by 2", ""),
                  "PCIe shared by 8 GPUs": ("--intra-link-shared-by 8", ""),
                  "PCIe shared by 2, WeiPipe kernels at 80%": ("--intra-link-shared-by 2", "--kernel-efficiency 0.8")},
}
BASELINE_CLUSTERS = {k: v for k, v in WEIPIPE_CLUSTERS.items() if "slow" not in k}
BASELINE_COLUMNS = (("1F1B, recompute (paper's)", "1f1b", "--recompute-granularity full --recompute-method uniform"),
                    ("1F1B", "1f1b", ""), ("ZB-H1", "zb-h1", ""), ("FSDP", "fsdp", ""), ("floor", "floor", ""))
COMMAND_ROW = ("PCIe + IB", "PCIe shared by 2, WeiPipe kernels at 80%")


def baselines_table(gpus=(8, 16, 32)) -> str:
    head = ("| cluster | GPUs | setting | WeiPipe-Interleave | " + " | ".join(f"vs {c[0]}" for c in BASELINE_COLUMNS)
            + " | vs best baseline | paper (up to, vs its best) |")
    lines = [head, "|---" * (6 + len(BASELINE_COLUMNS)) + "|"]
    commands = []
    for cluster, hw in BASELINE_CLUSTERS.items():
        for n in gpus:
            for setting, (links, weipipe_only) in BASELINE_SETTINGS[cluster].items():
                shown = n == gpus[-1] and (cluster, setting) == COMMAND_ROW
                base = f"{WEIPIPE_MODEL} {hw} {links} --pipeline-model-parallel-size {n} --global-batch-size {4 * n}"
                base = " ".join(base.split())
                wcmd = f"{base} --schedules weipipe-interleave {weipipe_only}".strip()
                (wei,), _ = run_command(wcmd)
                cells, times = [], {}
                for label, name, flags in BASELINE_COLUMNS:
                    cmd = f"{base} --schedules {name} {flags}".strip()
                    (r,), _ = run_command(cmd)
                    cells.append(f"{r.iteration_s / wei.iteration_s - 1:+.0%}")
                    if registry.simulated(name).projection != registry.FLOOR:  # no schedule reaches the floor
                        times[label] = r.iteration_s
                    if shown:
                        commands.append(f"python -m tools.simulate {cmd}")
                if shown:
                    commands.append(f"python -m tools.simulate {wcmd}")
                best = min(times, key=times.get)
                lines.append(f"| {cluster} | {n} | {setting} | {wei.iteration_s:.2f} s | " + " | ".join(cells)
                             + f" | {times[best] / wei.iteration_s - 1:+.0%} ({best}) | {WEIPIPE_PAPER[cluster]:+.1%} |")
    note = ("Cells: WeiPipe-Interleave's predicted gain in tokens/s over each baseline (baseline iteration / "
            "WeiPipe iteration - 1). Commands of the 32-GPU row \"" + " / ".join(COMMAND_ROW) + "\" (the other "
            "rows drop or change --intra-link-shared-by and --kernel-efficiency, --link and the GPU count as in the "
            "first table):")
    return "\n".join(lines + ["", note, ""] + [f"    {c}" for c in commands])


# TawPipe's 24-GPU setting (the authors' script.py): Llama-style blocks, L=48, h=1024, 32 heads,
# seq 16384, micro-batch 1, 64 accumulation steps per GPU, 3 nodes of 8 GPUs, NCCL over
# sockets between nodes (25 GbE); WeiPipe and TawPipe without activation checkpointing, the
# FSDP baseline (DeepSpeed ZeRO-3) with it; embedding and output layer trained.
TAWPIPE_MODEL = ("--num-layers 48 --hidden-size 1024 --num-attention-heads 32 --seq-length 16384 "
                 "--micro-batch-size 1 --vocab-size 32000 --swiglu --ffn-hidden-size 2752 --normalization RMSNorm "
                 "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
                 "--hidden-dropout 0 --attention-dropout 0 --bf16")
TAWPIPE_CLUSTER = "--gpu a800 --link nvlink-a800,eth25 --gpus-per-node 8"
TAWPIPE_PAPER = {"weipipe": 0.118, "fsdp": 0.441}
RECOMPUTE = "--recompute-granularity full --recompute-method uniform"


@dataclass(frozen=True)
class TawPipeVariant:
    name: str
    flags: str = ""  # for every column
    ring_flags: str = ""  # WeiPipe and TawPipe only
    sharded_flags: str = ""  # FSDP and HSDP only


ONE_DTYPE_RING = "--weipipe-grad-dtype bf16"
ONE_DTYPE_SHARDED = "--fsdp-reduce-dtype bf16"
TAWPIPE_VARIANTS = (
    TawPipeVariant("fp32 gradients (this trainer's default)"),
    TawPipeVariant("one dtype: bf16 gradients everywhere (the authors' fp16 code, ZeRO-3 reducing in fp16)",
                   ring_flags=ONE_DTYPE_RING, sharded_flags=ONE_DTYPE_SHARDED),
    TawPipeVariant("one dtype, kernels at 80% of the cost model's speed", "--kernel-efficiency 0.8",
                   ONE_DTYPE_RING, ONE_DTYPE_SHARDED),
    TawPipeVariant("one dtype, kernels at 75%", "--kernel-efficiency 0.75", ONE_DTYPE_RING, ONE_DTYPE_SHARDED),
)


def tawpipe_columns(nodes: int, per_node: int):
    """(label, schedule flags, whether a ring schedule) of each compared column."""
    hsdp = f"--schedules fsdp --hsdp-replicas {nodes}"
    return (("TawPipe", "--schedules tawpipe", True),
            ("WeiPipe-Interleave", "--schedules weipipe-interleave", True),
            ("FSDP, recompute (paper's)", f"--schedules fsdp {RECOMPUTE}", False),
            ("FSDP", "--schedules fsdp", False),
            (f"HSDP {nodes}x{per_node}", hsdp, False),
            (f"HSDP {nodes}x{per_node}, sync once", f"{hsdp} --fsdp-grad-sync-once", False),
            (f"HSDP {nodes}x{per_node}, sync once, no reshard", f"{hsdp} --fsdp-grad-sync-once --fsdp-no-reshard",
             False))


def tawpipe_table(model: str = TAWPIPE_MODEL, cluster: str = TAWPIPE_CLUSTER, gpus: int = 24, nodes: int = 3,
                  accumulation: int = 64, variants=TAWPIPE_VARIANTS) -> str:
    """Iteration of each column per variant, and TawPipe's gains over WeiPipe and FSDP."""
    columns = tawpipe_columns(nodes, gpus // nodes)
    head = ("| variant | " + " | ".join(c[0] for c in columns)
            + " | TawPipe vs WeiPipe | TawPipe vs FSDP (recompute) | best HSDP vs TawPipe |")
    lines = [head, "|---" * (4 + len(columns)) + "|"]
    commands = []
    base = f"{model} {cluster} --global-batch-size {gpus * accumulation}"
    for v in variants:
        times = {}
        for label, flags, ring in columns:
            layout = f"--pipeline-model-parallel-size {gpus}" if ring else f"--num-gpus {gpus}"
            cmd = " ".join(f"{base} {v.flags} {layout} {flags} {v.ring_flags if ring else v.sharded_flags}".split())
            (r,), _ = run_command(cmd)
            times[label] = r.iteration_s
            if v is variants[0]:
                commands.append(f"python -m tools.simulate {cmd}")
        taw = times["TawPipe"]
        hsdp = min(t for k, t in times.items() if k.startswith("HSDP"))
        lines.append(f"| {v.name} | " + " | ".join(f"{times[c[0]]:.1f} s" for c in columns)
                     + f" | {times['WeiPipe-Interleave'] / taw - 1:+.1%} | "
                       f"{times[columns[2][0]] / taw - 1:+.1%} | {taw / hsdp - 1:+.1%} |")
    lines.append(f"| paper (TawPipe's gain) | | | | | | | | {TAWPIPE_PAPER['weipipe']:+.1%} | "
                 f"{TAWPIPE_PAPER['fsdp']:+.1%} | |")
    note = ("Cells: iteration seconds; gains in tokens/s (the other's iteration / TawPipe's - 1); the last column "
            f"is how much faster the best HSDP is than TawPipe. Commands of the first variant (the others add "
            f"{ONE_DTYPE_RING} to WeiPipe and TawPipe, {ONE_DTYPE_SHARDED} to FSDP and HSDP, and --kernel-efficiency "
            "to all):")
    return "\n".join(lines + ["", note, ""] + [f"    {c}" for c in commands])
