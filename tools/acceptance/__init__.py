"""Checks of tools/gpu_acceptance.py (see checks.py for the list and what each needs)."""
