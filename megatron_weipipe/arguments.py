"""Megatron-compatible command-line flags, parsed into a PretrainConfig.

Flag names follow Megatron-LM so that existing launch scripts carry over. Parsing
does no validation beyond types; ``PretrainConfig.validate`` owns the rules.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from megatron_weipipe.config import (
    CheckpointConfig,
    FPDTFlags,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    TrainingConfig,
)
from megatron_weipipe.data.datasets import DataConfig


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"])
    g.add_argument("--recompute-granularity", default=None)
    g.add_argument("--recompute-method", default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument(
        "--no-layout-invariant-init",
        action="store_true",
        help="use megatron-core's per-rank initialisation instead of one that is the same for every "
        "parallel layout (the default lets a run switch TP/PP/schedule at equal seed)",
    )


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--pipeline-schedule",
        default=None,
        help="1f1b, interleaved, none, weipipe-naive, weipipe-interleave, weipipe-zb "
        "(default: none at PP=1, interleaved with virtual stages, else 1f1b)",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--weipipe-grad-dtype", default="fp32", choices=["fp32", "bf16"])
    g.add_argument("--fpdt", action="store_true", help="chunked Ulysses attention (FPDT)")
    g.add_argument("--fpdt-chunk-size", type=int, default=65536)
    g.add_argument("--fpdt-offload", action="store_true")


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--optimizer", default="adam")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true")
    g.add_argument("--skip-nan-steps", action="store_true", help="skip an optimizer step whose loss or grad is NaN/Inf")
    g.add_argument("--deterministic-mode", action="store_true")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist")


def _logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-throughput", action="store_true", default=True)
    g.add_argument("--timing-log-level", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-style GPT pretraining with WeiPipe and FPDT schedules.",
        allow_abbrev=False,
    )
    for add in (_model_args, _parallel_args, _training_args, _data_args, _checkpoint_args, _logging_args):
        add(p)
    return p


def config_from_args(args: argparse.Namespace, world_size: Optional[int] = None) -> PretrainConfig:
    """Map parsed flags onto the typed config (no validation)."""
    model = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups,
        group_query_attention=args.group_query_attention,
        kv_channels=args.kv_channels,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        transformer_impl=args.transformer_impl,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        layout_invariant_init=not args.no_layout_invariant_init,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        context_parallel_size=args.context_parallel_size,
        pipeline_schedule=args.pipeline_schedule,
        sequence_parallel=args.sequence_parallel,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        weipipe_grad_dtype=args.weipipe_grad_dtype,
    )
    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        train_iters=args.train_iters,
        lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_decay_iters=args.lr_decay_iters,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        optimizer=args.optimizer,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        bf16=args.bf16,
        fp16=args.fp16,
        seed=args.seed,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        skip_train=args.skip_train,
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        check_for_nan_in_loss_and_grad=not args.no_check_for_nan_in_loss_and_grad,
        skip_nan_steps=args.skip_nan_steps,
        deterministic=args.deterministic_mode,
    )
    data = DataConfig(
        data_path=args.data_path,
        split=args.split,
        mock_data=args.mock_data,
        seq_length=args.seq_length,
        seed=args.seed,
        data_cache_path=args.data_cache_path,
        num_workers=args.num_workers,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # The model applies the causal mask itself; an [s, s] mask per sample is only needed
        # when documents inside a sequence must not see each other.
        create_attention_mask=args.reset_attention_mask,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )
    checkpoint = CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng,
        finetune=args.finetune,
        ckpt_format=args.ckpt_format,
    )
    logging_cfg = LoggingConfig(
        log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir,
        log_throughput=args.log_throughput,
        timing_log_level=args.timing_log_level,
    )
    fpdt = FPDTFlags(enabled=args.fpdt, chunk_size=args.fpdt_chunk_size, offload=args.fpdt_offload)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return PretrainConfig(
        model=model,
        parallel=parallel,
        training=training,
        data=data,
        checkpoint=checkpoint,
        logging=logging_cfg,
        fpdt=fpdt,
        world_size=world_size,
    )


def parse_config(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> PretrainConfig:
    """Parse and validate; raises ConfigError (one sentence) on anything that cannot work."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args, world_size)
    cfg.validate()
    return cfg
