"""Test support: run a function on several gloo processes on one host (spawn), gather
layout-free state (state), train small GPTs inside ranks (runs).

Lives under tests/ (importable as ``harness`` because pytest puts tests/ on sys.path and
spawned children inherit it); bench/ scripts add tests/ to sys.path to use the spawn helper.
"""

from harness.spawn import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
