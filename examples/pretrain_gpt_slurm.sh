#!/usr/bin/env bash
#SBATCH --job-name=megatron-weipipe
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --output=logs/%x-%j.out
# Multi-node pretraining: one torchrun per node, NCCL. SLURM sends SIGTERM 5 minutes before
# the time limit; --exit-signal-handler finishes the iteration, saves and exits 0, and the
# requeued job resumes from --load. See docs/cluster.md.
set -euo pipefail

DATA=${DATA:?set DATA to a preprocessed prefix}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a local tokenizer.json}
CKPT=${CKPT:-checkpoints/$SLURM_JOB_NAME}
IMAGE=${IMAGE:-}  # optional container image (enroot/pyxis), e.g. the one built from Dockerfile

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-8}
WORLD=$((SLURM_NNODES * GPUS_PER_NODE))

# megatron_weipipe.launch is torchrun that forwards SIGTERM to the ranks and exits 0 after
# they save (plain torchrun exits 1 on SIGTERM, which would stop the requeue below).
LAUNCH=(python -m megatron_weipipe.launch --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID")

ARGS=(
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --ffn-hidden-size 14336 --seq-length 32768 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --pipeline-schedule weipipe-interleave
  --micro-batch-size 1 --global-batch-size 64 --train-iters 20000
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --bf16 --recompute-granularity full --recompute-method uniform
  --data-path "$DATA" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --save "$CKPT" --load "$CKPT" --save-interval 250 --log-interval 10 --eval-interval 1000 --eval-iters 10
  --exit-signal-handler --distributed-timeout-minutes 15
)

mkdir -p logs
echo "world size $WORLD on $SLURM_NNODES nodes, checkpoints in $CKPT"
# srun forwards SIGTERM (B: sends it to the batch shell, which forwards it to the job step).
if [ -n "$IMAGE" ]; then
  srun --container-image "$IMAGE" --container-mounts "$PWD:$PWD" --container-workdir "$PWD" \
    "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" &
else
  srun "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" &
fi
STEP=$!
trap 'kill -TERM $STEP; wait $STEP' TERM
wait $STEP
STATUS=$?
# A clean exit before --train-iters (time limit or preemption): requeue and resume from --load.
if [ $STATUS -eq 0 ] && [ "$(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)" -lt 20000 ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $STATUS
