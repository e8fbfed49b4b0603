"""tools/dry_run.py: one real iteration of one rank under fake tensors and the fake process
group. The model state and the bytes sent are exact (they equal the simulator's byte
model and parameter counts, themselves checked against real megatron-core models and
the byte counter elsewhere); WeiPipe's circulating buffers are within 10% of the
estimator; --json prints one object; bad flags exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --lr 1e-3 --train-iters 1 --bf16 "
        "--hidden-dropout 0 --attention-dropout 0").split()


def _dry(*flags, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tools.dry_run", *TINY, *flags, "--json"],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_weipipe_rank_state_and_bytes_match_the_estimator():
    p = _dry("--global-batch-size", "8", "--world-size", "2", "--pipeline-model-parallel-size", "2",
             "--pipeline-schedule", "weipipe-zb", "--rank", "0")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)  # the whole of stdout is one object
    cats, est = out["categories"], out["estimator"]["categories"]
    assert all(isinstance(out[k], int) for k in ("peak_accelerator_bytes", "host_bytes", "sent_bytes"))
    assert sum(cats.values()) == out["peak_accelerator_bytes"]
    for role in ("parameters", "gradients"):
        assert cats[role] == est[role], role
    # Adam also keeps a 4-byte step count per parameter tensor, which the estimator leaves out
    assert 0 <= cats["optimizer_state"] - est["optimizer_state"] < 1e-3 * est["optimizer_state"]
    assert cats["parameters"] * 2 == cats["gradients"]  # bf16 weights, fp32 main grads
    # the estimator also counts the loss-flag and gradient-norm all-reduces (tens of bytes),
    # which the dry run's iteration leaves out
    assert 0 <= out["estimator"]["sent_bytes"] - out["sent_bytes"] < 64
    own = out["category_peaks"]
    assert abs(est["communication_buffers"] / own["communication_buffers"] - 1) < 0.10
    assert cats["activations"] > 0 and out["host_bytes"] == 0


def test_fpdt_offload_keeps_chunk_state_on_the_host_and_bad_flags_exit_2():
    p = _dry("--global-batch-size", "2", "--world-size", "2", "--context-parallel-size", "2", "--fpdt",
             "--fpdt-chunk-size", "32", "--fpdt-offload")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["host_bytes"] > 0 and out["estimator"]["host_bytes"] > 0
    bad = _dry("--global-batch-size", "8", "--world-size", "2", "--rank", "5")
    assert bad.returncode == 2 and "--rank" in bad.stderr


def test_fsdp_bf16_rank_state_is_its_shards_and_the_gathered_units():
    """--use-torch-fsdp2 --bf16 over 2 ranks: fp32 parameter and gradient shards (half the
    model each), Adam's two fp32 moments of the shards, and at the peak (the start of the
    backward) the bf16 weights of the root unit (output layer, final norm) and of one
    transformer layer gathered. TINY's model: vocab 1025 padded to 1152, learned positions."""
    p = _dry("--global-batch-size", "4", "--world-size", "2", "--use-torch-fsdp2",
             "--untie-embeddings-and-output-weights")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    h, vocab, n_tensors = 64, 1152, 54
    layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
    root = vocab * h + 2 * h
    model = vocab * h + 128 * h + 4 * layer + root
    shard_fp32 = 4 * model // 2
    assert out["category_peaks"]["gradients"] == shard_fp32
    assert out["categories"]["optimizer_state"] == 2 * shard_fp32 + 4 * n_tensors  # moments + step counters
    assert out["categories"]["parameters"] == shard_fp32 + 2 * (root + layer)
    est = out["estimator"]["categories"]  # the estimator's FSDP2 term (simulator/memory.py)
    assert est["parameters"] == out["categories"]["parameters"]
    assert est["gradients"] == shard_fp32
    assert abs(est["optimizer_state"] - 2 * shard_fp32) <= 4 * n_tensors


def test_estimator_within_ten_percent_of_the_dry_run_per_category():
    """tools/simulator_validation/dry_run_vs_estimator.py at the small scale for three
    schedule x long-context combinations (ones the small scale brings within 10%; see
    docs/results/memory.md for the whole table): every category (state, activations, WeiPipe
    buffers, FPDT chunk state, host bytes, sent bytes, the peak) within 10%."""
    from tools.simulator_validation.dry_run_vs_estimator import CATEGORIES, case_flags, compare, run_case

    bad = []
    for schedule, mode in (("none", "offload"), ("1f1b", "ulysses"), ("1f1b", "off")):
        flags, world, rank = case_flags("small", schedule, mode)
        rows = compare(run_case(flags, world, rank, timeout=300))
        bad += [(schedule, mode, c, rows[c]) for c in CATEGORIES if abs(rows[c][2]) > 0.10]
    assert not bad, bad
