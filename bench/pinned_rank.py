"""torchrun entry that pins this rank to one core (LOCAL_RANK mod the cores it may use),
then runs pretrain_gpt.py with the same arguments. Used by bench/zb_trace_bubble.py as
``torchrun ... -m bench.pinned_rank FLAGS`` from the repository root (this checkout's
package, not another installed one, is first on the path)."""

import os
import runpy
import sys

cores = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.argv[0] = os.path.join(root, "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
