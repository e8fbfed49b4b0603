"""A process that trains more than once (the link testbed runs every job of a preset in
one process) keeps a bounded set of process groups: each run's megatron-core groups are
destroyed before the next run makes its own, and FSDP2 after that gets the new groups."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain
    from pretrain_gpt import model_provider

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 2 --train-iters 2 "
            "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
            "--untie-embeddings-and-output-weights").split()
    runs = {{"fsdp": ["--use-torch-fsdp2"], "1f1b": ["--pipeline-model-parallel-size", "2"]}}
    for name in ("fsdp", "1f1b", "fsdp", "1f1b"):
        pretrain(parse_config(base + runs[name]), model_provider, forward_step)
        with open(f"groups.{{dist.get_rank()}}", "a") as f:
            f.write(f"{{name}} {{len(dist.distributed_c10d._world.pg_map)}}\\n")
""")


def test_repeated_pretrain_does_not_leak_process_groups(tmp_path):
    script = tmp_path / "runs.py"
    script.write_text(SCRIPT.format())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT  # the package and pretrain_gpt.py of this checkout
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs: dict = {}  # (rank, schedule) -> process groups after each of its runs
    for rank in (0, 1):
        for line in (tmp_path / f"groups.{rank}").read_text().splitlines():
            name, n = line.split()
            runs.setdefault((rank, name), []).append(int(n))
    assert len(runs) == 4 and all(len(v) == 2 for v in runs.values()), runs
    assert all(v[0] > 1 and v[1] == v[0] for v in runs.values()), f"process groups after each run: {runs}"
