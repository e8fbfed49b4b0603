"""Tiny BPE tokenizer files written by the tests (a tiktoken vocabulary in Megatron-LM's JSON
format, a GPT-2 vocab.json / merges.txt pair) and a reference byte-pair encoder to check the
ids against: the textbook algorithm (split by the pre-tokenizer regex, then merge the
adjacent pair of lowest rank until none is in the vocabulary), written here on its own."""

from __future__ import annotations

import base64
import json
import os

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEXT = "The theory of HelloWorld things: the thin thing in 2024 isn't wrong.\nBut THE THING?  Hello, World!"
# Each merged token joins two earlier tokens; "oW" exists only where a piece spans "HelloWorld".
MERGES = [b"th", b"oW", b"Th", b"he", b"the", b"The", b" t", b" th", b" the", b"in", b"ing", b" thing", b"ll", b"llo",
          b"He", b"Hello", b"Wo", b"or", b"rl", b"rld", b"World", b" w", b"ro", b"ng", b"TH", b" TH",
          b"20", b"24", b"'t", b" i", b" is", b"on", b"ory", b"of", b" of"]


def _check_merges(merges: list[bytes]) -> None:
    known = {bytes([b]) for b in range(256)}
    for token in merges:
        assert any(token[:i] in known and token[i:] in known for i in range(1, len(token))), token
        known.add(token)


def write_tiktoken_vocab(path: str, merges: list[bytes] = MERGES) -> dict[bytes, int]:
    """Megatron-LM's tiktoken file: a JSON list of {rank, token_bytes (base64), token_str}, the 256
    single bytes first. Returns the ranks."""
    _check_merges(merges)
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
               for i, t in enumerate(tokens)]
    with open(path, "w") as f:
        json.dump(entries, f)
    return {t: i for i, t in enumerate(tokens)}


def bpe(piece: bytes, rank) -> list[bytes]:
    """Merge the adjacent pair of lowest ``rank(left, right)`` (None: not a merge) until none is left."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        ranked = [(rank(parts[i], parts[i + 1]), i) for i in range(len(parts) - 1)]
        ranked = [(r, i) for r, i in ranked if r is not None]
        if not ranked:
            return parts
        _, i = min(ranked)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def tiktoken_reference_ids(text: str, pattern: str, ranks: dict[bytes, int], offset: int) -> list[int]:
    """The ids of a tiktoken vocabulary whose ranks start at ``offset`` (the special tokens below)."""
    ids = []
    for piece in regex.findall(pattern, text):
        ids += [ranks[t] + offset for t in bpe(piece.encode("utf-8"), lambda a, b: ranks.get(a + b))]
    return ids


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_gpt2_files(folder: str, merges: list[bytes] = MERGES) -> tuple[str, str, dict[str, int]]:
    """GPT-2's vocab.json (the 256 byte characters, the merged tokens, <|endoftext|> last) and
    merges.txt (one pair per line in rank order, under a #version line)."""
    _check_merges(merges)
    chars = bytes_to_unicode()
    shown = lambda t: "".join(chars[b] for b in t)  # noqa: E731
    vocab = {chars[b]: b for b in range(256)}
    lines = ["#version: 0.2"]
    known = {bytes([b]) for b in range(256)}
    for token in merges:
        cut = next(i for i in range(1, len(token)) if token[:i] in known and token[i:] in known)
        lines.append(f"{shown(token[:cut])} {shown(token[cut:])}")
        vocab[shown(token)] = len(vocab)
        known.add(token)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w") as f:
        json.dump(vocab, f)
    with open(merge_file, "w") as f:
        f.write("\n".join(lines) + "\n")
    return vocab_file, merge_file, vocab


def gpt2_reference_ids(text: str, vocab: dict[str, int], merge_file: str) -> list[int]:
    """GPT-2's BPE: a pair merges at the rank of its line in merges.txt; tokens looked up by their characters."""
    chars = bytes_to_unicode()
    to_byte = {c: b for b, c in chars.items()}
    with open(merge_file) as f:
        pairs = [line.split() for line in f.read().splitlines()[1:] if line]
    rank_of = {(bytes(to_byte[c] for c in a), bytes(to_byte[c] for c in b)): i for i, (a, b) in enumerate(pairs)}
    ids = []
    for piece in regex.findall(GPT2_PATTERN, text):
        parts = bpe(piece.encode("utf-8"), lambda a, b: rank_of.get((a, b)))
        ids += [vocab["".join(chars[b] for b in t)] for t in parts]
    return ids
