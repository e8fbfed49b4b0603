# megatron_weipipe on an NGC PyTorch image (ships CUDA, NCCL, transformer-engine and apex).
#   docker build -t megatron-weipipe .
#   docker run --gpus all --ipc=host --rm megatron-weipipe bash examples/cpu_quickstart.sh
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}

WORKDIR /workspace/megatron_weipipe
# The image's own torch, transformer-engine and apex are kept: install our other
# dependencies explicitly and the package itself without re-resolving torch.
RUN pip install --no-cache-dir "megatron-core>=0.16,<0.17" regex psutil numpy tokenizers sentencepiece pytest pytest-timeout
COPY . .
RUN pip install --no-cache-dir --no-deps -e .

ENV OMP_NUM_THREADS=8 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["python", "pretrain_gpt.py", "--help"]
