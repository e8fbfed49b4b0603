"""The layout planner behind tools/plan.py: space.py (the layouts pretrain_gpt.py accepts),
evaluate.py (estimator bytes, simulated speed), search.py (the memory ladder, ranking),
confirm.py (the dry run of a pick), cli.py, testbed_check.py (first choices against the
link testbed's measurements), papers.py (the papers' settings)."""
