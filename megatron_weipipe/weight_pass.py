"""The weight-gradient passes of a split backward: one vocabulary for the runtime, the
trainer and the simulator (each uses its own subset)."""

from __future__ import annotations

from enum import StrEnum


class WeightPass(StrEnum):
    """How a split backward (BACKWARD_INPUT / BACKWARD_WEIGHT) gets its weight gradient.

    The runtime (schedules/runtime/ring.py) runs the first three; GPT training runs
    ``DEFERRED`` (schedules/gpt/weipipe). The simulator prices ``STORED`` and ``REPLAY``
    as the runtime runs them, and ``IDEAL`` for what ``DEFERRED`` aims at: per-layer
    weight-gradient kernels costing their own FLOPs, which only FLOP-based costs can
    price (a host calibration times the autograd passes the first two run).
    """

    REPLAY = "replay"  # W is a second autograd pass over the graph I kept
    STORED = "stored"  # I computes both gradients, W adds the stored one
    DEFERRED = "deferred"  # I runs the input GEMMs, W the deferred weight GEMMs (runtime/wgrad.py)
    IDEAL = "ideal"  # the simulator's price of DEFERRED: I and W at their own FLOPs


RUNTIME_WEIGHT_PASSES = (WeightPass.REPLAY, WeightPass.STORED, WeightPass.DEFERRED)
TRAINING_WEIGHT_PASS = WeightPass.DEFERRED
SIMULATED_WEIGHT_PASSES = (WeightPass.STORED, WeightPass.REPLAY, WeightPass.IDEAL)
