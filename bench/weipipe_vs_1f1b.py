"""Tokens/s and bytes moved: 1F1B vs WeiPipe-Interleave vs WeiPipe-ZB on one GPT, 1K..16K tokens.

The three schedules train the same model (same initialisation, same data stream) in
the same two processes (a pipeline / ring of P=2, one process per core), one training
iteration each in turn (rotating the order every round), after a warm-up round; each
timing is the slowest rank's, between barriers. Reported per sequence length: median
tokens/s of each schedule, the median of the per-round ratios to 1F1B, the CPU seconds
a rank spends per iteration (process time, slowest rank: the work, whatever else shares
the cores), and the bytes each rank sends per iteration by kind (activations / weights /
gradients / collectives) from the byte counter of the log line. The last lines name the
shortest sequence at which WeiPipe moves fewer bytes than 1F1B. See
shared/design/MEASURING.md: only ratios within one run, and counts, mean anything on
shared CPUs.

Attention is the trainer's own CPU core attention (--attention-backend auto: torch's
scaled_dot_product_attention, the CPU flash kernel; megatron-core's unfused attention's
s x s score matrix would not fit at 16K); every schedule runs the same layers. Rotary positions (no position-embedding table,
whose gradient all-reduce would otherwise dominate WeiPipe's collectives at 16K).

  OMP_NUM_THREADS=1 python -m bench.weipipe_vs_1f1b
  OMP_NUM_THREADS=1 python -m bench.weipipe_vs_1f1b --seqs 1024 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from tests.harness import run_distributed

SCHEDULES = ("1f1b", "weipipe-interleave", "weipipe-zb")


def model_args(seq: int, a) -> list[str]:
    gbs = a.micro_batch * a.microbatches
    return [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--position-embedding-type", "rope",
        "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(gbs),
        "--train-iters", "1000", "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--mock-data", "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "128",
        "--pipeline-model-parallel-size", "2", "--eval-iters", "0", "--seed", "1234",
    ]


class Trainer:
    """One schedule's model, optimizer and data stream; `step()` is one training iteration."""

    def __init__(self, name: str, seq: int, a, ctx, vocab, tokenizer):
        from megatron_weipipe.arguments import parse_config
        from megatron_weipipe.data.datasets import build_data_loader, build_train_valid_test_datasets
        from megatron_weipipe.model.gpt import build_gpt_model
        from megatron_weipipe.schedules.registry import train_class
        from megatron_weipipe.training.optimizer import build_optimizer

        cfg = parse_config(model_args(seq, a) + ["--pipeline-schedule", name], world_size=2)
        self.schedule = train_class(name)(cfg, ctx)

        def provider(pre_process=True, post_process=True, vp_stage=None):
            return build_gpt_model(cfg, vocab, pre_process, post_process, vp_stage)

        chunks = self.schedule.build_model(provider)
        self.optimizer = build_optimizer(cfg, chunks)
        samples = a.micro_batch * a.microbatches * (a.rounds + 2)
        train_ds, _, _ = build_train_valid_test_datasets(cfg.data, tokenizer, [samples, 0, 0])
        rank, size, self.n_mb = self.schedule.data_shard()
        self.data = iter(build_data_loader(train_ds, a.micro_batch, 0, rank, size))

    def step(self) -> dict:
        from megatron_weipipe.model.gpt_step import forward_step
        counter = self.schedule.ctx.bytes
        mbs = [next(self.data) for _ in range(self.n_mb)]
        counter.reset()
        self.schedule.zero_grad()
        self.optimizer.zero_grad()
        self.schedule.forward_backward(forward_step, mbs)
        self.optimizer.step()
        return dict(counter.snapshot()["sent"])


def _rank(rank: int, world: int, a) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.data.tokenizers import build_tokenizer
    from megatron_weipipe.host_values import all_reduce_values
    from megatron_weipipe.initialize import initialize_distributed
    from megatron_weipipe.shape import padded_vocab_size

    torch.set_num_threads(1)
    results = {}
    for seq in a.seqs:
        cfg = parse_config(model_args(seq, a), world_size=world)
        ctx = initialize_distributed(cfg)
        tokenizer = build_tokenizer("ByteLevelTokenizer", None, None)
        vocab = padded_vocab_size(tokenizer.vocab_size, 128, 1)
        trainers = {n: Trainer(n, seq, a, ctx, vocab, tokenizer) for n in SCHEDULES}
        times = {n: [] for n in SCHEDULES}
        cpu = {n: [] for n in SCHEDULES}
        sent = {}
        for r in range(a.rounds + 1):  # round 0 is the warm-up
            order = SCHEDULES[r % 3:] + SCHEDULES[:r % 3]
            for n in order:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                sent[n] = trainers[n].step()
                wall, proc = all_reduce_values([time.perf_counter() - t0, time.process_time() - c0], ctx.platform,
                                               op=dist.ReduceOp.MAX)  # the slowest rank's
                if r > 0:
                    times[n].append(wall)
                    cpu[n].append(proc)
        results[seq] = {"times": times, "cpu": cpu, "sent": sent}
        del trainers
    return results


def _fmt_mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(per_rank: list[dict], a) -> str:
    tokens = a.micro_batch * a.microbatches  # samples per iteration, times seq below
    head = ("| seq | tokens/s 1f1b | tokens/s wp-interleave (x 1f1b) | tokens/s wp-zb (x 1f1b) "
            "| CPU s/iter 1f1b / wp-int / wp-zb | MiB sent/rank/iter 1f1b | wp-interleave | wp-zb |")
    lines = [head, "|" + "---|" * 8]
    crossover = {}
    for seq in a.seqs:
        times = per_rank[0][seq]["times"]
        cpu = " / ".join(f"{statistics.median(per_rank[0][seq]['cpu'][n]):.2f}" for n in SCHEDULES)
        tps = {n: tokens * seq / statistics.median(times[n]) for n in SCHEDULES}
        ratio = {n: statistics.median(b / t for b, t in zip(times["1f1b"], times[n])) for n in SCHEDULES}
        # bytes: mean over ranks of the total each rank sends, by kind
        sent = {}
        for n in SCHEDULES:
            kinds: dict[str, float] = {}
            for r in per_rank:
                for k, v in r[seq]["sent"][n].items():
                    kinds[k] = kinds.get(k, 0.0) + v / len(per_rank)
            sent[n] = kinds
        total = {n: sum(sent[n].values()) for n in SCHEDULES}
        for n in SCHEDULES[1:]:
            if n not in crossover and total[n] < total["1f1b"]:
                crossover[n] = seq

        def cell(n):
            parts = ", ".join(f"{k} {_fmt_mb(v)}" for k, v in sorted(sent[n].items()) if v)
            return f"{_fmt_mb(total[n])} ({parts})"

        lines.append(
            f"| {seq} | {tps['1f1b']:.0f} | {tps['weipipe-interleave']:.0f} ({ratio['weipipe-interleave']:.2f}) "
            f"| {tps['weipipe-zb']:.0f} ({ratio['weipipe-zb']:.2f}) | {cpu} | {cell('1f1b')} | {cell('weipipe-interleave')} "
            f"| {cell('weipipe-zb')} |"
        )
    for n in SCHEDULES[1:]:
        where = f"from seq {crossover[n]}" if n in crossover else "at none of these lengths"
        lines.append(f"{n} sends fewer bytes per rank than 1f1b {where}.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4, help="per iteration (G = this / 2 per ring rank)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--timeout", type=float, default=3000)
    a = p.parse_args()
    t0, load0 = time.time(), os.getloadavg()[0]
    per_rank = run_distributed(_rank, 2, a, timeout=a.timeout, env={"OMP_NUM_THREADS": "1"})
    print(f"# {time.strftime('%Y-%m-%d')}: P=2 ranks, 1 thread each; layers={a.layers} hidden={a.hidden} "
          f"heads={a.heads} micro-batch={a.micro_batch} microbatches/iter={a.microbatches}; float32; "
          f"median of {a.rounds} rounds after 1 warm-up; wall {time.time() - t0:.0f}s; "
          f"host load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("# command: OMP_NUM_THREADS=1 python -m bench.weipipe_vs_1f1b " + " ".join(sys.argv[1:]))
    print(report(per_rank, a))


if __name__ == "__main__":
    main()
