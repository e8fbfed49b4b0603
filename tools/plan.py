#!/usr/bin/env python
"""Rank the layouts pretrain_gpt.py accepts for a model on a cluster, fastest first, each
with the launch line that trains it (tools/planner/, docs/guide/which-layout.md).

    python -m tools.plan <pretrain_gpt.py model, batch and run flags> \
        --gpu h100 --gpus-per-node 8 --nodes 2 --link nvlink,ib [--top 5] [--confirm 1]
    python -m tools.plan --papers          # the planner's pick at the papers' settings
    python -m tools.plan --testbed-check   # its first choice against the link testbed's measurements
"""

from __future__ import annotations

import sys

from tools.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
