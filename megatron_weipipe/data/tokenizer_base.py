"""The interface every tokenizer of the data layer has, on megatron-core's tokenizer base class."""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from collections import OrderedDict
from typing import Any, Iterable

from megatron_weipipe.mcore_versions import tokenizer_base

_MegatronBase = tokenizer_base()


class Tokenizer(_MegatronBase):
    """Common base: megatron-core's abstract tokenizer plus what our data layer relies on.

    The megatron-core base constructor is not called on purpose: in 0.16 it only fills
    ``unique_identifiers`` and logs a deprecation warning on every construction.
    """

    def __init__(self, *paths: str, **options: Any) -> None:
        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [os.path.abspath(p) for p in paths]
        for key, value in options.items():
            self.unique_identifiers[key] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids."""

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Token ids to text; special tokens are dropped."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (largest id + 1)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended between documents and used for loss/attention resets."""

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no vocab mapping")

    def apply_chat_template(self, *args, **kwargs):
        """Pretraining tokenizers carry no chat template (megatron-core >= 0.17's base asks for one)."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def as_int_list(ids: Iterable[int]) -> list[int]:
    # Accepts lists, numpy arrays and torch tensors alike.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # type: ignore[union-attr]
    return [int(i) for i in ids]
