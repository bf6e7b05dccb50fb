"""The `comm_bytes` of top-k runs made before 2026-12-05, restated as today's wire counts them.

Until then `sync.compress=topk` sent each kept position as int16 (2 bytes); it now sends the same
positions Elias-Fano coded (`localsgd.averaging.wire.sparse`), about 8 bits each at 64 of 4096. The
positions, the values and so the model are the same bits; only the index bytes differ. A run's
`comm_bytes` is a whole number of rounds, each one message of the flat buffer's `numel` values,
so the restated count is exact: rounds x today's message. A count that is not whole int16 rounds
is refused rather than guessed at.
"""

from __future__ import annotations

import math
from typing import Any

from localsgd.averaging.wire.sparse import TopKCodec

# the sparseloco preset's and the config's defaults (conf/sync/sparseloco.yaml, config.SyncConfig)
DEFAULT_DENSITY, DEFAULT_CHUNK = 0.015625, 4096


def int16_wire_bytes(codec: TopKCodec, numel: int) -> int:
    """What the int16-index wire sent for `numel` values: 4 bytes of scale a chunk, 2 an index,
    2 bits a value."""
    chunks = codec.num_chunks(numel)
    sent = chunks * codec.k
    return 4 * chunks + 2 * sent + math.ceil(sent / 4)


def codec_of(config: dict[str, Any]) -> TopKCodec | None:
    """The top-k codec a run's flattened config (`sync.compress`, ...) names, or None."""
    if config.get("sync.compress") != "topk":
        return None
    return TopKCodec(float(config.get("sync.topk_density", DEFAULT_DENSITY)),
                     int(config.get("sync.topk_chunk", DEFAULT_CHUNK)))  # fmt: skip


def restated(comm_bytes: int, numel: int, codec: TopKCodec, rounds: int) -> int:
    """`comm_bytes` of `rounds` top-k rounds of `numel` values as today's wire counts them:
    unchanged when they already are today's messages, restated when they are int16 ones."""
    today, before = codec.wire_bytes(numel), int16_wire_bytes(codec, numel)
    if comm_bytes == rounds * today:
        return comm_bytes
    if comm_bytes == rounds * before:
        return rounds * today
    raise ValueError(f"{comm_bytes} bytes are not {rounds} rounds of {numel} values with {codec} "
                     f"(today {today} bytes a round, int16 indices {before})")  # fmt: skip


def restate_run(summary: dict[str, Any], config: dict[str, Any],
                metrics: list[dict[str, Any]] | None = None) -> bool:  # fmt: skip
    """Restate a finished top-k run's `comm_bytes` (summary and, where given, every metrics
    record's) in place if it was made with int16 indices; True if it was. The flat buffer is the
    parameters (`summary["params"]` values), every round one message of it."""
    codec = codec_of(config)
    if codec is None:
        return False
    numel, rounds = summary["params"], summary["comm_rounds"]
    before = int16_wire_bytes(codec, numel)
    if summary["comm_bytes"] == restated(summary["comm_bytes"], numel, codec, rounds):
        return False
    summary["comm_bytes"] = rounds * codec.wire_bytes(numel)
    for record in metrics or ():
        if "comm_bytes" in record:
            done, left = divmod(record["comm_bytes"], before)
            if left:
                raise ValueError(f"{record['comm_bytes']} bytes are not whole int16 rounds")
            record["comm_bytes"] = done * codec.wire_bytes(numel)
    return True
