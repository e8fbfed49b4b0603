#!/usr/bin/env bash
#SBATCH --job-name=megatron-weipipe
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
# Submit from the repository root after `mkdir -p logs`: SLURM opens the output file before
# this script runs, and a missing directory fails the job with no output at all.
# Multi-node pretraining: one torchrun per node, NCCL. SLURM sends SIGTERM 5 minutes before
# the time limit; --exit-signal-handler finishes the iteration, saves and exits 0, and the
# requeued job resumes from --load. A crash is requeued at most MAX_CRASH_RESTARTS times.
# The same script runs on CPU nodes with a tiny model: examples/slurm_cpu.sh sets the
# environment variables below (NPROC_PER_NODE, MODEL_ARGS, DATA_ARGS, ...). See docs/guide/cluster.md.
# GPU memory: 80 GB
# tools/dry_run.py --platform cuda counts 42.2 GB at the peak (rank 8 of 32, pipeline rank 1;
# local layers with torch's fused SDPA; 128K vocabulary). tests/test_examples_fit.py checks it.
set -uo pipefail  # no -e: the exit status of the step decides what happens next

CKPT=${CKPT:-checkpoints/$SLURM_JOB_NAME}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
MAX_CRASH_RESTARTS=${MAX_CRASH_RESTARTS:-3}
IMAGE=${IMAGE:-}  # optional container image (enroot/pyxis), e.g. the one built from Dockerfile

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export PYTHONUNBUFFERED=1  # log lines reach the output file as they are printed
# Resources and model, overridable for a CPU run (examples/slurm_cpu.sh): processes per node,
# the model and parallelism flags, the data flags.
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}
WORLD=$((SLURM_NNODES * NPROC_PER_NODE))
MODEL_ARGS=(${MODEL_ARGS:-
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --ffn-hidden-size 14336 --seq-length 32768 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --pipeline-schedule weipipe-interleave
  --micro-batch-size 1 --global-batch-size 64
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --bf16 --recompute-granularity full --recompute-method uniform})
DATA_ARGS=(${DATA_ARGS:---data-path ${DATA:?set DATA to a preprocessed prefix}
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model ${TOKENIZER:?set TOKENIZER to a local tokenizer.json}})

# megatron_weipipe.launch is torchrun that forwards SIGTERM to the ranks and exits 0 after
# they save (plain torchrun exits 1 on SIGTERM, which would stop the requeue below).
LAUNCH=(python -m megatron_weipipe.launch --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID")

ARGS=(
  "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" --train-iters "$TRAIN_ITERS"
  --save "$CKPT" --load "$CKPT" --save-interval ${SAVE_INTERVAL:-250} --log-interval ${LOG_INTERVAL:-10}
  --eval-interval 1000 --eval-iters ${EVAL_ITERS:-10}
  --exit-signal-handler --distributed-timeout-minutes ${DISTRIBUTED_TIMEOUT_MINUTES:-15}
)

mkdir -p "$CKPT"
echo "$(date) run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID: world size $WORLD on $SLURM_NNODES nodes," \
     "checkpoints in $CKPT, resuming from iteration $(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
if [ -n "$IMAGE" ]; then
  srun --kill-on-bad-exit=1 --container-image "$IMAGE" --container-mounts "$PWD:$PWD" --container-workdir "$PWD" \
    "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" &
else
  srun --kill-on-bad-exit=1 "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" &
fi
STEP=$!
# SIGTERM reaches this shell only (the "B:"). srun would answer a SIGTERM of its own by killing
# the step outright, so the signal goes to the step's tasks through SLURM instead: scancel
# without --batch signals every job step and not this shell.
trap 'echo "$(date) SIGTERM: asking every rank to save and exit"; scancel --signal=TERM "$SLURM_JOB_ID"' TERM
# `wait` returns early when the trap runs; wait again for the step's own exit status.
wait "$STEP"
STATUS=$?
while kill -0 "$STEP" 2>/dev/null; do
  wait "$STEP"
  STATUS=$?
done

# Requeue unless training is complete: after a clean stop (time limit, preemption) always;
# after a crash at most MAX_CRASH_RESTARTS times per job (preemptions do not count).
DONE=$(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
echo "$(date) step exited with status $STATUS; latest checkpoint at iteration $DONE of $TRAIN_ITERS"
if [ "$DONE" -ge "$TRAIN_ITERS" ]; then
  exit "$STATUS"
fi
if [ "$STATUS" -ne 0 ]; then
  CRASHES=$(( $(cat "$CKPT/crash_restarts.$SLURM_JOB_ID" 2>/dev/null || echo 0) + 1 ))
  echo "$CRASHES" > "$CKPT/crash_restarts.$SLURM_JOB_ID"
  if [ "$CRASHES" -gt "$MAX_CRASH_RESTARTS" ]; then
    echo "$(date) error: the job step failed $CRASHES times (status $STATUS); giving up after" \
         "$MAX_CRASH_RESTARTS restarts. See the 'error:' lines above; submit again to resume from iteration $DONE."
    exit "$STATUS"
  fi
  echo "$(date) crash $CRASHES of at most $MAX_CRASH_RESTARTS restarts"
fi
echo "$(date) requeueing job $SLURM_JOB_ID"
scontrol requeue "$SLURM_JOB_ID"
exit "$STATUS"
