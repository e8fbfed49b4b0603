"""Proving a schedule right without a process group.

- execution.py: the walker that runs the lists against each other (buffered, as gloo);
  nccl.py: the same under NCCL's point-to-point semantics, over posts.py's programs;
  calls.py: megatron-core's p2p calls over a 1F1B list, for that check.
- validate.py: symbolic execution, every compute action checked for the right weights
  and gradient contributions.
- rules.py: each schedule's start-up rules (flags it cannot run).
"""
