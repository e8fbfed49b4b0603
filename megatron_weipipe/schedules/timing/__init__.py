"""Timing a schedule.

- replay.py: the one event core that replays action lists in time (the tick simulator
  and the cluster simulator both run it).
- tick_simulator.py: unit costs; closed_forms.py: bubble, ticks and traffic read off the
  lists, and the closed forms they equal; measured.py: the same read from real traces.
"""
