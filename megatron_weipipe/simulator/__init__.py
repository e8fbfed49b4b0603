"""Cluster projection: time, traffic and memory of a training iteration before it runs.

The simulator replays the very action lists the runtime executes (WeiPipe's generated
schedules, Megatron's 1F1B / interleaved timelines) on a model of devices and links:
per-rank compute, point-to-point transfers with the runtime's posting and waiting rules,
and ring collectives. Costs come from FLOPs and a device preset or from timing real
megatron-core layers on this host (`calibrate`). Memory is estimated per rank from the
same lists (in-flight microbatches, live buffers). See docs/how-it-works/simulator.md.
"""

from megatron_weipipe.errors import SimulatorError

__all__ = ["SimulatorError"]
