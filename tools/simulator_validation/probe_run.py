"""torchrun entry used by the report's real runs: pretrain_gpt.py's model, forward step
and flags, plus one JSON line per rank and logged iteration with the byte counter's exact
counts (the log line itself rounds them to 0.1 of a unit) and the process's CPU time,
appended to $SIMPROBE_DIR/rank<r>.jsonl (through pretrain()'s ``on_log`` hook).

    SIMPROBE_DIR=/tmp/probe torchrun --nproc-per-node 2 -m tools.simulator_validation.probe_run \
        <pretrain_gpt.py flags>
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

ENV = "SIMPROBE_DIR"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(stats: dict) -> None:
    """pretrain()'s on_log hook: append this rank's record of a logged iteration."""
    import torch.distributed as dist

    rank = dist.get_rank()
    line = {"rank": rank, "iteration": stats["iteration"], "elapsed_ms": stats["elapsed_ms"],
            "cpu_s": time.process_time(), "wall_s": time.perf_counter(), "sent": stats["bytes_sent"]}
    with open(os.path.join(os.environ[ENV], f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv=None) -> int:
    """What `pretrain_gpt.py` runs (cli.run_main: parse, train, shut down), with the hook;
    a failure raises, and torchrun reports it."""
    import pretrain_gpt  # its model provider and warning filters

    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.initialize import shutdown_distributed
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.pretrain import pretrain

    logging.basicConfig(level=os.environ.get("MEGATRON_WEIPIPE_LOG_LEVEL", "WARNING"), format="%(message)s")
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        pretrain(cfg, pretrain_gpt.model_provider, forward_step, on_log=record)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
