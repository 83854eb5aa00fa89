"""Reads a W&B offline run's history back from its `.wandb` file, with no network.

wandb 0.31 ships no Python reader of its transaction log (its Go core reads it for `wandb sync`), so
this parses the documented framing (LevelDB's log format: 32 KiB blocks, 7-byte record headers of
CRC, length and type, records split FIRST/MIDDLE/LAST across blocks, after W&B's 7-byte file header)
and decodes each record with wandb's own protobuf schema (`wandb.proto.wandb_internal_pb2.Record`).
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: pathlib.Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    out, pos, partial = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        body = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind in (_FULL, _FIRST):
            partial = body
        else:
            partial += body
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(partial)
            out.append(record)
    return out


def history(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """Every history row (`wandb.log` call) of the offline run in `run_dir`, keys to decoded values."""
    (log_file,) = run_dir.glob("run-*.wandb")
    rows = []
    for record in records(log_file):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows
