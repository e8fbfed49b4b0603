"""The action IR: what a schedule is, as plain frozen data (no torch, no process group).

- actions.py: per-rank ordered action lists (compute, send, receive, optimizer step).
- posts.py: how a rank posts its messages, the program the WeiPipe runtime runs.
"""
