"""Peak memory and throughput at the shapes of examples/*.sh, scaled to the GPUs present.

The flags come from the example scripts themselves: examples/gpu_single_node.sh is run with
a stand-in ``torchrun`` that prints its arguments (GPUS = P, SCHEDULE = each schedule), and
the model flags of examples/pretrain_gpt_slurm.sh are its ``MODEL_ARGS`` default. They are
then scaled to the N GPUs of this host, and each change is stated in the row:

- gpu_single_node (Llama-3.2-1B shape at 16K): a ring of P = N (the example: 8), 2 layers
  per rank (the example's 16 at P = 8), its global batch 4 per rank; ``none`` is PP = 1,
  data parallel over the N GPUs, all 16 layers; ``interleaved`` adds
  ``--num-layers-per-virtual-pipeline-stage 1``;
- pretrain_gpt_slurm (Llama-3-8B shape at 32K, TP 8 x weipipe-interleave PP 4 on 32 GPUs):
  PP = min(4, N), TP = 2 where N >= 2 PP, 2 layers per pipeline rank, global batch 4 per
  pipeline rank; on one GPU PP = 1 (no pipeline).

Both train Llama-3's vocabulary (128256, mock data: no corpus) for 3 iterations with
megatron-core's local layers (what the dry run builds). The memory row compares rank 0's
peak allocated device memory (``torch.cuda.max_memory_allocated`` less what was allocated
before the run) with ``python -m tools.dry_run --json --platform cuda`` for the same flags and
rank (run beside the training, on the CPU); the throughput row is
the last iteration's tokens/s and TFLOP/s/GPU from the training loop's own log stats
(``on_log``), as MFU of the GPU's dense bf16 peak (simulator/hardware.py's presets).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from megatron_weipipe.schedules import registry
from tools.acceptance import parity_runs
from tools.acceptance.parity import CPU_ENV, run_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = registry.names()
MEMORY_TOL = 0.15  # measured / dry run within 1 +- this
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # as the example scripts export
MIN_MFU = 0.05  # a floor, not a target: a run 10x slower than it should be fails
ROWS = (*(f"{kind}-gpu_single_node-{s}" for s in SCHEDULES for kind in ("memory", "throughput")),
        "memory-pretrain_gpt_slurm", "throughput-pretrain_gpt_slurm")
DROP = ("--data-path", "--tokenizer-type", "--tokenizer-model", "--split", "--save", "--load", "--save-interval",
        "--tensorboard-dir", "--exit-signal-handler", "--eval-interval", "--eval-iters", "--log-interval",
        "--train-iters", "--distributed-timeout-minutes", "--lr-warmup-iters")
# Local layers: what the dry run builds (it cannot build Transformer Engine's; WeiPipe uses local ones anyway).
MEASURE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--train-iters", "3",
           "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "1", "--transformer-impl", "local"]


def _options(flags: list) -> list:
    """[[flag, value...], ...] from a flag list."""
    out = []
    for tok in flags:
        if tok.startswith("--") or not out:
            out.append([tok])
        else:
            out[-1].append(tok)
    return out


def edit(flags: list, drop=(), **values) -> list:
    """``flags`` without the options in ``drop``, with ``values`` (``num_layers=4``; True:
    a bare flag) replacing or appended."""
    set_ = {f"--{k.replace('_', '-')}": v for k, v in values.items()}
    out = []
    for opt in _options(flags):
        if opt[0] in drop or opt[0] in set_:
            continue
        out += opt
    for k, v in set_.items():
        out += [k] if v is True else [k, str(v)]
    return out


def single_node_flags(gpus: int, schedule: str, logdir: str) -> list:
    """The pretrain_gpt.py flags examples/gpu_single_node.sh passes for GPUS/SCHEDULE."""
    fake = os.path.join(logdir, "fake-torchrun")
    os.makedirs(fake, exist_ok=True)
    with open(os.path.join(fake, "torchrun"), "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c 'import json, sys; "
                f"print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    os.chmod(os.path.join(fake, "torchrun"), 0o755)
    env = {**os.environ, "PATH": fake + os.pathsep + os.environ["PATH"], "GPUS": str(gpus), "SCHEDULE": schedule,
           "DATA": "unused", "TOKENIZER": "unused", "CKPT": os.path.join(logdir, "unused-ckpt")}
    out = subprocess.run(["bash", os.path.join(ROOT, "examples", "gpu_single_node.sh")], env=env, text=True,
                         capture_output=True, check=True, timeout=60).stdout
    argv = json.loads(out.strip().splitlines()[-1])
    return argv[argv.index("pretrain_gpt.py") + 1:]


def slurm_model_flags() -> list:
    """The MODEL_ARGS default of examples/pretrain_gpt_slurm.sh."""
    text = open(os.path.join(ROOT, "examples", "pretrain_gpt_slurm.sh")).read()
    m = re.search(r"MODEL_ARGS=\(\$\{MODEL_ARGS:-(.*?)\}\)", text, re.S)
    if m is None:
        raise ValueError("examples/pretrain_gpt_slurm.sh: no MODEL_ARGS=(${MODEL_ARGS:-...}) default found")
    return shlex.split(m.group(1))


def single_node_run(gpus: int, schedule: str, logdir: str) -> tuple[list, str]:
    """(flags, what was scaled) of gpu_single_node at ``schedule`` on ``gpus`` GPUs."""
    if not registry.entry(schedule).pipelined:
        flags = edit(single_node_flags(1, schedule, logdir), DROP, global_batch_size=4 * gpus)
        return flags + MEASURE, f"PP 1 x DP {gpus}, 16 layers, global batch {4 * gpus}"
    base = single_node_flags(gpus, schedule, logdir)
    extra = {"num_layers_per_virtual_pipeline_stage": 1} if registry.entry(schedule).virtual_stages else {}
    flags = edit(base, DROP, num_layers=2 * gpus, **extra)
    return flags + MEASURE, f"P {gpus}, {2 * gpus} layers (2 per rank), global batch {4 * gpus}"


def slurm_run(gpus: int) -> tuple[list, str, int]:
    """(flags, what was scaled, world) of pretrain_gpt_slurm on ``gpus`` GPUs."""
    pp = min(4, gpus)
    tp = 2 if gpus >= 2 * pp else 1
    layout = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=2 * pp,
                  global_batch_size=4 * pp)
    if pp == 1:
        layout["pipeline_schedule"] = "none"
    flags = edit(slurm_model_flags(), DROP, **layout) + MEASURE
    return flags, f"TP {tp} x PP {pp}{'' if pp > 1 else ' (no pipeline)'}, {2 * pp} layers, global batch {4 * pp}", \
        tp * pp


def _dry_run(host, name: str, flags: list, world: int) -> subprocess.Popen:
    """python -m tools.dry_run for rank 0, on the CPU at low priority, beside the GPU runs."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "tools.dry_run", *flags, "--world-size", str(world), "--json",
           "--platform", "cuda"]  # what a CUDA host builds (its attention, its fusions' decisions)
    out = open(os.path.join(host.logdir, f"dry-run-{name}.json"), "w")
    err = open(os.path.join(host.logdir, f"dry-run-{name}.log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env={**os.environ, **CPU_ENV},
                            start_new_session=True)


def _peak_tflops(gpu_name: str):
    from megatron_weipipe.simulator.hardware import DEVICES

    for key, spec in DEVICES.items():
        if key in gpu_name.lower():
            return spec.peak_tflops
    return None


def memory_row(result: dict, dry: dict | None, scaled: str) -> tuple:
    if "error" in result:
        return False, result["error"][:200], 0.0
    if dry is None:
        return False, "the dry run gave no prediction (see dry-run-*.log)", result["seconds"]
    got, want = result["peak_bytes"], dry["peak_accelerator_bytes"]
    ratio = got / want
    return abs(ratio - 1) <= MEMORY_TOL, (f"rank 0 peak {got / 2**30:.2f} GiB vs dry run {want / 2**30:.2f} GiB "
                                          f"(x{ratio:.3f}, tol +-{MEMORY_TOL:.0%}); {scaled}"), result["seconds"]


def throughput_row(result: dict, gpu_name: str, scaled: str) -> tuple:
    if "error" in result:
        return False, result["error"][:200], 0.0
    st = result["stats"]
    peak = _peak_tflops(gpu_name)
    tokens, tflops = st["tokens_per_second"], st["tflops_per_device"]
    if peak is None:
        return tokens > 0, f"{tokens:.0f} tokens/s, {tflops:.0f} TFLOP/s/GPU (no bf16 peak known for " \
                           f"{gpu_name!r}: no MFU); {scaled}", result["seconds"]
    mfu = tflops / peak
    return mfu >= MIN_MFU, (f"{tokens:.0f} tokens/s, {tflops:.0f} TFLOP/s/GPU = MFU {mfu:.1%} of {peak:g} "
                            f"(floor {MIN_MFU:.0%}); iteration 3; {scaled}"), result["seconds"]


def run(host) -> dict:
    """Every row of ROWS: the example runs (one parity-worker batch per world) and their dry runs."""
    n = host.gpus
    plans = {}  # name -> (flags, scaled, world, memory row, throughput row)
    for s in SCHEDULES:
        if registry.entry(s).pipelined and n < 2:
            continue
        flags, scaled = single_node_run(n, s, host.logdir)
        plans[f"gpu_single_node-{s}"] = (flags, scaled, n, f"memory-gpu_single_node-{s}",
                                         f"throughput-gpu_single_node-{s}")
    flags, scaled, world = slurm_run(n)
    plans["pretrain_gpt_slurm"] = (flags, scaled, world, "memory-pretrain_gpt_slurm", "throughput-pretrain_gpt_slurm")
    dry = {name: _dry_run(host, name, p[0], p[2]) for name, p in plans.items()}
    outcome = {}
    for world in sorted({p[2] for p in plans.values()}, reverse=True):
        runs = tuple(parity_runs.Run(name, {}, argv=tuple(p[0]), timeout_s=240.0) for name, p in plans.items()
                     if p[2] == world)
        outcome.update(run_batch(host, parity_runs.Batch(f"examples-w{world}", world, "nccl", runs, ENV)))
    rows = {r: (None, "needs 2+ CUDA devices (a pipeline ring)", 0.0) for r in ROWS}
    for name, (flags, scaled, world, mem_row, tput_row) in plans.items():
        proc = dry[name]
        try:
            proc.wait(timeout=host.left(600))
        except subprocess.TimeoutExpired:
            proc.kill()
        path = os.path.join(host.logdir, f"dry-run-{name}.json")
        text = open(path).read().strip()
        prediction = json.loads(text.splitlines()[-1]) if proc.returncode == 0 and text else None
        result = outcome.get(name, {"error": "no result"})
        rows[mem_row] = memory_row(result, prediction, scaled)
        rows[tput_row] = throughput_row(result, host.gpu_name, scaled)
    return rows
