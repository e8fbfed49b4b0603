#!/usr/bin/env bash
# Build the CPU image from a local Debian base and run it for real:
#   1. the base: `debootstrap --variant=minbase bookworm` imported as $BASE_IMAGE (reused when present);
#   2. the image: the repository's Dockerfile with BASE=$BASE_IMAGE and a CPU torch;
#   3. the CPU quickstart (4 ranks) stopped at iteration 25, checkpoints on a mounted directory;
#   4. the quickstart again in a new container on the same directory: resumes at 25, ends at 50;
#   5. `pretrain_gpt.py --help`, and a bad flag (one line on stderr, exit code 2).
# Usage: bash tools/docker_smoke.sh [OUT_DIR]   (logs, checkpoints and facts.env land in OUT_DIR)
# Starts dockerd only when no daemon answers, and stops only what it started, by PID.
# Every step has a time limit. Exit code 0: all checks passed; otherwise one line says which failed.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$(mktemp -d /tmp/docker_smoke.XXXXXX)}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BASE_IMAGE=${BASE_IMAGE:-megatron-weipipe-base:bookworm}
IMAGE=${IMAGE:-megatron-weipipe:cpu}
HOST_PYTHON=${HOST_PYTHON:-python3}
TORCH=${TORCH:-torch==$("$HOST_PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 2.13.0+cpu)}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-1800}
TAG="mw-smoke-$$"
STARTED_DOCKERD="" HTTP_PID="" DOCKER=""

say() { echo "[docker_smoke] $*"; }
fail() { echo "docker_smoke: $*" >&2; exit 1; }

cleanup() {
  set +e
  if [ -n "$DOCKER" ]; then
    for c in $($DOCKER ps -aq --filter "name=^$TAG-" 2>/dev/null); do timeout 60 $DOCKER rm -f "$c" >/dev/null 2>&1; done
  fi
  if [ -n "$HTTP_PID" ]; then kill "$HTTP_PID" 2>/dev/null; wait "$HTTP_PID" 2>/dev/null; fi
  if [ -n "$STARTED_DOCKERD" ]; then
    kill -TERM "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$STARTED_DOCKERD" 2>/dev/null
    say "stopped the dockerd it started (pid $STARTED_DOCKERD)"
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# A docker CLI that builds with BuildKit (secrets, cache mounts): buildx, or a CLI with BuildKit built in.
for cli in docker /usr/bin/docker; do
  command -v "$cli" >/dev/null || continue
  if $cli buildx version >/dev/null 2>&1 || DOCKER_BUILDKIT=1 $cli build --help 2>/dev/null | grep -q -- '--secret'; then
    DOCKER=$cli; break
  fi
done
[ -n "$DOCKER" ] || fail "no docker CLI that can build with BuildKit (install docker.io: tools/install_docker.sh)"
export DOCKER_BUILDKIT=1

# The daemon: use a running one, or start one and remember its PID.
if ! timeout 20 $DOCKER info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || fail "no docker daemon running and no dockerd to start (tools/install_docker.sh)"
  setsid dockerd >"$OUT/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  say "started dockerd (pid $STARTED_DOCKERD, log $OUT/dockerd.log)"
  for _ in $(seq 120); do timeout 10 $DOCKER info >/dev/null 2>&1 && break
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || fail "dockerd exited: $(tail -n 1 "$OUT/dockerd.log")"; sleep 0.5; done
  timeout 10 $DOCKER info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s (log: $OUT/dockerd.log)"
fi

# 1. The base image.
t0=$(date +%s)
if timeout 60 $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "base $BASE_IMAGE: reused"
else
  command -v debootstrap >/dev/null || fail "no $BASE_IMAGE and no debootstrap to make it (tools/install_docker.sh)"
  ROOTFS="$OUT/rootfs"
  timeout 900 debootstrap --variant=minbase bookworm "$ROOTFS" http://deb.debian.org/debian >"$OUT/debootstrap.log" 2>&1 \
    || fail "debootstrap failed: $(tail -n 1 "$OUT/debootstrap.log")"
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" -c . | timeout 600 $DOCKER import -c 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$ROOTFS"
  say "base $BASE_IMAGE: made with debootstrap in $(( $(date +%s) - t0 )) s"
fi
BASE_SECONDS=$(( $(date +%s) - t0 ))

# 2. The image. pip inside the build trusts the host pip's CA and sees its local wheel
# directories (served on 127.0.0.1 for the build only); both come in as build secrets.
build_args=(--network host --progress plain --build-arg "BASE=$BASE_IMAGE" --build-arg "TORCH=$TORCH"
            --build-arg OMP_NUM_THREADS=1)
cert=${PIP_CERT:-$("$HOST_PYTHON" -m pip config get global.cert 2>/dev/null || true)}
[ -n "$cert" ] && [ -f "$cert" ] && build_args+=(--secret "id=pip_cert,src=$cert")
links=${PIP_FIND_LINKS:-$("$HOST_PYTHON" -m pip config get global.find-links 2>/dev/null || true)}
wheels=""
for d in $links; do d=${d#file://}; [ -d "$d" ] && { wheels=$d; break; }; done
if [ -n "$wheels" ]; then
  setsid "$HOST_PYTHON" -m http.server 0 --bind 127.0.0.1 --directory "$wheels" >"$OUT/wheels_http.log" 2>&1 &
  HTTP_PID=$!
  port=""
  for _ in $(seq 40); do port=$(sed -n 's/.*port \([0-9]*\).*/\1/p' "$OUT/wheels_http.log" | head -n 1); [ -n "$port" ] && break; sleep 0.25; done
  [ -n "$port" ] || fail "could not serve $wheels for the build"
  printf '[global]\nfind-links = http://127.0.0.1:%s/\n' "$port" >"$OUT/pip.conf"
  build_args+=(--secret "id=pip_conf,src=$OUT/pip.conf")
  ls "$wheels"/torch-"${TORCH#torch==}"-*.whl >/dev/null 2>&1 && build_args+=(--build-arg TORCH_INDEX=)
fi
say "building $IMAGE from $BASE_IMAGE with $TORCH (log $OUT/build.log)"
t0=$(date +%s)
timeout "$BUILD_TIMEOUT" $DOCKER build "${build_args[@]}" -t "$IMAGE" "$REPO" >"$OUT/build.log" 2>&1 \
  || fail "docker build failed or took over $BUILD_TIMEOUT s: $(tail -n 3 "$OUT/build.log" | tr '\n' ' ')"
BUILD_SECONDS=$(( $(date +%s) - t0 ))
if [ -n "$HTTP_PID" ]; then kill "$HTTP_PID"; wait "$HTTP_PID" 2>/dev/null || true; HTTP_PID=""; fi
IMAGE_BYTES=$(timeout 60 $DOCKER image inspect -f '{{.Size}}' "$IMAGE")
BASE_BYTES=$(timeout 60 $DOCKER image inspect -f '{{.Size}}' "$BASE_IMAGE")
IMAGE_TORCH=$(timeout 120 $DOCKER run --name "$TAG-version" --rm "$IMAGE" python -c 'import torch; print(torch.__version__)')
say "built in $BUILD_SECONDS s: $IMAGE $((IMAGE_BYTES / 1000000)) MB (base $((BASE_BYTES / 1000000)) MB), torch $IMAGE_TORCH"

# 3./4. The quickstart in two containers sharing a checkpoint directory.
CKPT="$OUT/ckpt"; rm -rf "$CKPT"; mkdir -p "$CKPT"
run_quickstart() {  # name, log, extra flags...
  local name=$1 log=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$RUN_TIMEOUT" $DOCKER run --name "$TAG-$name" --rm --ipc=host -v "$CKPT:/ckpt" -e CKPT=/ckpt/quickstart \
    "$IMAGE" bash examples/cpu_quickstart.sh "$@" >"$log" 2>&1 \
    || fail "quickstart ($name) failed or took over $RUN_TIMEOUT s: $(grep -m 1 '^error:' "$log" || tail -n 1 "$log")"
  say "quickstart ($name): $(( $(date +%s) - t0 )) s"
}
run_quickstart first "$OUT/quickstart_first.log" --exit-interval 25
grep -q "exiting at iteration 25" "$OUT/quickstart_first.log" || fail "first container did not stop at iteration 25"
[ "$(cat "$CKPT/quickstart/latest_checkpointed_iteration.txt")" = 25 ] || fail "no checkpoint at iteration 25 on the volume"
run_quickstart resumed "$OUT/quickstart_resumed.log"
grep -q "loaded checkpoint from /ckpt/quickstart at iteration 25" "$OUT/quickstart_resumed.log" \
  || fail "second container did not resume from iteration 25"
[ "$(cat "$CKPT/quickstart/latest_checkpointed_iteration.txt")" = 50 ] || fail "no checkpoint at iteration 50 on the volume"

# 5. The entry point: --help, and one bad flag.
timeout 300 $DOCKER run --name "$TAG-help" --rm "$IMAGE" python pretrain_gpt.py --help >"$OUT/help.log" 2>&1 \
  || fail "pretrain_gpt.py --help failed in the container"
grep -q -- "--pipeline-schedule" "$OUT/help.log" || fail "--help does not list --pipeline-schedule"
rc=0
timeout 300 $DOCKER run --name "$TAG-bad" --rm "$IMAGE" python pretrain_gpt.py --num-layers 4 --hidden-size 128 \
  --num-attention-heads 4 --seq-length 256 --train-iters 5 --data-path data/sample_text_document \
  --tokenizer-type ByteLevelTokenizer --pipeline-schedule zigzag >"$OUT/bad_flag.out" 2>"$OUT/bad_flag.err" || rc=$?
[ "$rc" = 2 ] || fail "bad flag: exit code $rc, expected 2"
[ "$(wc -l <"$OUT/bad_flag.err")" = 1 ] && grep -q "^error: --pipeline-schedule 'zigzag' is unknown" "$OUT/bad_flag.err" \
  || fail "bad flag: stderr is not one error line: $(head -c 300 "$OUT/bad_flag.err")"

cat >"$OUT/facts.env" <<EOF
BASE_IMAGE=$BASE_IMAGE
IMAGE=$IMAGE
TORCH=$IMAGE_TORCH
BASE_SECONDS=$BASE_SECONDS
BUILD_SECONDS=$BUILD_SECONDS
BASE_BYTES=$BASE_BYTES
IMAGE_BYTES=$IMAGE_BYTES
EOF
say "all checks passed; logs in $OUT"
grep -hoE 'iteration +[0-9]+/ +50 .*lm loss: [0-9.E+-]+|validation loss at iteration [0-9]+ \| lm loss value: [0-9.E+-]+' \
  "$OUT/quickstart_first.log" "$OUT/quickstart_resumed.log" | sed -E 's/ \| consumed.*lm loss:/ lm loss:/'
