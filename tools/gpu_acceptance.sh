#!/usr/bin/env bash
# GPU acceptance in one command: every check prints PASS, FAIL or SKIPPED (why), then one
# table. Checks that need no CUDA always run (and must PASS anywhere); CUDA checks run
# where torch sees a CUDA device, NCCL checks where it sees two or more.
#
#   bash tools/gpu_acceptance.sh            # exit 1 if any check FAILs
#
# Each check's output goes to $LOGDIR/<name>.log (default: a temporary folder).
set -u
cd "$(dirname "$0")/.."
LOGDIR=${LOGDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
read -r GPUS TE <<<"$(python - <<'EOF' 2>/dev/null
from megatron_weipipe.platform import detect_platform
import importlib.util, torch
p = detect_platform()
print(torch.cuda.device_count() if p.is_cuda else 0, int(p.transformer_engine_available))
EOF
)"
GPUS=${GPUS:-0}
TE=${TE:-0}
TINY="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2
      --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --lr 1e-3
      --train-iters 2 --hidden-dropout 0 --attention-dropout 0 --log-interval 1"
ROWS=()
FAILED=0

# check NAME NEEDS CMD...   (NEEDS: none | cuda | 2gpu | te)
check() {
  local name=$1 needs=$2
  shift 2
  local why=""
  case $needs in
    cuda) [ "$GPUS" -ge 1 ] || why="no CUDA device" ;;
    2gpu) [ "$GPUS" -ge 2 ] || why="needs 2+ CUDA devices, found $GPUS" ;;
    te) { [ "$GPUS" -ge 1 ] && [ "$TE" = 1 ]; } || why="needs CUDA and Transformer Engine" ;;
  esac
  if [ -n "$why" ]; then
    ROWS+=("| $name | $needs | SKIPPED ($why) |")
    return
  fi
  local t0=$SECONDS
  if timeout 600 "$@" >"$LOGDIR/$name.log" 2>&1; then
    ROWS+=("| $name | $needs | PASS ($((SECONDS - t0)) s) |")
  else
    ROWS+=("| $name | $needs | FAIL (see $LOGDIR/$name.log) |")
    FAILED=1
  fi
}

# no CUDA needed
check nccl-ordering none python tools/check_schedules.py --semantics nccl
check dry-run-weipipe none python tools/dry_run.py $TINY --world-size 2 --pipeline-model-parallel-size 2 \
  --pipeline-schedule weipipe-zb --json
check fpdt-kernels-cpu none python bench/fpdt_gpu.py --device cpu --tiny --skip overhead longest
# CUDA
check fpdt-kernels-cuda cuda python bench/fpdt_gpu.py --skip overhead longest
check fpdt-gpu-bench cuda python bench/fpdt_gpu.py
ROWS+=("| te-model-parity | te | SKIPPED (no command yet: the parity tests build megatron-core's local layers) |")
# NCCL: the schedules run to the end over NCCL (no deadlock); parity vs PP=1 is not compared here
for s in weipipe-naive weipipe-interleave weipipe-zb 1f1b; do
  check "nccl-runs-$s" 2gpu torchrun --nproc-per-node 2 pretrain_gpt.py $TINY --pipeline-model-parallel-size 2 \
    --pipeline-schedule "$s" --distributed-backend nccl
done

echo "GPU acceptance ($GPUS CUDA device(s); logs in $LOGDIR)"
echo "| check | needs | result |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit $FAILED
