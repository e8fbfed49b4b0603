"""Optimizer state in torch_dist checkpoints: its saved format, and loading it into another layout.

The distributed optimizer saves in one of megatron-core's two formats:

* ``dp_reshardable`` (default, as in Megatron-LM): each rank writes its slice of the
  flat optimizer buffers. Loads only into the distributed optimizer, under the same
  TP, PP, virtual stages, CP and schedule; the data-parallel size may change.
* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): the state is gathered
  into the shapes of the model's parameters, like the plain optimizer's. Loads under
  any layout megatron-core reshards the model into, with or without the distributed
  optimizer.

The plain optimizer's state loads into the distributed optimizer the same way. Between
the two kinds only the tensors are read (fp32 master weights, Adam moments); the Adam
step count travels in ``common.pt`` (``optimizer_step``) and the remaining settings
(learning rate, weight decay) come from the LR schedule, which is restored separately.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from megatron_weipipe.config import PretrainConfig

DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE = "fully_reshardable"
# Parts of the layout a dp_reshardable checkpoint cannot change (its buffers follow them).
_DP_RESHARDABLE_FIXED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                         "virtual_pipeline_size", "pipeline_schedule")
_MAIN_PARAM_PREFIX = {"distributed": "optimizer.state.param.", "float16": "optimizer.state.fp32_param."}


def _precision(cfg: PretrainConfig) -> str:
    t = cfg.training
    return "bf16" if t.bf16 else ("fp16" if t.fp16 else "fp32")


def optimizer_layout(cfg: PretrainConfig) -> dict:
    """What common.pt records about the optimizer state's format."""
    dist_opt = cfg.parallel.use_distributed_optimizer
    sharding = None
    if dist_opt:
        sharding = FULLY_RESHARDABLE if cfg.checkpoint.dist_ckpt_optim_fully_reshardable else DP_RESHARDABLE
    return {"distributed": dist_opt, "sharding_type": sharding, "precision": _precision(cfg)}


def kind(layout: dict) -> str:
    """distributed, float16 (plain with fp32 masters) or fp32 (plain, the weights are the masters)."""
    if layout.get("distributed"):
        return "distributed"
    return "fp32" if layout.get("precision", "fp32") == "fp32" else "float16"


def check_resharding(saved: dict, now: dict) -> Optional[str]:
    """One line if the saved optimizer state cannot load into this run's layout, else None.

    ``saved`` and ``now`` are checkpointing's layout dicts (with their ``optimizer`` entry).
    """
    opt = saved.get("optimizer") or {"distributed": False, "precision": "fp32"}
    if opt.get("sharding_type") != DP_RESHARDABLE:
        return None
    if not now["optimizer"]["distributed"]:
        return ("the optimizer state was saved by --use-distributed-optimizer in the dp_reshardable format, which "
                "loads only into the distributed optimizer (save with --dist-ckpt-optim-fully-reshardable, or "
                "pass --no-load-optim)")
    changed = [k for k in _DP_RESHARDABLE_FIXED if saved.get(k) != now.get(k)]
    if changed:
        what = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in changed)
        return (f"the optimizer state was saved in the dp_reshardable format, which reshards only across data-"
                f"parallel ranks, and this run changes {what} (save with --dist-ckpt-optim-fully-reshardable, "
                f"or pass --no-load-optim)")
    return None


def single(optimizer):
    """The one optimizer inside megatron-core's ChainedOptimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1:
        raise NotImplementedError("checkpoints with more than one chained optimizer are not supported")
    return inner[0]


def adam_step(optimizer) -> Optional[float]:
    """The optimizer's step count (shared by every parameter), None for optimizers without one."""
    inner = single(optimizer).optimizer
    for state in inner.state.values():
        if "step" in state:
            return float(state["step"])
    return None


def allocate_state(optimizer) -> None:
    """Give a fresh distributed optimizer zero Adam state and step 0: megatron-core's state_dict
    reads the step of every parameter's state, which torch creates only at the first step."""
    opt = single(optimizer)
    init = getattr(opt, "init_state_fn", None)
    if init is None and hasattr(opt.optimizer, "dummy_step"):
        # --optimizer-cpu-offload: the hybrid-device optimizer creates its state by stepping
        # once on random gradients (megatron-core's own load does the same); the load then
        # overwrites weights and state, and the random draws leave no trace.
        with torch.random.fork_rng():
            opt.optimizer.dummy_step()
        return
    if init is None:
        return
    init(opt.optimizer, opt.config)
    for state in opt.optimizer.state.values():
        state.setdefault("step", torch.tensor(0.0))


def load_distributed(optimizer, state: dict) -> None:
    """megatron-core's DistributedOptimizer.load_state_dict, with torch's Adam step handled.

    Without TE/apex the optimizer is torch's Adam, whose per-parameter ``step`` tensor
    megatron-core (0.16) hands to every parameter as one shared tensor (each step then
    advances it once per parameter) and expects among the saved tensors of the
    fully_reshardable format, which omits it. The step is therefore set aside while the
    tensors load and given back to each parameter as its own tensor.
    """
    opt = single(optimizer)
    param_state = state.pop("param_state", None)
    sharding = state.pop("param_state_sharding_type", None)
    opt.load_state_dict(state)
    steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
    if param_state is not None:
        load = {DP_RESHARDABLE: opt.load_parameter_state_from_dp_reshardable,
                FULLY_RESHARDABLE: opt.load_parameter_state_from_fully_reshardable}[sharding]
        load(param_state)
    for p, step in steps.items():
        opt.optimizer.state[p]["step"] = step.detach().clone()


def model_tensors(model_state: dict) -> dict:
    """{(sharded key, global offset): this rank's model parameter} from the model part of a
    sharded state dict (layers share a key and differ in offset)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {(v.key, tuple(v.global_offset)): v.data for k, part in model_state.items() if k.startswith("model")
            for v in nested_values(part) if isinstance(v, ShardedTensor)}


def _rename_main_params(tensors: dict, load_kind: str, saved_kind: str) -> dict:
    """Point the master-weight tensors at the names the saving optimizer used.

    A plain fp32 optimizer keeps no masters (the weights are the masters); those entries
    leave the request and are returned as {param index: (model key, offset)} to be filled from the
    loaded weights.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    src = _MAIN_PARAM_PREFIX.get(load_kind)
    from_weights = {}
    if src is None:
        return from_weights
    if saved_kind == "fp32":  # only the distributed optimizer asks for masters here
        for idx, entry in tensors["param_state"].items():
            main = entry.pop("param")
            from_weights[idx] = (main.key[len(src):], tuple(main.global_offset))
        return from_weights
    for item in nested_values(tensors):
        if isinstance(item, ShardedBase) and item.key.startswith(src):
            item.key = _MAIN_PARAM_PREFIX[saved_kind] + item.key[len(src):]
    return from_weights


def _unwrap_param_groups(groups):
    """The request's param groups with megatron-core's non-persistent wrappers removed."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    out = copy.copy(groups)
    for g in out:
        if isinstance(g.get("params"), LocalNonpersistentObject):
            g["params"] = g["params"].unwrap()
    return out


def from_plain(optimizer, request: dict, saved_kind: str, saved_step: Optional[float], weights: dict):
    """A plain optimizer's state into the distributed optimizer: (tensors to request, apply(loaded)).

    Only the tensors are read; the rest of the state is this optimizer's own. A plain fp32
    optimizer kept no masters: they are taken from ``weights``, loaded into the model just before.
    """
    tensors = {"param_state": request["param_state"]}
    from_weights = _rename_main_params(tensors, "distributed", saved_kind)

    def apply(loaded: dict) -> None:
        state = {k: v for k, v in request.items() if k not in ("param_state",)}
        for group in state["optimizer"]["param_groups"]:
            if "step" in group and saved_step is not None:
                group["step"] = saved_step
        state["param_state"] = loaded["param_state"]
        for idx, key in from_weights.items():  # loaded into the model just before
            state["param_state"][idx]["param"] = weights[key].detach().float()
        load_distributed(optimizer, state)

    return tensors, apply


def from_distributed(optimizer, request: dict, load_kind: str, saved_step: Optional[float]):
    """The distributed optimizer's state into a plain one (``load_kind`` float16 or fp32):
    (tensors to request, apply(loaded)), reading only tensors."""
    if load_kind == "float16":
        tensors = {"state": request["optimizer"]["state"], "fp32_from_fp16_params": request["fp32_from_fp16_params"]}
    else:
        tensors = {"state": request["state"]}
    _rename_main_params(tensors, load_kind, "distributed")
    step = torch.tensor(float(saved_step or 0.0))

    def apply(loaded: dict) -> None:
        if load_kind == "float16":
            groups = _unwrap_param_groups(request["optimizer"]["param_groups"])
            inner = {"state": loaded["state"], "param_groups": groups}
            if saved_step is not None:
                inner["state"]["common_step"] = step
            state = {k: v for k, v in request.items() if k not in ("optimizer", "fp32_from_fp16_params")}
            state.update(optimizer=inner, fp32_from_fp16_params=loaded["fp32_from_fp16_params"])
        else:
            state = {"state": loaded["state"], "param_groups": _unwrap_param_groups(request["param_groups"])}
            if saved_step is not None:
                state["state"]["common_step"] = step
        optimizer.load_state_dict(state)

    return tensors, apply
