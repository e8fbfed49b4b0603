"""Pipeline schedules: the table that names them, the schedule as data, and the torch side.

- registry.py: every schedule declared once; imports no torch.
- ir/ (the format), generate/ (making action lists), check/ (proving them right,
  start-up rules), timing/ (replaying them in time): pure Python, no process group.
- runtime/: torch.distributed, model-agnostic: the WeiPipe ring runtime, flat buffers,
  traces, deferred weight gradients.
- gpt/: the GPT model adapters pretrain() runs: TrainSchedule, Megatron's schedules on
  megatron-core, the WeiPipe schedule.
"""
