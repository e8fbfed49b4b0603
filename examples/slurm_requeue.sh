#!/usr/bin/env bash
#SBATCH --job-name=megatron-weipipe-requeue
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
# Submit from the repository root after `mkdir -p logs`: SLURM opens the output file before
# this script runs, and a missing directory fails the job with no output at all.
# A pretraining job that survives time limits, preemption and crashes by requeueing itself.
#
#  1. Two minutes before the time limit (or when the job is preempted) SLURM sends SIGTERM
#     to this batch shell only (the "B:"); the trap below forwards it to the job step's
#     tasks through `scancel --signal=TERM` (a SIGTERM to srun itself would kill the step).
#  2. Each node runs `python -m megatron_weipipe.launch` (torchrun with one change: SIGTERM
#     goes to the ranks instead of failing the job). With --exit-signal-handler every rank
#     finishes its iteration, they save one checkpoint together, and all exit 0.
#     (Plain torchrun would SIGKILL the ranks 30 s after SIGTERM and exit 1 even when the
#     save succeeded.)
#  3. The script requeues the job unless training is complete. The next run finds the
#     checkpoint through --load (the same directory as --save; an empty directory means a
#     fresh start) and continues with the same data order, RNG and LR schedule.
#  4. A crash (a dead node, a NaN, a bug) makes every rank exit within seconds; the job is
#     requeued at most MAX_CRASH_RESTARTS times (preemptions do not count) and resumes from
#     the last completed save, so a crash costs at most one --save-interval of work.
# The 120 s lead time must cover one iteration plus one save. The same script runs on CPU
# nodes with a tiny model: examples/slurm_cpu.sh sets NPROC_PER_NODE, MODEL_ARGS, DATA_ARGS,
# ... See docs/guide/cluster.md.
# GPU memory: 80 GB
# tools/dry_run.py --platform cuda counts 37.1 GB at the peak (rank 0 of 16; local layers with
# torch's fused SDPA; 128K vocabulary). tests/test_examples_fit.py checks it.
set -uo pipefail

CKPT=${CKPT:-checkpoints/$SLURM_JOB_NAME}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
MAX_CRASH_RESTARTS=${MAX_CRASH_RESTARTS:-3}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export PYTHONUNBUFFERED=1  # log lines reach the output file as they are printed
# Resources and model, overridable for a CPU run (examples/slurm_cpu.sh).
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}
MODEL_ARGS=(${MODEL_ARGS:-
  --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2
  --micro-batch-size 1 --global-batch-size 64
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --bf16})
DATA_ARGS=(${DATA_ARGS:---data-path ${DATA:?set DATA to a preprocessed data prefix (python -m tools.preprocess_data)}
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model ${TOKENIZER:?set TOKENIZER to a local tokenizer.json}})

# Watchdog: a rank whose heartbeat stops for this long is declared dead (default 30 s).
export MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT=${MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT:-60}

LAUNCH=(python -m megatron_weipipe.launch --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID")

ARGS=(
  "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" --train-iters "$TRAIN_ITERS"
  --save "$CKPT" --load "$CKPT" --save-interval ${SAVE_INTERVAL:-250} --log-interval ${LOG_INTERVAL:-10}
  --eval-interval 1000 --eval-iters ${EVAL_ITERS:-10}
  --exit-signal-handler --distributed-timeout-minutes ${DISTRIBUTED_TIMEOUT_MINUTES:-10}
)

mkdir -p "$CKPT"
echo "$(date) run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID; resuming from iteration" \
     "$(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"

srun --kill-on-bad-exit=1 "${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" &
STEP=$!
# srun answers a SIGTERM of its own by killing the step: signal the step's tasks through
# SLURM instead (scancel without --batch signals every job step, not this shell).
trap 'echo "$(date) SIGTERM: asking every rank to save and exit"; scancel --signal=TERM "$SLURM_JOB_ID"' TERM
# `wait` returns early when the trap runs; wait again for the step's own exit status.
wait "$STEP"
STATUS=$?
while kill -0 "$STEP" 2>/dev/null; do
  wait "$STEP"
  STATUS=$?
done

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
