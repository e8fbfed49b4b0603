import pickle

import pytest

from megatron_weipipe.data.tokenizers import (
    TOKENIZER_TYPES,
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)

UNICODE_TEXTS = [
    "",
    "plain ascii, with punctuation!?",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🚀👩‍🔬, RTL עברית",
    "tabs\tand\nnewlines\r\n and a NUL \x00 byte",
    "\U0010ffff edge of unicode",
]

TRAIN_TEXT = [
    "The cat sits on the mat. The dog runs in the park.",
    "A duck swims in the pond. Ducks eat seeds.",
    "Seven plus two is nine. Three plus four is seven.",
] * 50


def test_byte_level_round_trip_and_specials():
    tok = ByteLevelTokenizer()
    for text in UNICODE_TEXTS:
        ids = tok.tokenize(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.detokenize(ids) == text
    assert tok.vocab_size == 259
    assert tok.eod == 256 and len({tok.eod, tok.pad, tok.bos}) == 3
    assert max(tok.eod, tok.pad, tok.bos) < tok.vocab_size
    # Special tokens vanish, and a window cut mid-character still decodes.
    ids = tok.tokenize("héllo") + [tok.eod] + tok.tokenize("wörld")
    assert tok.detokenize(ids) == "héllowörld"
    assert tok.detokenize(tok.tokenize("日本")[1:]).endswith("本")


def test_null_tokenizer_follows_megatron():
    tok = NullTokenizer(1000)
    assert tok.vocab_size == 1001 and tok.eod == 1000
    assert tok.tokenize("5 17 999") == [5, 17, 999]
    assert tok.detokenize([5, 17, 999]) == "5 17 999"
    assert tok.tokenize("") == []
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("5 1001")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("five")


def _train_bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.save(str(path))
    return path


def test_huggingface_bpe_round_trip(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json")
    tok = build_tokenizer("HuggingFaceTokenizer", str(path), None)
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.eod == tok.vocab["<|endoftext|>"]
    assert tok.vocab_size <= 300
    for text in UNICODE_TEXTS + TRAIN_TEXT[:3]:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # Merges learned from the training text make it shorter than its bytes.
    assert len(tok.tokenize(TRAIN_TEXT[0])) < len(TRAIN_TEXT[0].encode()) // 2
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(TRAIN_TEXT[1]) == tok.tokenize(TRAIN_TEXT[1])


def test_huggingface_word_level_needs_an_eod(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TRAIN_TEXT, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "word.json"))
    wl = HuggingFaceTokenizer(str(tmp_path / "word.json"))
    assert wl.eod == wl.vocab["</s>"]
    assert wl.detokenize(wl.tokenize("The cat sits on the mat")) == "The cat sits on the mat"

    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="no end-of-document token"):
        HuggingFaceTokenizer(str(tmp_path / "bare.json"))


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece as spm

    (tmp_path / "train.txt").write_text("\n".join(TRAIN_TEXT))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "train.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=100,
        model_type="bpe",
        minloglevel=2,
    )
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "sp.model"), None)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 100 and 0 <= tok.eod < 100
    for text in TRAIN_TEXT[:3]:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize(tok.tokenize(TRAIN_TEXT[0]) + [tok.eod]) == TRAIN_TEXT[0]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(TRAIN_TEXT[2]) == tok.tokenize(TRAIN_TEXT[2])


@pytest.mark.parametrize(
    "args, message",
    [
        (("BertWordPieceCase", None, None), "is not one of"),
        (("GPT2BPETokenizer", None, None), "needs --vocab-file"),
        (("TikTokenizer", None, None), "needs tokenizer_model"),
        (("HuggingFaceTokenizer", None, None), "needs tokenizer_model"),
        (("HuggingFaceTokenizer", "/nonexistent/tokenizer.json", None), "does not exist"),
        (("SentencePieceTokenizer", "/nonexistent/sp.model", None), "does not exist"),
        (("NullTokenizer", None, None), "needs vocab_size"),
    ],
)
def test_factory_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(*args)


def test_factory_builds_every_fileless_type():
    assert isinstance(build_tokenizer("ByteLevelTokenizer"), ByteLevelTokenizer)
    assert build_tokenizer("NullTokenizer", None, 64).vocab_size == 65
    assert set(TOKENIZER_TYPES) == {
        "ByteLevelTokenizer",
        "HuggingFaceTokenizer",
        "SentencePieceTokenizer",
        "NullTokenizer",
        "TikTokenizer",
        "GPT2BPETokenizer",
    }


def test_corrupt_model_file_is_a_value_error(tmp_path):
    bad = tmp_path / "broken.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="broken.model"):
        build_tokenizer("SentencePieceTokenizer", str(bad), None)
    with pytest.raises(ValueError, match="broken.model"):
        build_tokenizer("HuggingFaceTokenizer", str(bad), None)
