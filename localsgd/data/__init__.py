"""Datasets, per-worker shards and the per-worker batch sampler."""

from localsgd.data.datasets import Dataset, load_dataset
from localsgd.data.partition import shard_indices
from localsgd.data.sampler import ShardSampler

__all__ = ["Dataset", "ShardSampler", "load_dataset", "shard_indices"]
