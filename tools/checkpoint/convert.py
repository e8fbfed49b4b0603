#!/usr/bin/env python
"""Hugging Face Llama-family checkpoints in and out (offline; local directories only).

    python -m tools.checkpoint.convert hf-to-mcore --hf-dir D --save CK [--tensor-model-parallel-size T]
    python -m tools.checkpoint.convert mcore-to-hf --load CK --hf-dir D

hf-to-mcore writes a weights-only torch_dist checkpoint (layout-free keys, so it loads
under any TP/PP/CP and schedule) and prints the model flags for ``pretrain_gpt.py --load
CK``, with a --make-vocab-size-divisible-by that leaves no padded logits at TP=T. A
tensor or config field that does not fit stops it with one line naming it (exit code 2).
mcore-to-hf writes config.json and model.safetensors (float32) that transformers loads.
See docs/reference/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_weipipe.platform import quiet_host_notices  # noqa: E402

quiet_host_notices()

from tools.checkpoint.hf_llama import ConversionError, hf_config, hf_to_mcore, mcore_to_hf, model_flags, shape_from_flags, shape_from_hf  # noqa: E402,E501


def _read_hf(hf_dir: str):
    import torch
    from safetensors.torch import load_file

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} does not exist")
    config = json.load(open(path))
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir}: no *.safetensors files")
    tensors = {}
    for f in files:
        tensors.update({k: v.to(torch.float32) for k, v in load_file(os.path.join(hf_dir, f)).items()})
    return config, tensors


def _single_process_config(flags: list[str]):
    """A world-1, TP=1 PP=1 config of the model (local layers; mock data, never read)."""
    from megatron_weipipe.arguments import parse_config

    argv = flags + ["--train-iters", "0", "--micro-batch-size", "1", "--mock-data", "--transformer-impl", "local",
                    "--hidden-dropout", "0", "--attention-dropout", "0"]
    if "--seq-length" not in flags:
        argv += ["--seq-length", "16"]
    return parse_config(argv, world_size=1)


def _start(cfg):
    from megatron_weipipe.initialize import initialize_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    initialize_distributed(cfg)


def build_model(flags: list[str], vocab: int):
    import pretrain_gpt

    cfg = _single_process_config(flags)
    _start(cfg)
    return cfg, pretrain_gpt.model_provider(cfg, vocab, pre_process=True, post_process=True)


def hf_to_mcore_cmd(args) -> int:
    import torch

    from megatron_weipipe.training.checkpoint.checkpointing import save_weights

    config, tensors = _read_hf(args.hf_dir)
    shape = shape_from_hf(config)
    flags = model_flags(shape, args.tensor_model_parallel_size)
    state = hf_to_mcore(shape, tensors, shape.vocab_size)
    extra = set(tensors) - _used_names(shape)
    if extra:
        raise ConversionError(f"tensor {sorted(extra)[0]} of the Hugging Face checkpoint has no megatron-core place")
    cfg, model = build_model(flags + ["--seq-length", str(args.seq_length)], shape.vocab_size)
    try:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = [line.strip() for line in str(e).splitlines() if line.strip()][1:2]
        raise ConversionError(f"the converted tensors do not fit the model: {' '.join(detail)[:300]}") from None
    save_weights(cfg, [model], args.save, extra={"hf_config": config, "hf_vocab_size": shape.vocab_size})
    print(f"saved {args.save} (weights only; --load starts at iteration 0)")
    print("model flags for pretrain_gpt.py:")
    print(" ".join(flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "<tokenizer.json>"]))
    return 0


def _used_names(shape) -> set:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if shape.tied else {"lm_head.weight"})
    per = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
           "mlp.down_proj.weight"]
    if shape.qkv_bias:
        per += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    names |= {f"model.layers.{i}.{p}" for i in range(shape.num_layers) for p in per}
    if shape.tied:
        names.add("lm_head.weight")  # some tied checkpoints store it anyway
    return names


def load_model(root: str):
    """(flags, vocab rows, model) of the checkpoint ``root`` in one process (TP=1, PP=1)."""
    import dataclasses

    from megatron_weipipe.training.checkpoint.checkpointing import load_checkpoint, saved_common

    common = saved_common(root)
    flags = common.get("model_flags")
    if flags is None:
        raise ConversionError(f"{root}: the checkpoint predates saved model flags; re-save it with this version")
    rows = _embedding_rows(root)
    cfg, model = build_model(flags, rows)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=root, finetune=True))
    load_checkpoint(cfg, None, [model], None, None)
    return flags, rows, common, model


def _embedding_rows(root: str) -> int:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from megatron_weipipe.training.checkpoint.directory import checkpoint_dir, read_tracker

    meta = load_tensors_metadata(checkpoint_dir(root, read_tracker(root)))
    for key, t in meta.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(t.global_shape[0])
    raise ConversionError(f"{root}: no embedding.word_embeddings.weight in the checkpoint")


def mcore_to_hf_cmd(args) -> int:
    from safetensors.torch import save_file

    flags, rows, common, model = load_model(args.load)
    vocab = args.vocab_size or common.get("hf_vocab_size") or rows
    shape = shape_from_flags(flags, vocab)
    tensors = mcore_to_hf(shape, {k: v.float() for k, v in model.state_dict().items() if "_extra_state" not in k})
    os.makedirs(args.hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(args.hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.hf_dir, "config.json"), "w") as f:
        json.dump(hf_config(shape), f, indent=2)
    print(f"wrote {args.hf_dir}/config.json and model.safetensors ({len(tensors)} tensors, vocab {vocab}"
          f"{'' if vocab == rows else f' of {rows} padded rows'})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face directory -> torch_dist checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--save", required=True)
    a.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP of the training run (sets --make-vocab-size-divisible-by)")
    a.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="accepted; the checkpoint is layout-free")
    a.add_argument("--pipeline-schedule", default=None, help="accepted; the checkpoint is layout-free")
    a.add_argument("--seq-length", type=int, default=4096, help="recorded with the model flags")
    b = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint -> Hugging Face directory")
    b.add_argument("--load", required=True)
    b.add_argument("--hf-dir", required=True)
    b.add_argument("--vocab-size", type=int, default=None, help="rows to keep (default: the imported model's)")
    args = p.parse_args(argv)
    try:
        return hf_to_mcore_cmd(args) if args.command == "hf-to-mcore" else mcore_to_hf_cmd(args)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        from megatron_weipipe.initialize import shutdown_distributed

        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
