"""Pipeline schedules in three layers, plus the table that names them.

- registry.py: every schedule declared once (name, family, plan, training class,
  start-up rules as lazy import paths); imports no torch.
- plan/: schedules as data, pure Python: action IR, WeiPipe message builder and one
  module per WeiPipe variant, Megatron timelines, walker, validator, metrics, the event
  core with the tick simulator, start-up rules.
- runtime/: torch.distributed, model-agnostic: the WeiPipe ring runtime, flat buffers.
- train/: the GPT adapter pretrain() runs: TrainSchedule, Megatron's schedules on
  megatron-core, the WeiPipe schedule.
"""
