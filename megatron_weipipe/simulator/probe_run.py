"""torchrun entry used by the report's real runs: pretrain_gpt.py unchanged, plus one
JSON line per rank and logged iteration with the byte counter's exact counts (the log
line itself rounds them to 0.1 of a unit) and the process's CPU time, appended to
$SIMPROBE_DIR/rank<r>.jsonl.

    torchrun --nproc-per-node 2 -m megatron_weipipe.simulator.probe_run <pretrain_gpt.py flags>
"""

from __future__ import annotations

import json
import os
import sys
import time

ENV = "SIMPROBE_DIR"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch.distributed as dist

    import megatron_weipipe.training.pretrain as loop
    from megatron_weipipe.training.byte_counter import BYTE_COUNTER

    original = loop.training_log_line

    def logged(**kw):
        rank = dist.get_rank()
        record = {"rank": rank, "iteration": kw["iteration"], "elapsed_ms": kw["elapsed_ms"],
                  "cpu_s": time.process_time(), "wall_s": time.perf_counter(),
                  "sent": BYTE_COUNTER.snapshot()["sent"]}
        with open(os.path.join(os.environ[ENV], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return original(**kw)

    loop.training_log_line = logged
    sys.path.insert(0, REPO)
    import pretrain_gpt

    return pretrain_gpt.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
