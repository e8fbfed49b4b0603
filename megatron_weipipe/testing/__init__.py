"""Helpers for tests and benchmarks that run several gloo processes on one host."""

from megatron_weipipe.testing.spawn import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
