"""Reading back what W&B (offline), TensorBoard and trackio stored, with their own packages' readers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_HEADER = b":W&B\xe1\xbe\x00"  # ':W&B', magic 0xBEE1, version 0
BLOCK = 32768  # LevelDB log blocks, which W&B's transaction log (.wandb) uses


def wandb_records(path: Path) -> list:
    """Every protobuf ``Record`` of an offline run's ``run-ID.wandb`` file (LevelDB log format:
    7-byte chunk headers, checksum, length, type FULL/FIRST/MIDDLE/LAST; a block's tail under 7 bytes
    is padding), parsed with wandb's own ``wandb_internal_pb2``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:7] == WANDB_HEADER, data[:7]
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_history(records) -> list[dict]:
    """The logged rows (``history`` records) as dicts."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def wandb_step_metrics(records) -> dict[str, str]:
    """name -> its step metric, from the run's ``define_metric`` records."""
    return {r.metric.name: r.metric.step_metric for r in records
            if r.WhichOneof("record_type") == "metric" and r.metric.name and r.metric.step_metric}


def tensorboard_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]
