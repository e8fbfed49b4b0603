"""A process that trains more than once (the link testbed runs every job of a preset in
one process) keeps a bounded set of process groups: each run's megatron-core groups are
destroyed before the next run makes its own."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain
    from pretrain_gpt import model_provider

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 2 --train-iters 1 "
            "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128").split()
    for _ in range(3):
        pretrain(parse_config(argv), model_provider, forward_step)
        print("groups", len(dist.distributed_c10d._world.pg_map), flush=True)
""")


def test_repeated_pretrain_does_not_leak_process_groups(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("groups ")]
    assert len(counts) == 3 and counts[0] > 1, out.stdout
    assert counts[1] == counts[0] and counts[2] == counts[0], f"process groups per run: {counts}"
