"""Flags of Megatron-LM's launch scripts that this package accepts so the scripts run unchanged.

Three kinds (docs/reference/flags.md lists them): flags with their Megatron-LM effect on a
kernel choice (accepted, honoured: the same math, a different kernel); flags that change
nothing here, because they select kernels, fusions, overlaps or GPU memory handling that
compute the same math (accepted, no effect); and flags that would change the math or
need something this package does not have (refused at start-up with one line naming the flag).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron_weipipe.errors import ConfigError
from megatron_weipipe.flags import flag_name, flag_spec, option

_ACCEPTED = "accepted from Megatron-LM"
_NOOP = f"{_ACCEPTED}; changes nothing here"


_MEGATRON_FSDP = ("an option of Megatron FSDP, --use-megatron-fsdp, which is refused here; Megatron-LM ignores it "
                  "without that flag too")


def _noop(why: str, default=False, **kw):
    return option(default, help=f"{_NOOP} ({why})", **kw)


def _honoured(what: str, default=False, **kw):
    return option(default, help=f"{_ACCEPTED}; {what}", **kw)


def _refused(why: str, default=None, **kw):
    return option(default, help=f"not supported here: {why}", **kw)


@dataclass
class MegatronCompatConfig:
    # --- accepted: _honoured ones take effect (model/sdpa_attention.py, model/gpt.py), _noop ones do not
    use_mcore_models: bool = _noop("the model is always megatron-core's GPTModel")
    use_flash_attn: bool = _honoured("--attention-backend auto becomes flash (Transformer Engine: its "
                                     "flash-attention only; local layers: torch's fused SDPA, as auto already is)")
    no_masked_softmax_fusion: bool = _honoured("megatron-core's unfused attention (--attention-backend "
                                               "unfused/local) keeps torch's softmax even where the fused "
                                               "masked-softmax kernels import")
    no_bias_gelu_fusion: bool = _noop("kernel fusion")
    no_bias_swiglu_fusion: bool = _noop("kernel fusion")
    no_bias_dropout_fusion: bool = _noop("kernel fusion")
    no_rope_fusion: bool = _noop("kernel fusion")
    no_gradient_accumulation_fusion: bool = _noop("kernel fusion")
    cross_entropy_loss_fusion: bool = _noop("kernel fusion")
    no_async_tensor_model_parallel_allreduce: bool = _noop("communication overlap")
    no_overlap_p2p_communication: bool = _noop("point-to-point communication is overlapped only with "
                                               "--overlap-p2p-comm (Megatron-LM overlaps it by default with "
                                               "virtual stages)")
    ckpt_fully_parallel_save: bool = _noop("deprecated in Megatron-LM, without effect there too; which replica "
                                           "writes a replicated shard, not what is written")
    ckpt_assume_constant_structure: bool = _noop("reuse of the previous save's plan; the same files")
    use_dist_ckpt: bool = _noop("checkpoints are always torch_dist")
    data_parallel_sharding_strategy: str = _noop(_MEGATRON_FSDP, default="optim_grads_params")
    fsdp_double_buffer: bool = _noop(_MEGATRON_FSDP)
    fsdp_manual_registration: bool = _noop(_MEGATRON_FSDP)
    # --- refused: one line naming the flag ----------------------------------------
    use_megatron_fsdp: bool = _refused("Megatron's own FSDP is not one of this package's data-parallel modes "
                                       "(use --use-torch-fsdp2 or --use-distributed-optimizer)", default=False)
    cpu_offloading: bool = _refused("Megatron's --cpu-offloading is Transformer Engine's activation offload, "
                                    "which megatron-core 0.16 refuses with recomputation and with pipeline "
                                    "parallelism; use --offload-layer-inputs (with --recompute-granularity full) "
                                    "to keep each layer's saved input in host memory", default=False)
    use_legacy_models: bool = _refused("only megatron-core models are built", default=False)

    def validate(self) -> None:
        for f in fields(self):
            help_text = flag_spec(f).help
            if help_text.startswith("not supported here") and getattr(self, f.name) not in (None, False):
                raise ConfigError(f"{flag_name(f)} is not supported here: {help_text[len('not supported here: '):]}")

    @staticmethod
    def accepted() -> list[str]:
        """Every accepted flag: honoured and no-op ones."""
        return [flag_name(f) for f in fields(MegatronCompatConfig)
                if flag_spec(f).help.startswith(_ACCEPTED)]

    @staticmethod
    def refused() -> list[str]:
        return [flag_name(f) for f in fields(MegatronCompatConfig)
                if flag_spec(f).help.startswith("not supported")]
