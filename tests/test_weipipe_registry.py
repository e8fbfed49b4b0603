"""schedules/registry.py declares every schedule once: it and the plan layer import
without torch, the start-up rules run on a bare configuration, every other list of
names derives from it, and each name leads to its training class."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import pytest

from megatron_weipipe.schedules import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(pp=1, vpp=None, microbatches=4, schedule=None):
    """The attributes the rules read, without building a PretrainConfig (no batch-size
    schedule, no --overlap-param-gather, no megatron-core context parallelism, no FP8)."""
    from types import SimpleNamespace as N

    parallel = N(pipeline_model_parallel_size=pp, num_layers_per_virtual_pipeline_stage=vpp,
                 pipeline_schedule=schedule, overlap_param_gather=False, megatron_context_parallel=False)
    return N(parallel=parallel, num_microbatches=microbatches, fp8=N(enabled=False), data_parallel_size=1,
             training=N(micro_batch_size=1, rampup_batch_size=None), batch_size_changes=lambda: [])


def test_registry_plan_and_rules_import_without_torch():
    code = inspect.getsource(_cfg) + (
        "import sys\n"
        "from megatron_weipipe.schedules import registry\n"
        "import megatron_weipipe.schedules.check.rules\n"
        "from megatron_weipipe.schedules.generate.megatron_timeline import build\n"
        "from megatron_weipipe.schedules.check.validate import validate\n"
        "from megatron_weipipe.schedules.timing.tick_simulator import simulate\n"
        "for name in registry.plan_names():\n"
        "    validate(build(name, 2, 2)); simulate(build(name, 2, 2))\n"
        "for pp, vpp, name in [(1, None, None), (2, None, None), (2, 1, None), (2, None, 'weipipe-zb')]:\n"
        "    registry.check_config(_cfg(pp, vpp, 4, name))\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy'))\n"
        "assert not heavy, heavy[:5]\n"
        "assert 'megatron_weipipe.config' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_names_are_declared_once_and_derived_everywhere():
    assert registry.names() == ("none", "1f1b", "interleaved", "weipipe-naive", "weipipe-interleave", "weipipe-zb")
    assert registry.megatron_names() == ("none", "1f1b", "interleaved")
    assert registry.weipipe_names() == ("weipipe-naive", "weipipe-interleave", "weipipe-zb")
    assert registry.plan_names() == registry.names()[1:]
    for name in registry.names():
        e = registry.entry(name)
        assert e.name == name and e.family in (registry.MEGATRON, registry.WEIPIPE)


def test_default_schedule_name():
    assert registry.default_schedule_name(_cfg(pp=1)) == "none"
    assert registry.default_schedule_name(_cfg(pp=2)) == "1f1b"
    assert registry.default_schedule_name(_cfg(pp=2, vpp=1)) == "interleaved"
    assert registry.schedule_name(_cfg(pp=2, schedule="weipipe-zb")) == "weipipe-zb"


RULES = [
    (_cfg(pp=2, schedule="none"), "--pipeline-schedule none needs --pipeline-model-parallel-size 1"),
    (_cfg(pp=2, vpp=1, schedule="1f1b"),
     "--pipeline-schedule 1f1b does not take --num-layers-per-virtual-pipeline-stage; use --pipeline-schedule "
     "interleaved"),
    (_cfg(pp=2, schedule="interleaved"),
     "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"),
    (_cfg(pp=4, vpp=1, microbatches=6, schedule="interleaved"),
     "--pipeline-schedule interleaved needs the number of microbatches per replica (6) to be a multiple of "
     "--pipeline-model-parallel-size (4)"),
    (_cfg(pp=1, schedule="weipipe-zb"),
     "--pipeline-schedule weipipe-zb needs --pipeline-model-parallel-size >= 2 (the size of the weight ring)"),
    (_cfg(pp=2, vpp=1, schedule="weipipe-naive"),
     "--pipeline-schedule weipipe-naive does not take --num-layers-per-virtual-pipeline-stage (one chunk per "
     "ring rank)"),
    (_cfg(pp=2, microbatches=3, schedule="weipipe-interleave"),
     "--pipeline-schedule weipipe-interleave needs the number of microbatches per replica (--global-batch-size / "
     "(--micro-batch-size x data-parallel size) = 3) to be a multiple of --pipeline-model-parallel-size (2)"),
    (_cfg(schedule="zigzag"),
     "--pipeline-schedule 'zigzag' is unknown; choose one of: 1f1b, interleaved, none, weipipe-interleave, "
     "weipipe-naive, weipipe-zb"),
]


@pytest.mark.parametrize("cfg,message", RULES)
def test_rules_refuse_with_their_sentence(cfg, message):
    from megatron_weipipe.config import ConfigError

    with pytest.raises(ConfigError) as got:
        registry.check_config(cfg)
    assert str(got.value) == message


def test_each_name_leads_to_its_training_class_and_rules():
    from megatron_weipipe.config import ConfigError
    from megatron_weipipe.schedules.gpt.base import TrainSchedule

    # PP=1 without virtual stages: only none and 1f1b can run it
    refused_at_pp1 = {"interleaved", *registry.weipipe_names()}
    for name in registry.names():
        cls = registry.train_class(name)
        assert issubclass(cls, TrainSchedule)
        try:
            cls.check_config(_cfg(pp=1, schedule=name))  # the class points at the registry's rules
            refused = False
        except ConfigError:
            refused = True
        assert refused == (name in refused_at_pp1), name


def test_every_schedule_fact_the_simulator_and_tools_read_is_declared():
    from megatron_weipipe.schedules.timing.replay import POSTING_RULES

    assert registry.simulated_names() == registry.names() + ("zb-h1", "floor", "fsdp", "tawpipe")
    assert not set(registry.BASELINES) & set(registry.SCHEDULES)
    assert registry.pipeline_names() == registry.plan_names()
    assert registry.compared_by_default() == ("1f1b", "interleaved", "weipipe-interleave", "weipipe-zb")
    for name in registry.simulated_names():
        e = registry.simulated(name)
        assert e.posting in POSTING_RULES and e.projection in (registry.REPLAY, registry.FLOOR, registry.FSDP,
                                                                  registry.TAWPIPE)
        # exactly one source of action lists: its own, or another schedule's
        sources = [x for x in (e.compute_plan, e.timeline, e.costed_timeline, e.replayed_as) if x is not None]
        assert len(sources) == 1, name
        assert (e.compute_plan is not None) == e.is_weipipe, name
        if e.replayed_as is not None:
            assert registry.simulated(e.replayed_as) is not None, name
        if name in registry.BASELINES:
            assert e.train is None and e.rules is None and e.trained_as in registry.names(), name
            assert registry.training_entry(name).name == e.trained_as
        else:
            assert e.trained_as is None and registry.training_entry(name) is e
            assert e.posting == (registry.ASYNC if e.is_weipipe else registry.BLOCKING), name
    assert [n for n in registry.names() if registry.entry(n).virtual_stages] == ["interleaved"]
    assert [n for n in registry.simulated_names() if not registry.simulated(n).pipelined] == ["none", "fsdp"]
    with pytest.raises(ValueError, match="compute plan"):
        registry.plan_function("1f1b")
    assert registry.plan_function("weipipe-zb") is registry.load(registry.entry("weipipe-zb").compute_plan)
