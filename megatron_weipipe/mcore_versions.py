"""What differs between the megatron-core releases this package supports (0.16 to 0.19).

Every version-dependent use of megatron-core goes through here, detected by feature rather
than by version number, so a patch release that backports a change needs nothing new:

- checkpoint common state: 0.16 writes ``common.pt`` and its ``dist_checkpointing.load``
  takes a ``common_strategy``; from 0.17 the common state is a ShardedObject
  (``common_state``) inside the ``.distcp`` files, ``load`` has no such argument and reads
  it through ``serialization.load_common_state_dict``;
- layer specs: 0.16 describes the MLP as a ``ModuleSpec`` (and passes ``tp_group`` only to
  its own MLP class); 0.19 as ``functools.partial(MLP.as_mlp_submodule, submodules=...)``;
- full recomputation: 0.16 runs it in ``TransformerBlock._checkpointed_forward``; 0.19 in
  ``megatron.core.recompute.checkpointed_forward(block, hidden_states=...)``;
- parallel linear layers: 0.19 passes ``gtp_remat_size`` to the linear function
  (weight-rematerialisation sharding; 1 means off, the plain linear's math);
- asynchronous checkpoint saves: 0.19's ``dist_checkpointing.save`` takes ``async_strategy``
  (default ``nvrx``, NVIDIA's resiliency package); megatron-core's own queue is ``mcore``,
  which 0.16 uses without being asked;
- tokenizer base class: 0.16 has ``MegatronLegacyTokenizer`` in
  ``megatron.core.datasets.megatron_tokenizer``; 0.19 has ``MegatronTokenizerBase`` in
  ``megatron.core.tokenizers``, which also asks for ``apply_chat_template``.
- microbatch calculator: 0.16 and 0.17 ramp the batch size (``RampupBatchsizeNumMicroBatchesCalculator``);
  0.18 dropped it for ``StepBatchsizeNumMicroBatchesCalculator`` (a step schedule), which they lack.

Imports of megatron-core happen inside the functions: the configuration and the simulator
import this package without torch.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC

SUPPORTED = ("0.16", "0.17", "0.18", "0.19")


@functools.lru_cache(maxsize=None)
def version() -> str:
    """The installed megatron-core's version string."""
    from megatron.core import package_info

    return package_info.__version__


@functools.lru_cache(maxsize=None)
def load_takes_common_strategy() -> bool:
    """Whether ``dist_checkpointing.load`` reads a separate ``common.pt`` through a strategy (0.16)."""
    from megatron.core import dist_checkpointing

    return "common_strategy" in inspect.signature(dist_checkpointing.load).parameters


def common_state_loader_owner():
    """The module whose ``load_common_state_dict`` reads the common state inside ``load`` (0.17+), or None.

    That reader unpickles the common state with ``weights_only=False`` (through torch's
    default load planner), so the safe loader replaces it there while loading.
    """
    if load_takes_common_strategy():
        return None
    from megatron.core.dist_checkpointing import serialization

    return serialization if hasattr(serialization, "load_common_state_dict") else None


@functools.lru_cache(maxsize=None)
def async_save_kwargs() -> dict:
    """What ``dist_checkpointing.save(..., async_sharded_save=True)`` needs to build megatron-core's
    own AsyncRequest (0.19 would otherwise ask for nvidia-resiliency-ext's)."""
    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


# Keyword arguments newer releases pass to the parallel linear function, at the values that
# leave it the plain linear (so the deferred weight-gradient path may replace it).
NEUTRAL_LINEAR_KWARGS = {"gtp_remat_size": 1}


def with_mlp_class(mlp_spec, cls, tp_group):
    """A layer spec's MLP entry that builds ``cls`` (a subclass of megatron-core's MLP) instead."""
    if isinstance(mlp_spec, functools.partial):  # 0.19: the classmethod takes the TP group itself
        return functools.partial(getattr(cls, mlp_spec.func.__name__), *mlp_spec.args, **mlp_spec.keywords)
    mlp_spec.module = cls
    mlp_spec.params = dict(mlp_spec.params or {}, tp_group=tp_group)
    return mlp_spec


def build_layer_mlp(mlp_spec, config):
    """Build a layer spec's MLP entry on its own (as TransformerLayer does), on the current TP group."""
    if isinstance(mlp_spec, functools.partial):
        from megatron.core.process_groups_config import ProcessGroupCollection

        return mlp_spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                        is_mtp_layer=False)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(mlp_spec, config=config)


def wrap_checkpointed_forward(block, wrap) -> None:
    """Run ``block``'s full-recomputation forward as ``wrap(original)(hidden_states, *args, **kwargs)``."""
    if "_checkpointed_forward" in dir(block):  # 0.16: a method of the block
        block._checkpointed_forward = wrap(block._checkpointed_forward)
        return
    from megatron.core.transformer import transformer_block

    module_fn = transformer_block.checkpointed_forward
    original = getattr(module_fn, "unwrapped", module_fn)
    if module_fn is original:  # 0.19: one module function for every block; dispatch per block
        def dispatch(blk, *args, **kwargs):
            wrapped = blk.__dict__.get("_wrapped_checkpointed_forward")
            return wrapped(*args, **kwargs) if wrapped is not None else original(blk, *args, **kwargs)

        dispatch.unwrapped = original
        transformer_block.checkpointed_forward = dispatch
    block.__dict__["_wrapped_checkpointed_forward"] = wrap(functools.partial(original, block))


@functools.lru_cache(maxsize=None)
def tokenizer_base() -> type:
    """The base class megatron-core's datasets expect a tokenizer to derive from."""
    candidates = (
        ("megatron.core.datasets.megatron_tokenizer", "MegatronLegacyTokenizer"),  # 0.16
        ("megatron.core.datasets.megatron_tokenizer", "MegatronTokenizer"),
        ("megatron.core.tokenizers", "MegatronTokenizerBase"),
    )
    for module, name in candidates:
        try:
            return getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
    return ABC


def microbatch_calculator_class(kind: str):
    """megatron-core's calculator class of ``kind`` ("Rampup", "Step" or "Constant"), or None
    where this release has none (``...BatchsizeNumMicroBatchesCalculator``; Constant's name has no Batchsize)."""
    from megatron.core import num_microbatches_calculator as calculators

    name = "ConstantNumMicroBatchesCalculator" if kind == "Constant" else f"{kind}BatchsizeNumMicroBatchesCalculator"
    return getattr(calculators, name, None)
