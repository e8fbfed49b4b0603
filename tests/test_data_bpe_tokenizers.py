"""Megatron-LM's file-based BPE tokenizers on tiny files the tests write: ``TikTokenizer`` (a
tiktoken vocabulary, ``--tiktoken-pattern v1|v2``, megatron-core's TikTokenTokenizer) and
``GPT2BPETokenizer`` (``--vocab-file`` / ``--merge-file``). Ids are checked against a byte-pair
encoder written in the test harness, megatron-core's own tokenizer and transformers'; the
tiktoken vocabulary also goes through preprocessing and a short training run."""

from __future__ import annotations

import json
import math
import sys

import numpy
import pytest

from harness import run_distributed
from harness.bpe_files import (MERGES, TEXT, gpt2_reference_ids, tiktoken_reference_ids, write_gpt2_files,
                               write_tiktoken_vocab)
from harness.runs import tiny_gpt_args, train_and_collect

from megatron_weipipe.arguments import parse_config
from megatron_weipipe.data.config import TokenizerConfig
from megatron_weipipe.data.tokenizers import build_tokenizer

pytest.importorskip("tiktoken")
SPECIAL = 16  # --tiktoken-num-special-tokens: small, so the tiny file fills --vocab-size
VOCAB = SPECIAL + 256 + len(MERGES)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiktoken") / "tiny_tiktoken.json"
    return str(path), write_tiktoken_vocab(str(path))


def _tiktoken(path, pattern, **kw):
    return build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=path,
                                           tiktoken_pattern=pattern, vocab_size=VOCAB,
                                           tiktoken_num_special_tokens=SPECIAL, **kw))


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_equal_megatron_core_and_a_reference_bpe(tiktoken_file, pattern):
    from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer as mcore

    path, ranks = tiktoken_file
    ours = _tiktoken(path, pattern).tokenize(TEXT)
    core = mcore.TikTokenTokenizer(path, num_special_tokens=SPECIAL, pattern=pattern, vocab_size=VOCAB)
    regex = {"v1": mcore._PATTERN_TIKTOKEN_V1, "v2": mcore._PATTERN_TIKTOKEN_V2}[pattern]
    assert ours == core.text_to_ids(TEXT) == tiktoken_reference_ids(TEXT, regex, ranks, SPECIAL)
    assert len(ours) < 0.6 * len(TEXT.encode())  # the merges are used


def test_tiktoken_v1_and_v2_split_differently(tiktoken_file):
    path, ranks = tiktoken_file
    v1, v2 = (_tiktoken(path, p).tokenize(TEXT) for p in ("v1", "v2"))
    merged = ranks[b"oW"] + SPECIAL  # "HelloWorld": one piece under v1, "Hello" + "World" under v2
    assert merged in v1 and merged not in v2
    assert _tiktoken(path, "v1").detokenize(v1) == _tiktoken(path, "v2").detokenize(v2) == TEXT


def test_tiktoken_special_tokens_are_placed_as_megatron_lm_places_them(tiktoken_file):
    path, ranks = tiktoken_file
    tok = _tiktoken(path, "v2")
    assert tok.special_tokens[:8] == ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<SPECIAL_7>"]
    assert len(tok.special_tokens) == SPECIAL and tok.vocab_size == VOCAB
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, 4)
    assert tok.tokenize("\x00") == [SPECIAL] and tok.tokenize("the") == [ranks[b"the"] + SPECIAL]
    assert tok.tokenize("a<s>b") == [ord("a") + SPECIAL, 1, ord("b") + SPECIAL]  # written specials encode as such
    custom = ["<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>", "<|im_start|>"]
    tok = _tiktoken(path, "v2", tokenizer_special_tokens=custom)
    assert (tok.bos, tok.eod) == (0, 1) and tok.tokenize("<|im_start|>") == [7]
    assert tok.detokenize([0, *tok.tokenize("the end"), 1]) == "the end"


def test_tiktoken_refusals_are_one_line(tiktoken_file, monkeypatch):
    path, _ = tiktoken_file
    with pytest.raises(ValueError, match=f"holds {256 + len(MERGES)} tokens; --vocab-size minus "
                                         f"--tiktoken-num-special-tokens asks for {VOCAB + 1 - SPECIAL}"):
        build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=path, vocab_size=VOCAB + 1,
                                        tiktoken_num_special_tokens=SPECIAL))
    with pytest.raises(ValueError, match="missing <pad>"):
        _tiktoken(path, "v2", tokenizer_special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>"])
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ValueError, match=r"needs the 'tiktoken' package \(pip install tiktoken\)"):
        _tiktoken(path, "v2")


def test_tiktoken_pattern_with_the_null_tokenizer_is_accepted_and_unused():
    # Megatron-LM's Llama-3 8B script: --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2
    args = tiny_gpt_args(data_path=None, mock_data=True, tokenizer_type="NullTokenizer", vocab_size=128256)
    with_pattern = parse_config(args + ["--tiktoken-pattern", "v2"])
    assert with_pattern.data.tiktoken_pattern == "v2"
    tok = build_tokenizer(with_pattern.data)
    assert type(tok).__name__ == "NullTokenizer" and (tok.vocab_size, tok.eod) == (128257, 128256)


def test_gpt2_bpe_ids_equal_a_reference_bpe_and_transformers(tmp_path, monkeypatch):
    vocab_file, merge_file, vocab = write_gpt2_files(str(tmp_path))
    # Megatron-LM's GPT-3 example spelling
    cfg = parse_config(tiny_gpt_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file))
    tok = build_tokenizer(cfg.data)
    ids = tok.tokenize(TEXT)
    assert ids == gpt2_reference_ids(TEXT, vocab, merge_file)
    assert len(ids) < 0.6 * len(TEXT.encode())  # the merges are used
    assert (tok.eod, tok.vocab_size) == (vocab["<|endoftext|>"], len(vocab))
    assert tok.eod not in tok.tokenize("<|endoftext|>")  # no special tokens while tokenizing, as Megatron-LM's
    assert tok.detokenize(ids + [tok.eod]) == TEXT
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))(TEXT)["input_ids"] == ids
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file))


def test_tiktoken_preprocessing_and_a_short_training_run(tiktoken_file, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from tools import preprocess_data

    path, _ = tiktoken_file
    words = TEXT.split()
    docs = [" ".join(words[i % len(words):] + words[:i % len(words)]) for i in range(40)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern", "v1",
             "--vocab-size", str(VOCAB), "--tiktoken-num-special-tokens", str(SPECIAL)]
    prefix = str(tmp_path / "tik")
    assert preprocess_data.main(["--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", prefix,
                                 "--append-eod", *flags]) == 0
    tok = _tiktoken(path, "v1")
    stored = IndexedDataset(prefix + "_text_document")
    assert len(stored) == len(docs)
    for i in (0, 17, 39):
        assert stored[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]
    assert int(numpy.concatenate([stored[i] for i in range(len(docs))]).max()) >= 256 + SPECIAL  # merged tokens

    args = tiny_gpt_args(data_path=prefix + "_text_document", split="1,0,0", train_iters=2, global_batch_size=4,
                         num_layers=2, make_vocab_size_divisible_by=8, data_cache_path=str(tmp_path / "cache"))
    [result] = run_distributed(train_and_collect, 1, args + flags, timeout=300, collect_grads=False)
    assert result["iteration"] == 2 and all(math.isfinite(x) for x in result["losses"])
    [embedding] = [shards for key, shards in result["params"].items() if key.startswith("embedding.word_emb")]
    assert embedding[0][0][0] == 8 * math.ceil(VOCAB / 8)  # rows: the TikTokenizer's vocabulary, padded
