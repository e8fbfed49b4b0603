"""Each schedule against PP=1 on the same ranks: one torchrun, the runs one after another.

    torchrun --standalone --nproc-per-node 2 tools/acceptance/parity_worker.py --backend nccl \
        --out runs.jsonl reference 1f1b weipipe-zb ...

Every run trains the same tiny Llama-style model (float32, dropout off, the bundled corpus,
3 iterations, global batch 8) on the same world; ``reference`` is PP=1 (data-parallel
over the world). Rank 0 appends one JSON line per finished run (losses and gradient norms
per iteration), so a run that hangs leaves the earlier ones on record. The backend is
chosen by the caller: ``nccl`` on GPUs, ``gloo`` with MEGATRON_WEIPIPE_FORCE_CPU=1 here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=4,
            seq_length=64, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
            disable_bias_linear=True, make_vocab_size_divisible_by=512, micro_batch_size=2, global_batch_size=8,
            train_iters=3, lr=1e-3, hidden_dropout=0, attention_dropout=0,
            data_path=os.path.join(ROOT, "data", "sample_text_document"), tokenizer_type="ByteLevelTokenizer",
            log_interval=1, eval_iters=0, seed=1234)
# What each run adds to BASE (2 ranks each).
RUNS = {
    "reference": {},
    "1f1b": dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
    "interleaved": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    "weipipe-naive": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-naive"),
    "weipipe-interleave": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-interleave"),
    "weipipe-zb": dict(pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb"),
    "fpdt-cp2": dict(context_parallel_size=2, fpdt=True, fpdt_chunk_size=16),
}
# Transformer Engine layers everywhere (WeiPipe over TE is an unverified path: allowed here,
# so this run is the check that verifies it). FPDT builds its own local-layer spec.
TE = dict(transformer_impl="transformer_engine", allow_unverified_gpu_paths=True)


def flags(name: str, backend: str, te: bool = False) -> list[str]:
    out = []
    for k, v in {**BASE, **RUNS[name], **(TE if te else {}), "distributed_backend": backend}.items():
        out += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    return out


def run(name: str, backend: str, te: bool = False) -> dict:
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    t0 = time.perf_counter()
    cfg = parse_config(flags(name, backend, te), world_size=int(os.environ["WORLD_SIZE"]))
    state = pretrain(cfg, pretrain_gpt.model_provider, forward_step)
    parallel_state.destroy_model_parallel()  # the default group stays for the next run
    return dict(name=name, losses=[float(x) for x in state.losses], grad_norms=[float(x) for x in state.grad_norms],
                seconds=round(time.perf_counter() - t0, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", required=True, choices=["nccl", "gloo"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--te", action="store_true", help="Transformer Engine layers in every run")
    ap.add_argument("runs", nargs="+", choices=list(RUNS))
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    for name in args.runs:
        try:
            result = run(name, args.backend, args.te)
        except Exception:
            result = dict(name=name, error=traceback.format_exc(limit=3)[-1500:])
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
        if "error" in result:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
