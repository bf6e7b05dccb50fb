"""Read an offline `run-*.wandb` file back (wandb 0.31 no longer ships a Python reader).

The file is a leveldb-style log: a 7-byte header (`:W&B`, 2-byte magic, 1-byte version), then
32 KiB blocks of records, each with a 7-byte header (crc32 u32, length u16, type u8: 1 full,
2 first, 3 middle, 4 last); a block tail shorter than 7 bytes is padding. Each whole record is a
`wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list[wandb_internal_pb2.Record]:
    data = open(path, "rb").read()  # noqa: SIM115
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    pos, out, parts = 7, [], []
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # padding at the end of a block
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def history(path: str) -> list[dict]:
    """Every history row logged, as {key: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def run_info(path: str) -> wandb_internal_pb2.RunRecord:
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{path} holds no run record")
