"""Offline tokenizers with one small interface, usable by megatron-core's GPT datasets.

Every tokenizer here exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``, plus the ``unique_identifiers`` mapping that megatron-core hashes
into its dataset cache keys. Nothing here downloads anything: models are local files, and the
optional ``tokenizers`` / ``sentencepiece`` / ``tiktoken`` packages are imported only when used.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from megatron_weipipe.data.bpe_tokenizers import GPT2BPETokenizer, TikTokenizer
from megatron_weipipe.data.config import TOKENIZER_TYPES, TokenizerConfig, check_tokenizer_args
from megatron_weipipe.data.tokenizer_base import Tokenizer, as_int_list

# Names tried, in order, for the end-of-document token of a tokenizer.json.
EOD_TOKEN_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
    "<eod>",
    "[EOD]",
)


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then EOD, PAD and BOS: needs no files, round-trips any text."""

    NUM_BYTES = 256

    def __init__(self) -> None:
        super().__init__()
        self._eod = self.NUM_BYTES
        self._pad = self.NUM_BYTES + 1
        self._bos = self.NUM_BYTES + 2
        self._special = {"<eod>": self._eod, "<pad>": self._pad, "<bos>": self._bos}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        data = bytes(i for i in as_int_list(ids) if 0 <= i < self.NUM_BYTES)
        # A window cut mid-character must still decode; whole documents decode exactly.
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self._special)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        return {"eod_token": self._eod, "pad_token": self._pad, "bos_token": self._bos}

    @property
    def vocab(self) -> dict[str, int]:
        table = {f"<0x{b:02X}>": b for b in range(self.NUM_BYTES)}
        table.update(self._special)
        return table


class NullTokenizer(Tokenizer):
    """Megatron's placeholder tokenizer for mock data: text is space-separated integer ids.

    As in Megatron, ``vocab_size=N`` makes ids 0..N-1 ordinary tokens and N the EOD, so the
    reported ``vocab_size`` is N + 1.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer text must be space-separated integers.") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer id {bad[0]} is outside [0, {self.vocab_size}).")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in as_int_list(ids))

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n


class HuggingFaceTokenizer(Tokenizer):
    """A local ``tokenizer.json`` (the ``tokenizers`` file format), e.g. GPT-2 or Llama-3 BPE.

    No special tokens (BOS) are added while tokenizing; documents are separated by EOD at
    preprocessing time instead, as Megatron does for GPT pretraining.
    """

    def __init__(self, path: str, eod_token: str | None = None) -> None:
        super().__init__(path, eod_token=eod_token)
        self._path = path
        self._eod_token = eod_token
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise ValueError(
                "HuggingFaceTokenizer needs the 'tokenizers' package (pip install tokenizers)."
            ) from None
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as err:
            raise ValueError(f"cannot load tokenizer file {path}: {err}") from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(self._vocab.values()) + 1
        names = (eod_token,) if eod_token is not None else EOD_TOKEN_CANDIDATES
        found = [n for n in names if n in self._vocab]
        if not found:
            raise ValueError(
                f"tokenizer file {path} has no end-of-document token; looked for {', '.join(names)}."
            )
        self._eod = self._vocab[found[0]]
        self._pad = next((self._vocab[n] for n in ("<pad>", "[PAD]", "<|pad|>") if n in self._vocab), None)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(as_int_list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        if self._pad is None:
            raise NotImplementedError("this tokenizer.json has no pad token")
        return self._pad

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __getstate__(self) -> dict[str, Any]:
        # Rebuild from the file in worker processes rather than pickling the Rust object.
        return {"path": self._path, "eod_token": self._eod_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["eod_token"])


class SentencePieceTokenizer(Tokenizer):
    """A local SentencePiece ``.model`` (e.g. Llama-2); its EOS piece is the EOD."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._path = path
        try:
            import sentencepiece
        except ImportError:
            raise ValueError(
                "SentencePieceTokenizer needs the 'sentencepiece' package (pip install sentencepiece)."
            ) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as err:
            raise ValueError(f"cannot load SentencePiece model {path}: {err}") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {path} has no EOS piece to use as end-of-document.")

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode(as_int_list(ids))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad(self) -> int:
        if self._sp.pad_id() < 0:
            raise NotImplementedError("this SentencePiece model has no pad piece")
        return int(self._sp.pad_id())

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])


def build_tokenizer(
    tokenizer_type: str | TokenizerConfig, tokenizer_model: str | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """Build a tokenizer by its Megatron-LM type name from local files only: from the flags of a
    ``TokenizerConfig`` (a ``DataConfig`` is one), or from a type name, model file and vocabulary size."""
    cfg = tokenizer_type if isinstance(tokenizer_type, TokenizerConfig) else TokenizerConfig(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size)
    cfg.check_tokenizer()
    kind = cfg.tokenizer_type
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(int(cfg.vocab_size))  # type: ignore[arg-type]
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model)  # type: ignore[arg-type]
    if kind == "TikTokenizer":
        return TikTokenizer(cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.vocab_size,  # type: ignore[arg-type]
                            cfg.tiktoken_num_special_tokens, cfg.special_tokens)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)  # type: ignore[arg-type]
    return SentencePieceTokenizer(cfg.tokenizer_model)  # type: ignore[arg-type]


__all__: Sequence[str] = (
    "TOKENIZER_TYPES",
    "Tokenizer",
    "ByteLevelTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "GPT2BPETokenizer",
    "build_tokenizer",
    "check_tokenizer_args",
)
