#!/usr/bin/env bash
# GPU acceptance in one command: one table, every check PASS, FAIL or SKIPPED (why).
# The logic is tools/gpu_acceptance.py (python -m tools.gpu_acceptance --help); this wrapper only runs it from the
# repository root.
#
#   bash tools/gpu_acceptance.sh                        # exit 1 if any check FAILs
#   bash tools/gpu_acceptance.sh --require-cpu-checks   # CI: also if a no-CUDA check is SKIPPED
#   bash tools/gpu_acceptance.sh --json                 # one JSON object on stdout
#   bash tools/gpu_acceptance.sh --json-out FILE        # the table, and that object in FILE
set -u
cd "$(dirname "$0")/.."
exec python -m tools.gpu_acceptance "$@"
