"""A RunSpec carries every field of the training configuration that the start-up rules
read, so the simulator checks a run with the trainer's own rules and messages."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields, replace

import pytest

from megatron_weipipe import batch_sizes, checkpoint_config, logging_config
from megatron_weipipe import config as config_module
from megatron_weipipe import fp8_config
from megatron_weipipe import megatron_compat
from megatron_weipipe import model_config
from megatron_weipipe import parallel_config
from megatron_weipipe.arguments import check_config, resolve_defaults
from megatron_weipipe.config import ConfigError, PretrainConfig
from megatron_weipipe.model_config import ModelConfig
from megatron_weipipe.flags import flag_spec
from megatron_weipipe.fpdt import config as fpdt_config
from megatron_weipipe.schedules.check import rules
from megatron_weipipe.shape import ModelShape
from megatron_weipipe.simulator.rank_order import Layout
from megatron_weipipe.simulator.run_spec import RunSpec, spec_from_config, spec_to_config

# The sections whose rules run at start-up (the data files' are not checked by the
# simulator: it runs check_config with check_data=False).
SECTIONS = ("model", "parallel", "training", "fpdt", "fp8", "checkpoint", "logging", "megatron")
RULE_SOURCES = (config_module, model_config, parallel_config, checkpoint_config, logging_config, fpdt_config, fp8_config,
                batch_sizes, rules, megatron_compat, ModelShape.validate)

# A value other than the default for the fields whose type says too little, with the
# changes it needs to mean something (a layout with virtual stages needs its schedule).
ALTERNATIVES = {
    "num_layers_per_virtual_pipeline_stage": dict(
        parallel=dict(num_layers_per_virtual_pipeline_stage=1, pipeline_model_parallel_size=2,
                      pipeline_schedule="interleaved")),
    "pipeline_schedule": dict(parallel=dict(pipeline_schedule="1f1b")),
    "recompute_granularity": dict(model=dict(recompute_granularity="selective")),
    "recompute_method": dict(model=dict(recompute_method="block")),
    "position_embedding_type": dict(model=dict(position_embedding_type="rope")),
    "normalization": dict(model=dict(normalization="RMSNorm")),
    "kernel": dict(fpdt=dict(kernel="math")),
    "cp_comm_type": dict(parallel=dict(cp_comm_type=["p2p"])),
    "hierarchical_context_parallel_sizes": dict(parallel=dict(hierarchical_context_parallel_sizes=[2, 4])),
}


def _names_read_by_rules() -> set[str]:
    """Attribute names and string constants (getattr(self, name)) in the rule sources."""
    out: set[str] = set()
    for source in RULE_SOURCES:
        for node in ast.walk(ast.parse(inspect.getsource(source).lstrip())):
            if isinstance(node, ast.Attribute):
                out.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def _rule_fields() -> list[tuple[str, object]]:
    """(section, field) of every configuration field the start-up rules read; every field
    of the Megatron-LM compatibility section, whose rule walks all its fields."""
    read = _names_read_by_rules()
    base = PretrainConfig()
    return [(section, f) for section in SECTIONS for f in fields(getattr(base, section))
            if section == "megatron" or f.name in read]


def _base() -> PretrainConfig:
    return resolve_defaults(PretrainConfig(world_size=8))


def _perturbed(cfg: PretrainConfig, section: str, f) -> PretrainConfig:
    """``cfg`` with field ``f`` of ``section`` set to another value than its own."""
    value = getattr(getattr(cfg, section), f.name)
    spec = flag_spec(f)
    if f.name in ALTERNATIVES:
        changes = ALTERNATIVES[f.name]
    elif spec is not None and spec.choices:
        changes = {section: {f.name: next(c for c in spec.choices if c != value)}}
    elif isinstance(value, bool):
        changes = {section: {f.name: not value}}
    elif isinstance(value, int) or (value is None and "int" in str(f.type)):
        changes = {section: {f.name: (value or 0) + 2}}
    elif isinstance(value, float) or (value is None and "float" in str(f.type)):
        changes = {section: {f.name: value / 2 if value else 0.5}}
    elif value is None or isinstance(value, str):
        changes = {section: {f.name: f"{value or ''}-other"}}
    else:
        raise AssertionError(f"add a value of {section}.{f.name} (now {value!r}) to ALTERNATIVES")
    return replace(cfg, **{s: replace(getattr(cfg, s), **kv) for s, kv in changes.items()})


def test_rules_read_fields_of_every_section():
    found = {section for section, _ in _rule_fields()}
    assert found == set(SECTIONS)
    names = {f.name for _, f in _rule_fields()}
    assert {"use_torch_fsdp2", "offload_layer_inputs", "overlap_grad_reduce", "fp16"} <= names


@pytest.mark.parametrize("section,f", _rule_fields(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_field_the_rules_read_is_carried(section, f):
    """Through spec_from_config and back, a field the rules read keeps its value: the spec
    models it or carries it in its configuration; otherwise the rules would check another run."""
    cfg = _perturbed(_base(), section, f)
    back = spec_to_config(spec_from_config(cfg))
    assert getattr(getattr(back, section), f.name) == getattr(getattr(cfg, section), f.name), f"{section}.{f.name}"


def test_round_trip_of_a_valid_configuration_is_exact():
    cfg = resolve_defaults(PretrainConfig(
        model=replace(ModelConfig(num_layers=4), recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=1, hidden_dropout=0.05),
        parallel=replace(PretrainConfig().parallel, pipeline_model_parallel_size=2, pipeline_schedule="weipipe-zb",
                         overlap_grad_reduce=True),
        training=replace(PretrainConfig().training, fp16=True, global_batch_size=8),
        world_size=4))
    check_config(cfg, check_data=False)
    back = spec_to_config(spec_from_config(cfg))
    for section in SECTIONS:
        assert getattr(back, section) == getattr(cfg, section), section


def _trainer_message(cfg: PretrainConfig) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(cfg, check_data=False)
    return str(e.value)


def test_an_invalid_fsdp_configuration_is_refused_with_the_trainers_message():
    p = replace(PretrainConfig().parallel, use_torch_fsdp2=True, overlap_grad_reduce=True)
    model = replace(ModelConfig(), untie_embeddings_and_output_weights=True)
    cfg = resolve_defaults(PretrainConfig(model=model, parallel=p, world_size=2))
    expected = _trainer_message(cfg)
    assert "--overlap-grad-reduce" in expected
    with pytest.raises(ConfigError) as e:
        spec_from_config(cfg).validate()
    assert str(e.value) == expected


def test_an_fsdp_run_spec_is_checked_by_the_fsdp_rules():
    """A spec built directly: FSDP2 with the distributed optimizer and tied embeddings."""
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, micro_batch_size=1,
                       vocab_size=512, untie_embeddings_and_output_weights=True)
    spec = RunSpec(shape=shape, layout=Layout(pp=1, dp=2), global_batch_size=2, schedule="none",
                   torch_fsdp2=True, distributed_optimizer=True)
    with pytest.raises(ConfigError) as e:
        spec.validate()
    assert str(e.value) == _trainer_message(spec_to_config(spec))
    assert "--use-distributed-optimizer" in str(e.value)
    replace(spec, distributed_optimizer=False).validate()
    tied = replace(spec, distributed_optimizer=False, shape=replace(shape, untie_embeddings_and_output_weights=False))
    with pytest.raises(ConfigError, match="--untie-embeddings-and-output-weights"):
        tied.validate()
