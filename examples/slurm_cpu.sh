#!/usr/bin/env bash
# Submit a SLURM example (examples/pretrain_gpt_slurm.sh or examples/slurm_requeue.sh) on CPU
# nodes with a tiny model: the same script, with CPU resources and a small model set through
# its environment variables. The tests submit it this way (tests/test_slurm_*.py).
# Usage: bash examples/slurm_cpu.sh examples/slurm_requeue.sh [sbatch options...]
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=${1:?usage: slurm_cpu.sh SCRIPT [sbatch options...]}
shift

export NPROC_PER_NODE=${NPROC_PER_NODE:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MODEL_ARGS=${MODEL_ARGS:-"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-decay-style constant
  --hidden-dropout 0.1 --attention-dropout 0.1 --seed 1234"}
export DATA_ARGS=${DATA_ARGS:-"--data-path $PWD/data/sample_text_document --tokenizer-type ByteLevelTokenizer"}
export TRAIN_ITERS=${TRAIN_ITERS:-40} SAVE_INTERVAL=${SAVE_INTERVAL:-20} LOG_INTERVAL=${LOG_INTERVAL:-1}
export EVAL_ITERS=${EVAL_ITERS:-0} DISTRIBUTED_TIMEOUT_MINUTES=${DISTRIBUTED_TIMEOUT_MINUTES:-2}

exec sbatch --nodes="${NODES:-1}" --gpus-per-node=0 --cpus-per-task="${CPUS_PER_TASK:-2}" \
  --time="${TIME_LIMIT:-30}" --chdir="$PWD" "$@" "$SCRIPT"
