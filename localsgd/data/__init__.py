"""Datasets, per-worker shards, the resumable sampler and a rank's batches."""

from localsgd.data.datasets import DataSplits, LabelledTensors
from localsgd.data.loader import (
    eval_batches,
    input_shape_of,
    labels_of,
    load_data,
    make_batches,
    task_of,
)
from localsgd.data.partition import shard_indices
from localsgd.data.sampler import ShardSampler

__all__ = [
    "DataSplits",
    "LabelledTensors",
    "ShardSampler",
    "eval_batches",
    "input_shape_of",
    "labels_of",
    "load_data",
    "make_batches",
    "shard_indices",
    "task_of",
]
