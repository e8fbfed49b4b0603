"""``--tp-comm-overlap``: Transformer Engine's userbuffer overlap of tensor-parallel communication.

TE's linear layers, told ``tp_comm_overlap`` through megatron-core's TransformerConfig
(model/gpt.py), split their GEMMs and pipeline them with the sequence-parallel all-gather
and reduce-scatter through userbuffers that must exist before the model is built: one
buffer shape, [sequence x micro batch, hidden], for every layer. This module creates them
as Megatron-LM's ``_initialize_tp_communicators`` does (no FP8, its default bootstrap
backend ``nccl``). megatron-core's local layers (CPU hosts, GPU hosts without TE, WeiPipe
unless ``--allow-unverified-gpu-paths``) have no such path: the flag changes nothing there
and one notice says so.
"""

from __future__ import annotations

import inspect
import logging

from megatron_weipipe.config import PretrainConfig
from megatron_weipipe.platform import Platform

log = logging.getLogger(__name__)
NO_EFFECT = ("notice: --tp-comm-overlap changes nothing in this run: it overlaps the communication of Transformer "
             "Engine layers (userbuffers), and this run builds megatron-core's local layers")
BOOTSTRAP_BACKEND = "nccl"  # Megatron-LM's --tp-comm-bootstrap-backend default


def userbuffer_shape(cfg: PretrainConfig) -> list[int]:
    """Megatron-LM's buffer shape: the tokens of one microbatch (sequence parallelism
    excludes context parallelism here), by the hidden size."""
    return [cfg.model.seq_length * cfg.training.micro_batch_size, cfg.model.hidden_size]


def initialize_userbuffers(cfg: PretrainConfig, platform: Platform, rank: int = 0) -> bool:
    """TE's userbuffers for ``--tp-comm-overlap`` on Transformer Engine layers; True if made.
    Elsewhere rank 0 logs ``NO_EFFECT`` and nothing is made."""
    from megatron_weipipe.model.layer_choice import choose_layers

    if not cfg.parallel.tp_comm_overlap:
        return False
    if not choose_layers(cfg, platform).transformer_engine:
        if rank == 0:
            log.warning(NO_EFFECT)
        return False
    from transformer_engine.pytorch.module import base

    kwargs = dict(shape=userbuffer_shape(cfg), tp_size=cfg.parallel.tensor_model_parallel_size, ub_cfgs={})
    accepted = inspect.signature(base.initialize_ub).parameters
    if "quantization_modes" in accepted:  # TE 2.7 and later
        kwargs["quantization_modes"] = [base.UserBufferQuantizationMode.NONE]
    elif "use_fp8" in accepted:
        kwargs["use_fp8"] = False
    if "bootstrap_backend" in accepted:  # TE 1.9 and later
        kwargs["bootstrap_backend"] = BOOTSTRAP_BACKEND
    if getattr(base, "_ub_communicators", None) is not None and hasattr(base, "destroy_ub"):
        base.destroy_ub()  # an earlier run in this process made them, for its own groups
    base.initialize_ub(**kwargs)
    return True
