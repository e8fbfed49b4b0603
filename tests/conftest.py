import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repository (pretrain_gpt.py), and the tools and benchmarks whose helpers tests use
# (tools/host_calibration.py, bench/fpdt_util.py) by their module names.
for path in (os.path.join(ROOT, "bench"), os.path.join(ROOT, "tools"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
