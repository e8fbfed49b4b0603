"""Tokenizers read from BPE files of Megatron-LM's own formats: GPT-2's vocab.json and
merges.txt, and a tiktoken vocabulary (a JSON list of ranks and base64 token bytes)."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from megatron_weipipe.data.config import TIKTOKEN_DEFAULT_VOCAB_SIZE
from megatron_weipipe.data.tokenizer_base import Tokenizer, as_int_list


class GPT2BPETokenizer(Tokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from a local vocab.json and merges.txt.

    GPT-2's pre-split regex, no special tokens while tokenizing (``<|endoftext|>`` written in the
    text is split like any text), ``<|endoftext|>`` as the EOD. megatron-core builds this type
    from the Hugging Face hub name ``gpt2`` (a download); the same BPE is built here from the
    two files with the ``tokenizers`` package.
    """

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        self._files = (vocab_file, merge_file)
        try:
            from tokenizers import Tokenizer as _HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError:
            raise ValueError("GPT2BPETokenizer needs the 'tokenizers' package (pip install tokenizers).") from None
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:
            raise ValueError(f"cannot load GPT-2 BPE files {vocab_file} and {merge_file}: {err}") from None
        self._tok = _HFTokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._vocab = self._tok.get_vocab()
        if self.EOD_TOKEN not in self._vocab:
            raise ValueError(f"GPT-2 vocabulary {vocab_file} has no {self.EOD_TOKEN} token to use as end-of-document.")
        self._eod = self._vocab[self.EOD_TOKEN]

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([i for i in as_int_list(ids) if i != self._eod], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return max(self._vocab.values()) + 1

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self._files}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["files"])


class TikTokenizer(Tokenizer):
    """Megatron-LM's TikTokenizer: a tiktoken vocabulary file read by megatron-core's TikTokenTokenizer.

    Ids 0..N-1 (N = --tiktoken-num-special-tokens) are the special tokens (by default
    megatron-core's <unk> <s> </s> <mask> <pad> <cls> <sep>, then <SPECIAL_i>); the file's
    ranks follow from N, cut to --vocab-size in all; ``</s>`` is the EOD. Text is split by the
    v1 or v2 pattern, and special tokens written in the text encode as themselves
    (megatron-core's ``text_to_ids``, which Megatron-LM's preprocessing calls).
    """

    def __init__(self, path: str, pattern: str | None = None, vocab_size: int | None = None,
                 num_special_tokens: int = 1000, special_tokens: Sequence[str] | None = None) -> None:
        pattern, vocab_size = pattern or "v2", vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE
        special = list(special_tokens) if special_tokens else None
        super().__init__(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=special)
        self._args = (path, pattern, vocab_size, num_special_tokens, special)
        try:
            import tiktoken  # noqa: F401 - megatron-core's module imports it only if present
        except ImportError:
            raise ValueError("TikTokenizer needs the 'tiktoken' package (pip install tiktoken).") from None
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

        try:
            self._tok = TikTokenTokenizer(path, special_tokens=special, num_special_tokens=num_special_tokens,
                                          pattern=pattern, vocab_size=vocab_size)
        except (AssertionError, KeyError, TypeError, ValueError):
            raise ValueError(_tiktoken_file_problem(path, vocab_size - num_special_tokens)) from None

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.text_to_ids(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.tokenizer.decode([i for i in as_int_list(ids) if i >= self._tok.num_special_tokens])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.vocab_size)

    @property
    def eod(self) -> int:
        return int(self._tok.eod)

    @property
    def eos(self) -> int:
        return int(self._tok.eos_id)

    @property
    def bos(self) -> int:
        return int(self._tok.bos_id)

    @property
    def pad(self) -> int:
        return int(self._tok.pad_id)

    @property
    def special_tokens(self) -> list[str]:
        """Every special token, in id order."""
        return list(self._tok.special_tokens)

    def __getstate__(self) -> dict[str, Any]:
        return {"args": self._args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["args"])


def _tiktoken_file_problem(path: str, needed: int) -> str:
    """One sentence on why megatron-core refused a tiktoken vocabulary file."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        return f"tiktoken vocabulary {path} is not readable JSON ({err})."
    keys = {"rank", "token_bytes", "token_str"}
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.keys() == keys for e in entries):
        return f"tiktoken vocabulary {path} must be a JSON list of {{rank, token_bytes, token_str}} entries."
    if len(entries) < needed:
        return (f"tiktoken vocabulary {path} holds {len(entries)} tokens; --vocab-size minus "
                f"--tiktoken-num-special-tokens asks for {needed}.")
    return f"tiktoken vocabulary {path} is inconsistent (ranks 0, 1, ... in order, the first 256 single bytes)."
