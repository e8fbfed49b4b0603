#!/usr/bin/env bash
# The megatron-core part of the test suite on the newest megatron-core (0.19, Python 3.12),
# in its own virtual environment beside the main one.
#
#   bash tools/test_newest_mcore.sh                 # the megatron-core part (CI)
#   bash tools/test_newest_mcore.sh tests           # the whole suite
#   bash tools/test_newest_mcore.sh --install-only  # only the environment's packages (CI runs this beside
#                                                   # the README's tests: mostly a download)
#
# MCORE_VERSION (default 0.19.2), TORCH_VERSION (default 2.13.0) and VENV (default
# .venv-mcore-newest) choose what is installed. On Python 3.12 the registry's torch is the
# CUDA build (about 5.5 GB); it runs on CPU like the CPU build. The Python already on PATH
# (megatron-core 0.16 after the README's install) is the other side of the cross-release
# checkpoint test (MEGATRON_WEIPIPE_OTHER_PYTHON). Exit status 3 when no Python 3.12 is found
# (nothing was tested), else pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE_VERSION="${MCORE_VERSION:-0.19.2}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VENV:-.venv-mcore-newest}"

find_python312() {
  command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" 2>/dev/null && { command -v python3.12; return; }
  local root
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1
}
PY="$(find_python312)"
if [ -z "$PY" ]; then
  echo "test_newest_mcore: no Python 3.12 found (megatron-core >= 0.17 needs it); nothing tested" >&2
  exit 3
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "megatron-core==$MCORE_VERSION" regex psutil numpy einops \
  pytest pytest-timeout tokenizers sentencepiece "transformers>=5" safetensors tiktoken wandb tensorboard
if [ "${1:-}" = "--install-only" ]; then  # the project itself later: its egg-info is written in the checkout
  echo "test_newest_mcore: packages installed in $(( $(date +%s) - start )) s"
  exit 0
fi
"$VENV/bin/pip" install -q --no-deps -e .
echo "test_newest_mcore: $("$VENV/bin/python" -W ignore -c 'import sys, torch, megatron.core as m; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}")' 2>/dev/null), installed in $(( $(date +%s) - start )) s"

# The tests that build megatron-core's model, schedules, optimizer, checkpoints and datasets.
MCORE_TESTS=(
  tests/test_foundation_parity.py tests/test_foundation_resume.py tests/test_foundation_bad_input.py
  tests/test_weipipe_gpt_parity.py tests/test_weipipe_gpt_checkpoint.py tests/test_fpdt_megatron.py
  tests/test_long_context_parity.py tests/test_checkpoint_resharding.py tests/test_faults_corrupt.py
  tests/test_data_datasets.py tests/test_data_tokenizers.py tests/test_hf_llama.py tests/test_megatron_flags.py
  tests/test_fsdp.py tests/test_layer_offload.py tests/test_packed_parity.py tests/test_mcore_versions.py
  tests/test_weipipe_grad_overlap.py tests/test_layout_invariant_init.py tests/test_ddp_options.py
  tests/test_ddp_flag_rules.py tests/test_async_save.py tests/test_faults_async_save.py
  tests/test_per_token_loss.py tests/test_selective_recompute.py
  tests/test_batch_size_rampup.py
  tests/test_data_bpe_tokenizers.py tests/test_data_loader_flags.py tests/test_wandb_logging.py
  tests/test_optimizer_offload.py tests/test_fsdp2_options.py
)
export MEGATRON_WEIPIPE_OTHER_PYTHON="${MEGATRON_WEIPIPE_OTHER_PYTHON-$(command -v python || true)}"
if [ "$#" -gt 0 ]; then MCORE_TESTS=("$@"); fi
OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not docker and not slurm and not two_nodes" "${MCORE_TESTS[@]}"
