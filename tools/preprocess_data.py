#!/usr/bin/env python
"""Tokenize a jsonl corpus into Megatron indexed datasets (<prefix>_<key>_document.bin/.idx).

Each input line is one JSON object; every ``--json-keys`` field becomes one document in
that key's dataset, written through megatron-core's IndexedDatasetBuilder. Files are
written under temporary names and renamed only on success, so a failed run leaves no
half-written dataset behind. Bad input ends the run with one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Any, Iterator

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from megatron_weipipe.platform import quiet_host_notices  # noqa: E402 - after TOKENIZERS_PARALLELISM

quiet_host_notices()

from megatron_weipipe.data.config import TokenizerConfig  # noqa: E402
from megatron_weipipe.flags import add_flags, from_args  # noqa: E402


class InputError(Exception):
    """Bad input: reported as one line, no traceback."""


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    add_flags(p, TokenizerConfig, title="tokenizer (pretrain_gpt.py's flags)")
    p.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.log_interval < 1:
        p.error("--log-interval must be at least 1")
    if len(set(args.json_keys)) != len(args.json_keys):
        p.error("--json-keys must not repeat a key")
    return args


# Per-process state for pool workers (built once per worker by _init_worker).
_TOKENIZER: Any = None
_KEYS: list[str] = []
_APPEND_EOD = False


def _init_worker(tokenizer: TokenizerConfig, keys: list[str], append_eod: bool) -> None:
    global _TOKENIZER, _KEYS, _APPEND_EOD
    from megatron_weipipe.data.tokenizers import build_tokenizer

    _TOKENIZER = build_tokenizer(tokenizer)
    _KEYS = keys
    _APPEND_EOD = append_eod


def _encode(item: tuple[int, bytes]) -> tuple[int, int, dict[str, list[int]] | str]:
    """(line number, raw line) -> (line number, bytes, {key: ids} or an error message)."""
    lineno, raw = item
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError:
        return lineno, len(raw), "is not valid UTF-8"
    except json.JSONDecodeError as err:
        return lineno, len(raw), f"is not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(doc, dict):
        return lineno, len(raw), "is not a JSON object"
    out: dict[str, list[int]] = {}
    for key in _KEYS:
        if key not in doc:
            return lineno, len(raw), f"has no key {key!r}"
        text = doc[key]
        if not isinstance(text, str):
            return lineno, len(raw), f"has a non-string value for key {key!r}"
        try:
            ids = list(_TOKENIZER.tokenize(text))
        except ValueError as err:
            return lineno, len(raw), f"cannot be tokenized ({err})"
        if ids and _APPEND_EOD:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return lineno, len(raw), out


def _read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, raw


def preprocess(args: argparse.Namespace) -> dict[str, Any]:
    """Run the conversion; raises InputError (or ValueError from the tokenizer) on bad input."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_weipipe.data.tokenizers import build_tokenizer

    if not os.path.isfile(args.input):
        raise InputError(f"input file {args.input} does not exist")
    tok_cfg = from_args(args, TokenizerConfig)
    tokenizer = build_tokenizer(tok_cfg)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin.tmp", dtype=dtype) for k, p in paths.items()}
    init = (tok_cfg, list(args.json_keys), args.append_eod)

    docs = tokens = nbytes = empty = 0
    start = time.monotonic()
    pool = None
    ok = False
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init)
            results = pool.imap(_encode, _read_lines(args.input), chunksize=64)
        else:
            _init_worker(*init)
            results = map(_encode, _read_lines(args.input))
        for lineno, size, encoded in results:
            if isinstance(encoded, str):
                raise InputError(f"{args.input} line {lineno} {encoded}")
            nbytes += size
            for key, ids in encoded.items():
                if not ids:
                    empty += 1  # an empty document holds no tokens and would only add an empty entry
                    continue
                builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                tokens += len(ids)
            docs += 1
            if docs % args.log_interval == 0:
                elapsed = max(time.monotonic() - start, 1e-9)
                print(f"processed {docs} documents, {tokens} tokens, "
                      f"{nbytes / elapsed / 1e6:.2f} MB/s", flush=True)
        for key, builder in builders.items():
            if not builder.sequence_lengths:
                raise InputError(f"input file {args.input} holds no non-empty {key!r} documents")
        for key, builder in builders.items():
            builder.finalize(paths[key] + ".idx.tmp")
        for key in builders:
            os.replace(paths[key] + ".bin.tmp", paths[key] + ".bin")
            os.replace(paths[key] + ".idx.tmp", paths[key] + ".idx")
        ok = True
    finally:
        if pool is not None:
            if ok:
                pool.close()
            else:
                pool.terminate()
            pool.join()
        if not ok:
            for builder in builders.values():
                builder.data_file.close()
            for p in paths.values():
                for tmp in (p + ".bin.tmp", p + ".idx.tmp"):
                    if os.path.exists(tmp):
                        os.remove(tmp)
    elapsed = max(time.monotonic() - start, 1e-9)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "empty": empty,
            "seconds": elapsed, "outputs": [paths[k] for k in args.json_keys], "dtype": numpy.dtype(dtype).name}


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    try:
        s = preprocess(args)
    except (InputError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"done: {s['documents']} documents, {s['tokens']} tokens ({s['dtype']}), "
          f"{s['bytes'] / 1e6:.2f} MB in {s['seconds']:.1f} s "
          f"({s['bytes'] / s['seconds'] / 1e6:.2f} MB/s)"
          + (f", {s['empty']} empty documents skipped" if s["empty"] else ""))
    for prefix in s["outputs"]:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
