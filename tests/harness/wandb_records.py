"""Read back what an offline W&B run wrote: its run file (``run-<id>.wandb``).

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version) and 32 KiB
blocks of records in LevelDB's log format (CRC-32 of type and data, length, type: full,
first, middle or last piece), each record one protobuf ``Record`` of wandb's own schema.
wandb 0.2x dropped its Python reader of this file (the ``wandb-core`` service reads it), so
the tests parse it here with wandb's protobuf classes, checking every CRC.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def offline_runs(save_dir: str) -> list[str]:
    """The offline run folders W&B made under ``save_dir``."""
    return sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*")))


def _records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", data[:7]
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at byte {pos}"
        pos += _HEADER + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            out.append(pending)
    return out


def read_run(run_dir: str) -> dict:
    """The run record (project, name, entity, config) and the history rows, by W&B step."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    run, config, history = {}, {}, {}
    for raw in _records(data):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = dict(project=r.project, name=r.display_name, entity=r.entity)
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
    return dict(run=run, config=config, history=history)
