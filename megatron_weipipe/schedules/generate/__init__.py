"""Making action lists: every schedule's generator.

- weipipe.py: a WeiPipe variant's compute plan -> action lists (through builder.py,
  which derives every message); one module per variant (weipipe_naive/interleave/zb.py).
- megatron_timeline.py: Megatron's 1F1B and interleaved 1F1B, drawn and timed on the
  same footing (training runs megatron-core's own functions); zb_h1.py: ZB-H1, a baseline.
"""
