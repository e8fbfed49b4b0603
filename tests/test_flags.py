"""Flags generated from the typed configs: Megatron's names kept, values round-trip, the
docs/reference/flags.md's table is the generated one, and the simulator takes the same flags."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
from tools.flags_table import flags_table
from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe.arguments import SECTIONS, build_parser, parse_config
from megatron_weipipe.flags import to_flags
from megatron_weipipe.megatron_compat import MegatronCompatConfig

# Every flag of the hand-written parser this generated one replaced.
MEGATRON_FLAGS = """
--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --group-query-attention --num-query-groups
--kv-channels --seq-length --max-position-embeddings --position-embedding-type --rotary-base --rotary-percent
--normalization --norm-epsilon --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --add-qkv-bias
--hidden-dropout --attention-dropout --init-method-std --make-vocab-size-divisible-by --transformer-impl --attention-backend
--recompute-activations --recompute-granularity --recompute-method --recompute-num-layers --recompute-modules --no-layout-invariant-init
--apply-layernorm-1p --qk-layernorm --use-cpu-initialization
--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
--context-parallel-size --pipeline-schedule --sequence-parallel --use-distributed-optimizer --use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward
--torch-fsdp2-no-grad-sync-per-microbatch --overlap-grad-reduce
--distributed-backend --distributed-timeout-minutes --weipipe-grad-dtype --fpdt --fpdt-chunk-size --fpdt-offload
--micro-batch-size --global-batch-size --train-iters --train-samples --lr --min-lr --decoupled-lr
--decoupled-min-lr --lr-decay-style --lr-warmup-iters --lr-warmup-samples --lr-decay-samples
--lr-warmup-fraction --lr-decay-iters --weight-decay --clip-grad --optimizer --adam-beta1 --adam-beta2 --adam-eps
--sgd-momentum --bf16 --fp16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32 --calculate-per-token-loss
--seed --eval-interval --eval-iters --skip-train --exit-interval
--exit-duration-in-mins --exit-signal-handler --no-check-for-nan-in-loss-and-grad --skip-nan-steps
--deterministic-mode --data-path --split --mock-data --data-cache-path --num-workers --reset-position-ids
--reset-attention-mask --eod-mask-loss --tokenizer-type --tokenizer-model --vocab-size --save --load
--save-interval --no-load-optim --no-load-rng --finetune --ckpt-format --log-interval --tensorboard-dir
--log-throughput --timing-log-level --schedule-trace --log-params-norm --log-num-zeros-in-grad
--log-memory-to-tensorboard --log-timers-to-tensorboard --profile --use-pytorch-profiler
--profile-step-start --profile-step-end --profile-ranks --dist-ckpt-optim-fully-reshardable --use-rope-scaling
 --rope-scaling-factor --allow-unverified-gpu-paths --offload-layer-inputs
--num-distributed-optimizer-instances --overlap-param-gather --overlap-p2p-comm --tp-comm-overlap
--manual-gc --manual-gc-interval --no-manual-gc-eval --empty-unused-memory-level
--cp-comm-type --hierarchical-context-parallel-sizes --use-nccl-ub --disable-symmetric-registration
--use-checkpoint-opt_param-scheduler --override-opt_param-scheduler
--fp8-format --fp8-recipe --fp8-margin --fp8-amax-history-len --fp8-amax-compute-algo --no-fp8-wgrad
--fp8-param-gather --first-last-layers-bf16 --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16
--async-save --ckpt-fully-parallel-load
--rampup-batch-size --step-batch-size-schedule --decrease-batch-size-if-needed
--vocab-file --merge-file --tiktoken-pattern --tiktoken-num-special-tokens --tokenizer-special-tokens
--tiktoken-special-tokens --no-create-attention-mask-in-dataloader --no-mmap-bin-files
--log-validation-ppl-to-tensorboard --wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity --logging-level
--optimizer-cpu-offload --optimizer-offload-fraction --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d
--no-pin-cpu-grads --no-pin-cpu-params
""".split()


def _option_strings(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}


def test_every_megatron_flag_is_generated_once():
    generated = _option_strings(build_parser())
    compat = MegatronCompatConfig.accepted() + MegatronCompatConfig.refused()  # tests/test_megatron_flags.py
    assert set(MEGATRON_FLAGS) | set(compat) == generated
    assert len(MEGATRON_FLAGS) == len(set(MEGATRON_FLAGS))


def test_inverted_and_renamed_switches():
    cfg = parse_config(tiny_gpt_args(**{"disable-bias-linear": True, "no-layout-invariant-init": True,
                                        "deterministic-mode": True, "no-check-for-nan-in-loss-and-grad": True}))
    assert cfg.model.add_bias_linear is False and cfg.model.layout_invariant_init is False
    assert cfg.training.deterministic is True and cfg.training.check_for_nan_in_loss_and_grad is False
    plain = parse_config(tiny_gpt_args())
    assert plain.model.add_bias_linear is True and plain.model.layout_invariant_init is True


def test_config_round_trips_through_its_flags(tmp_path):
    argv = tiny_gpt_args(swiglu=True, normalization="RMSNorm", **{"disable-bias-linear": True, "bf16": True,
                         "num-query-groups": 2, "group-query-attention": True, "save": str(tmp_path),
                         "save-interval": 2, "fpdt": True, "fpdt-chunk-size": 16, "context-parallel-size": 2,
                         "hidden-dropout": 0.0, "attention-dropout": 0.0})
    first = parse_config(argv, world_size=2)
    again = []
    for section, _, _ in SECTIONS:
        again += to_flags(getattr(first, section))
    second = parse_config(again, world_size=2)
    assert asdict(second) == asdict(first)


def test_validation_does_not_change_what_it_checks():
    cfg = parse_config(tiny_gpt_args())
    before = asdict(cfg)
    cfg.validate()
    assert asdict(cfg) == before


def test_sequence_parallel_at_tp_1_is_turned_off_with_a_warning(caplog, monkeypatch):
    """Megatron-LM's rule (its Llama-3 8B script passes --sequence-parallel at TP 1)."""
    import logging

    from megatron_weipipe import arguments

    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.WARNING, logger=arguments.__name__):
        off = parse_config(tiny_gpt_args(**{"sequence-parallel": True}))
        kept = parse_config(tiny_gpt_args(**{"sequence-parallel": True, "tensor-model-parallel-size": 2}),
                            world_size=2)
    assert off.parallel.sequence_parallel is False and kept.parallel.sequence_parallel is True
    assert [r.getMessage() for r in caplog.records] == [
        "warning: disabling --sequence-parallel because --tensor-model-parallel-size is 1 (as Megatron-LM does)"]


def test_readme_table_is_the_generated_one():
    readme = open(os.path.join(REPO_ROOT, "docs", "reference", "flags.md")).read()
    assert flags_table() in readme, "docs/reference/flags.md's flag table is stale: paste `python -m tools.flags_table`"


@pytest.mark.parametrize("flag", ["--bf16", "--recompute-method", "--num-layers-per-virtual-pipeline-stage",
                                  "--data-path", "--fpdt-chunk-size"])
def test_the_simulator_takes_pretrain_flags(flag):
    from megatron_weipipe.simulator.cli import build_parser as simulator_parser

    assert flag in _option_strings(simulator_parser())


def _action(parser, flag):
    return next(a for a in parser._actions if flag in a.option_strings)


def test_lr_decay_style_help_and_error_name_what_is_accepted():
    from megatron_weipipe.config import LR_DECAY_STYLES, ConfigError, one_of

    assert one_of(LR_DECAY_STYLES) in _action(build_parser(), "--lr-decay-style").help
    for style in LR_DECAY_STYLES:
        assert parse_config(tiny_gpt_args(**{"lr-decay-style": style})).training.lr_decay_style == style
    with pytest.raises(ConfigError) as e:
        parse_config(tiny_gpt_args(**{"lr-decay-style": "WSD"}))
    assert str(e.value) == f"--lr-decay-style must be {one_of(LR_DECAY_STYLES)}, not 'WSD'"


def test_each_vocabulary_has_one_home():
    """The attention backends, FPDT's kernels and the weight passes are declared once; the
    flags, the checks and the simulator read them from there."""
    from megatron_weipipe.weight_pass import RUNTIME_WEIGHT_PASSES, SIMULATED_WEIGHT_PASSES, TRAINING_WEIGHT_PASS, WeightPass
    from megatron_weipipe.model_config import ATTENTION_BACKENDS
    from megatron_weipipe.fpdt import kernels
    from megatron_weipipe.fpdt.config import AUTO_KERNEL, BLOCK_KERNELS, KERNELS
    from megatron_weipipe.simulator.cli import build_parser as simulator_parser

    assert tuple(_action(build_parser(), "--attention-backend").choices) == ATTENTION_BACKENDS
    assert tuple(kernels.KERNEL_CLASSES) == BLOCK_KERNELS and KERNELS == (AUTO_KERNEL, *BLOCK_KERNELS)
    assert TRAINING_WEIGHT_PASS in RUNTIME_WEIGHT_PASSES
    assert set(RUNTIME_WEIGHT_PASSES) | set(SIMULATED_WEIGHT_PASSES) == set(WeightPass)
    # the simulator's only value of its own prices the runtime's deferred pass
    assert set(SIMULATED_WEIGHT_PASSES) - set(RUNTIME_WEIGHT_PASSES) == {WeightPass.IDEAL}
    assert tuple(_action(simulator_parser(), "--weipipe-weight-pass").choices) == SIMULATED_WEIGHT_PASSES
