#!/usr/bin/env python
"""Run one of Megatron-LM's own GPT/Llama launch scripts here, shrunk to a CPU shape.

    python -m tools.run_megatron_script --megatron-lm PATH/TO/Megatron-LM SCRIPT[@REVISION] \
        [--out DIR] [--nproc 2] [--dry]

The script is read from the Megatron-LM git repository (at HEAD, or at REVISION), and only
its sizes change: the model's shape, the sequence, the batch and the run's length, the
number of processes, and absolute paths (they move under --out). Every other line, every
flag among them, is Megatron-LM's. The unified diff of the changes is printed first, then
the script runs from this repository's root (its pretrain_gpt.py) with the real torchrun,
the tokenizer and data arguments set to MOCK (Megatron-LM's mock data), and W&B in offline
mode under --out. ``--dry`` prints the diff and stops. Megatron-LM's scripts end with
``set +x``, so their own exit status says nothing: the run counts as trained to its end when
its last checkpoint was published (the tracker file under --out/checkpoints), and the tool
prints that iteration and exits 0 only then.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

from tools.megatron_survey import script_text

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Shell variables of Megatron-LM's scripts and flag values: the CPU shape. Two layers of a
# 64-wide Llama (4 heads, 2 KV heads) at 64 tokens, 2 processes, 6 iterations of 8 samples.
VARIABLES = {"GPUS_PER_NODE": "2", "NUM_LAYERS": "2", "SEQ_LENGTH": "64", "MAX_POSITION_EMBEDDINGS": "64",
             "GLOBAL_BATCH_SIZE": "8", "MICRO_BATCH_SIZE": "2", "MASTER_PORT": None}
FLAG_VALUES = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
               "--num-query-groups": "2", "--kv-channels": "16", "--vocab-size": "512",
               "--train-samples": "48", "--lr-decay-samples": "40", "--lr-warmup-samples": "8",
               "--train-iters": "6", "--lr-decay-iters": "5", "--lr-warmup-iters": "1",
               "--eval-iters": "2", "--eval-interval": "3", "--save-interval": "3",
               "--profile-step-start": "2", "--profile-step-end": "4", "--distributed-timeout-minutes": "5"}
ABSOLUTE = re.compile(r"(?<![\w.-])/(?:home|scratch|lustre|workspace|data|datasets|checkpoints)/[^\s\"')]*")


def shrink(text: str, out: str, port: int, nproc: int) -> str:
    """The script with only its sizes, its port and its absolute paths changed."""
    values = dict(VARIABLES, GPUS_PER_NODE=str(nproc), MASTER_PORT=str(port))
    for name, value in values.items():
        text = re.sub(rf"^(\s*(?:export\s+)?{name}=)\S+", rf"\g<1>{value}", text, flags=re.M)
    lines = []
    for line in text.splitlines(True):
        if not line.lstrip().startswith("#"):  # comments stay as they are
            for flag, value in FLAG_VALUES.items():
                line = re.sub(rf"({re.escape(flag)}[ =])\d[\d.eE+-]*(?=[\s\"']|$)", rf"\g<1>{value}", line)
        lines.append(line)
    return ABSOLUTE.sub(lambda m: os.path.join(out, "paths", m.group(0).lstrip("/")), "".join(lines))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM git repository (clone or mirror)")
    ap.add_argument("script", help="path inside it, with @REVISION for a script not on its main branch")
    ap.add_argument("--out", help="checkpoints, TensorBoard, W&B and moved paths (default: a new temporary directory)")
    ap.add_argument("--nproc", type=int, default=2, help="processes (the script's GPUS_PER_NODE)")
    ap.add_argument("--dry", action="store_true", help="print the changes and stop")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="megatron_script_"))
    original = script_text(a.megatron_lm, a.script)
    shrunk = shrink(original, out, _free_port(), a.nproc)
    sys.stdout.writelines(difflib.unified_diff(original.splitlines(True), shrunk.splitlines(True),
                                               a.script, f"{a.script} (CPU shape)"))
    if a.dry:
        return 0
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, os.path.basename(a.script.partition("@")[0]))
    with open(path, "w") as f:
        f.write(shrunk)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=out, OMP_NUM_THREADS="1", USE_UV="0")
    print(f"\n> bash {path} {out}/checkpoints {out}/tensorboard MOCK MOCK   (in {REPO_ROOT})", flush=True)
    subprocess.run(["bash", path, f"{out}/checkpoints", f"{out}/tensorboard", "MOCK", "MOCK"], cwd=REPO_ROOT,
                   env=env)
    tracker = os.path.join(out, "checkpoints", "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        print(f"> no checkpoint was published ({tracker} is missing): the run did not finish", file=sys.stderr)
        return 1
    print(f"> last checkpoint published: iteration {open(tracker).read().strip()} in {out}/checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
