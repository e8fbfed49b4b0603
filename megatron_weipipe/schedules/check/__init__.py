"""Proving a schedule right without a process group.

- walker.py: the one walker, the order in which ranks' steps run; every interpreter of
  the lists (the checks below and timing/replay.py) brings its rules to it.
- execution.py: `walk`, the lists run against each other (buffered, as gloo);
  nccl.py: the same under NCCL's point-to-point semantics, over ir/posts.py's programs;
  calls.py: megatron-core's p2p calls over a 1F1B list, for that check and the replay.
- validate.py: symbolic execution, every compute action checked for the right weights
  and gradient contributions.
- rules.py: each schedule's start-up rules (flags it cannot run).
"""
