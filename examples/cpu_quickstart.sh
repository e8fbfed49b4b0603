#!/usr/bin/env bash
# Train a tiny GPT on the bundled sample corpus with 4 CPU processes (gloo):
# pipeline parallel 2 x data parallel 2, 50 iterations, checkpoints every 25.
# Usage: bash examples/cpu_quickstart.sh [extra pretrain_gpt.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}
CKPT=${CKPT:-checkpoints/quickstart}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
  --micro-batch-size 2 --global-batch-size 16 --train-iters 50 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path data/sample_text_document --tokenizer-type ByteLevelTokenizer --split 98,2,0 \
  --save "$CKPT" --load "$CKPT" --save-interval 25 \
  --log-interval 5 --eval-interval 25 --eval-iters 2 \
  "$@"
