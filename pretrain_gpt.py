#!/usr/bin/env python
"""Pretrain a GPT / Llama-style model with Megatron's, WeiPipe's or FPDT's parallelism.

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 4 --hidden-size 128 ...

Same flags as Megatron-LM's pretrain_gpt.py; see README.md and `--help`.
"""

from __future__ import annotations

import sys
import warnings

from megatron_weipipe.platform import quiet_host_notices  # noqa: E402

quiet_host_notices()  # megatron-core's TE/apex fallbacks, torch's missing CUDA driver
warnings.filterwarnings("ignore", message="full scope is deprecated")


def model_provider(cfg, vocab_size, pre_process=True, post_process=True, vp_stage=None):
    """Build this rank's stage of the model (Megatron-LM's model_provider)."""
    from megatron_weipipe.model.gpt import build_gpt_model

    return build_gpt_model(cfg, vocab_size, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def main(argv=None) -> int:
    from megatron_weipipe.cli import run_main

    from megatron_weipipe.model.gpt_step import forward_step

    return run_main(argv, model_provider, forward_step)


if __name__ == "__main__":
    sys.exit(main())
