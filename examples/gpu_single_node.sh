#!/usr/bin/env bash
# One node, 8 GPUs (NCCL, bf16; WeiPipe runs local layers, Transformer Engine ones only with
# --allow-unverified-gpu-paths).
# A Llama-style 1B model at 16K tokens under the WeiPipe interleaved schedule over 8 ranks.
# GPU memory: 80 GB
# On a GPU WeiPipe builds megatron-core's local layers with torch's fused SDPA attention:
# tools/dry_run.py --platform cuda counts 28.1 GB at the peak (rank 1 of 8; 128K vocabulary;
# 190.7 GB with --attention-backend unfused). tests/test_examples_fit.py checks the fit.
# Usage: DATA=/path/to/corpus_text_document TOKENIZER=/path/to/tokenizer.json bash examples/gpu_single_node.sh [flags]
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
DATA=${DATA:?set DATA to a preprocessed prefix (python -m tools.preprocess_data)}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a local tokenizer.json}
CKPT=${CKPT:-checkpoints/gpu_single_node}
SCHEDULE=${SCHEDULE:-weipipe-interleave}

export CUDA_DEVICE_MAX_CONNECTIONS=1

exec torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py \
  --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
  --ffn-hidden-size 8192 --seq-length 16384 --max-position-embeddings 16384 \
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu \
  --disable-bias-linear --untie-embeddings-and-output-weights \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size "$GPUS" --pipeline-schedule "$SCHEDULE" \
  --micro-batch-size 1 --global-batch-size $((GPUS * 4)) --train-iters 5000 \
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 200 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
  --bf16 --recompute-granularity full --recompute-method uniform \
  --data-path "$DATA" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --split 990,9,1 \
  --save "$CKPT" --load "$CKPT" --save-interval 500 \
  --log-interval 10 --eval-interval 500 --eval-iters 10 --tensorboard-dir "$CKPT/tensorboard" \
  --exit-signal-handler \
  "$@"
