#!/usr/bin/env python
"""Project a training run before spending a GPU-hour: per schedule, iteration time,
tokens/s, MFU, bubble, bytes per rank per link, peak memory per rank, a timeline PNG.

    python -m tools.simulate --bf16 --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
        --seq-length 16384 --micro-batch-size 1 --global-batch-size 128 \
        --pipeline-model-parallel-size 8 --gpu h100 --link nvlink,ib \
        --schedules 1f1b,interleaved,weipipe-interleave,weipipe-zb --plot out.png

See docs/how-it-works/simulator.md. Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import sys

from megatron_weipipe.simulator.cli import main
from megatron_weipipe.training import host_calibration

if __name__ == "__main__":
    sys.exit(main(calibrator=host_calibration))
