"""Megatron-LM's data-loader flags through megatron-core's GPTDatasetConfig: ``--no-mmap-bin-files``
reads the .bin with file reads (the same samples), and ``--no-create-attention-mask-in-dataloader``
leaves ``--reset-attention-mask`` without effect (no mask, documents attend to each other), as
megatron-core's dataset does in Megatron-LM, with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from harness.runs import tiny_gpt_args

from megatron_weipipe.arguments import RESET_ATTENTION_MASK_OFF, parse_config
from megatron_weipipe.data.datasets import build_train_valid_test_datasets
from megatron_weipipe.data.tokenizers import build_tokenizer

SAMPLES = [0, 5, 11]


def _train_dataset(tmp_path, *flags):
    cfg = parse_config(tiny_gpt_args(data_cache_path=str(tmp_path)) + list(flags))
    train, _, _ = build_train_valid_test_datasets(cfg.data, build_tokenizer(cfg.data), [16, None, None])
    return cfg, train


def test_no_mmap_bin_files_reads_the_same_samples_without_a_memory_map(tmp_path):
    cfg, mapped = _train_dataset(tmp_path)
    cfg_read, read = _train_dataset(tmp_path, "--no-mmap-bin-files")
    assert cfg.data.mmap_bin_files and not cfg_read.data.mmap_bin_files
    assert type(mapped.dataset.bin_reader).__name__ == "_MMapBinReader"
    assert type(read.dataset.bin_reader).__name__ == "_FileBinReader"
    for i in SAMPLES:
        assert torch.equal(read[i]["tokens"], mapped[i]["tokens"])


def test_no_create_attention_mask_leaves_reset_attention_mask_without_effect(tmp_path, caplog):
    cfg_reset, reset = _train_dataset(tmp_path, "--reset-attention-mask")
    cfg_plain, plain = _train_dataset(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megatron_weipipe.arguments"):
        cfg_both, both = _train_dataset(tmp_path, "--reset-attention-mask", "--no-create-attention-mask-in-dataloader")
    assert caplog.messages == [RESET_ATTENTION_MASK_OFF]
    assert cfg_reset.data.create_attention_mask and cfg_reset.data.reset_attention_mask
    assert not cfg_both.data.create_attention_mask and not cfg_both.data.reset_attention_mask
    masks = [reset[i]["attention_mask"] for i in SAMPLES]
    causal = ~torch.tril(torch.ones_like(masks[0], dtype=torch.bool))
    assert any(not torch.equal(m, causal) for m in masks)  # with the mask, documents are cut apart
    for i in SAMPLES:
        assert "attention_mask" not in both[i] and "attention_mask" not in plain[i]
        assert all(torch.equal(both[i][k], plain[i][k]) for k in ("tokens", "labels", "loss_mask", "position_ids"))


def test_split_takes_the_quotes_a_megatron_lm_script_leaves():
    """Megatron-LM's Llama-3 scripts pass "--split '99,1,0'" through an unquoted array, so the
    quotes arrive; megatron-core reads the numbers, and so does start-up. Other text is refused."""
    assert parse_config(tiny_gpt_args(split="'99,1,0'")).data.split == "'99,1,0'"
    with pytest.raises(Exception, match="must be up to three numbers"):
        parse_config(tiny_gpt_args(split="99;1"))
