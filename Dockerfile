# megatron_weipipe in a container. One Dockerfile, two kinds of base:
#
# GPU (default): an NGC PyTorch image; its CUDA, NCCL, torch, transformer-engine and apex are kept.
#   DOCKER_BUILDKIT=1 docker build -t megatron-weipipe .
#   docker run --gpus all --ipc=host --rm megatron-weipipe bash examples/gpu_single_node.sh
#
# CPU: any Debian or Python base (no Python at all is fine); TORCH names the torch to install.
#   DOCKER_BUILDKIT=1 docker build -t megatron-weipipe:cpu --build-arg BASE=python:3.11-slim-bookworm \
#     --build-arg TORCH=torch==2.13.0 --build-arg OMP_NUM_THREADS=1 .
#   docker run --ipc=host --rm megatron-weipipe:cpu bash examples/cpu_quickstart.sh
#
# pip settings come in as build secrets, never as layers: --secret id=pip_cert,src=CA_BUNDLE
# (a proxy's CA) and --secret id=pip_conf,src=PIP_CONF (indexes, find-links). docs/guide/docker.md
# has the measured sizes and build times, and the cluster commands.
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A bare Debian base has no Python; Debian's own Python refuses pip installs, so use a venv.
RUN if ! python3 -m pip --version >/dev/null 2>&1; then \
      apt-get update && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv; \
    fi
ENV PATH=/opt/venv/bin:$PATH

# Empty: keep the base image's torch. Otherwise a pip requirement, taken from TORCH_INDEX
# (empty: from pip's configured indexes).
ARG TORCH=""
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Dependencies before the sources, so that a code change rebuilds only the last layers.
RUN --mount=type=secret,id=pip_cert --mount=type=secret,id=pip_conf \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    if [ -n "$TORCH" ]; then pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH"; fi && \
    pip install "megatron-core>=0.16,<0.20" regex psutil numpy einops tokenizers sentencepiece pytest pytest-timeout

WORKDIR /workspace/megatron_weipipe
COPY . .
RUN --mount=type=secret,id=pip_cert --mount=type=secret,id=pip_conf \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi; \
    pip install --no-deps -e . && python -W ignore -c "import megatron_weipipe, torch, megatron.core"

ARG OMP_NUM_THREADS=8
ENV OMP_NUM_THREADS=${OMP_NUM_THREADS} \
    CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["python", "pretrain_gpt.py", "--help"]
