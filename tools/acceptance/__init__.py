"""Checks of ``python -m tools.gpu_acceptance`` (see checks.py for the list and what each needs)."""
