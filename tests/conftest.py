import os
import warnings

# The repository root is on sys.path (pyproject.toml's pytest `pythonpath`): tests import the
# package, pretrain_gpt.py, and the tools and benchmarks as packages (tools.dry_run, bench.fpdt_util).
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
