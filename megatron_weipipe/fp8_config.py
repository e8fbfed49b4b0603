"""FP8 training through Transformer Engine: Megatron-LM's ``--fp8-*`` flags.

FP8 GEMMs are Transformer Engine's (megatron-core wraps every TE layer's forward in TE's
fp8 autocast from these TransformerConfig fields), so they need TE layers on a GPU of
compute capability 8.9 or newer (Ada, Hopper; MXFP8 needs 10.0, Blackwell). The host rule
is checked where the layers are chosen (model/layer_choice.py); the rules below hold on
every host and run before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option

# The compute capability each recipe's kernels need (Transformer Engine's own minimums).
MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


@dataclass
class FP8Config:
    fp8_format: Optional[str] = option(
        None, choices=("e4m3", "hybrid"),
        help="FP8 GEMMs in Transformer Engine layers: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
             "gradients); needs TE on a GPU of compute capability 8.9 or newer")
    fp8_recipe: str = option("delayed", choices=tuple(MIN_CAPABILITY),
                             help="FP8 scaling recipe (mxfp8 needs compute capability 10.0)")
    fp8_margin: int = option(0, help="scaling-factor shift of the delayed recipe")
    fp8_amax_history_len: int = option(1, help="amax history length of the delayed recipe")
    fp8_amax_compute_algo: str = option("most_recent", choices=("most_recent", "max"),
                                        help="how the delayed recipe reads its amax history")
    fp8_wgrad: bool = option(True, flag="--no-fp8-wgrad", inverted=True,
                             help="compute the weight gradients in higher precision, not FP8")
    fp8_param_gather: bool = option(
        False, help="keep the compute weights in FP8 and all-gather them in FP8 (with "
                    "--use-distributed-optimizer or --use-torch-fsdp2)")
    first_last_layers_bf16: bool = option(False, help="run the first and last layers' GEMMs in bf16, not FP8")
    num_layers_at_start_in_bf16: int = option(1, help="layers at the start kept in bf16 (--first-last-layers-bf16)")
    num_layers_at_end_in_bf16: int = option(1, help="layers at the end kept in bf16 (--first-last-layers-bf16)")

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    def validate(self, *, long_context: bool, sharded_params: bool) -> None:
        """Megatron-LM's FP8 rules, and what this package's own layers cannot do in FP8 (the
        WeiPipe schedules' rule is theirs: schedules/check/rules.py)."""
        if not self.enabled:
            require(not self.fp8_param_gather, "--fp8-param-gather needs --fp8-format")
            return
        require(self.fp8_amax_history_len > 0, "--fp8-amax-history-len must be positive")
        require(not long_context, "--fp8-format cannot be combined with --context-parallel-size > 1 or --fpdt "
                                  "(Ulysses/FPDT layers are megatron-core's local layers, which have no FP8 GEMMs)")
        require(not self.fp8_param_gather or sharded_params,
                "--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2 (as in Megatron-LM)")

    def transformer_config_kwargs(self) -> dict:
        """megatron-core TransformerConfig fields (empty without --fp8-format)."""
        if not self.enabled:
            return {}
        return dict(fp8=self.fp8_format, fp8_recipe=self.fp8_recipe, fp8_margin=self.fp8_margin,
                    fp8_amax_history_len=self.fp8_amax_history_len,
                    fp8_amax_compute_algo=self.fp8_amax_compute_algo, fp8_wgrad=self.fp8_wgrad,
                    fp8_param=self.fp8_param_gather, first_last_layers_bf16=self.first_last_layers_bf16,
                    num_layers_at_start_in_bf16=self.num_layers_at_start_in_bf16,
                    num_layers_at_end_in_bf16=self.num_layers_at_end_in_bf16)

    def host_problem(self, transformer_engine: bool, capability: tuple) -> Optional[str]:
        """Why this host cannot run the FP8 recipe (None: it can)."""
        if not self.enabled:
            return None
        need = MIN_CAPABILITY[self.fp8_recipe]
        if not transformer_engine:
            return ("--fp8-format needs Transformer Engine layers on a GPU (FP8 GEMMs are TE's); this host builds "
                    "megatron-core's local layers")
        if tuple(capability) < need:
            return (f"--fp8-format with --fp8-recipe {self.fp8_recipe} needs a GPU of compute capability "
                    f"{need[0]}.{need[1]} or newer; this one is {capability[0]}.{capability[1]}")
        return None
