"""Test support: run a function on several gloo processes on one host (spawn), gather
layout-free state (state), train small GPTs inside ranks (runs), a throw-away SLURM
cluster on this machine (local_slurm).

Tests import it as ``harness`` (pytest puts tests/ on sys.path and spawned children
inherit it); the benchmarks, run from the repository root, as ``tests.harness``.
"""

from .spawn import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
