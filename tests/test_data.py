"""Data package: dataset shapes, partitions and the resumable sampler (all CPU, seconds)."""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from localsgd.config import DataConfig
from localsgd.data import Dataset, ShardSampler, load_dataset, shard_indices


def _cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


def _check(ds: Dataset, input_shape: tuple[int, ...], num_classes: int) -> None:
    assert ds.input_shape == input_shape
    assert ds.num_classes == num_classes
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.dtype == torch.float32 and tuple(x.shape[1:]) == input_shape
        assert y.dtype == torch.int64 and y.shape == (len(x),)
        assert torch.isfinite(x).all()
        assert int(y.min()) >= 0 and int(y.max()) < num_classes
    assert ds.task == "classification"


def test_mnist1d_shapes_and_standardised():
    ds = load_dataset(_cfg(name="mnist1d", num_samples=200), seed=0)
    _check(ds, (40,), 10)
    assert len(ds.train_x) == 160 and len(ds.test_x) == 40
    assert abs(ds.train_x.mean().item()) < 1e-4 and abs(ds.train_x.std().item() - 1) < 1e-3


def test_mnist1d_leaves_global_rng_alone():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    load_dataset(_cfg(name="mnist1d", num_samples=100), seed=7)
    assert np.random.rand() == expected


def test_digits_shapes_and_stratified():
    ds = load_dataset(SimpleNamespace(name="digits", test_fraction=0.25), seed=1)
    _check(ds, (1, 8, 8), 10)
    assert len(ds.train_x) + len(ds.test_x) == 1797
    assert set(ds.test_y.tolist()) == set(range(10))
    assert ds.train_x.min() >= 0.0 and ds.train_x.max() <= 1.0


def test_synthetic_shapes_and_seed():
    cfg = _cfg(name="synthetic", num_samples=300, num_features=7, num_classes=3, test_fraction=0.2)
    ds = load_dataset(cfg, seed=5)
    _check(ds, (7,), 3)
    assert len(ds.train_x) == 240 and len(ds.test_x) == 60
    again = load_dataset(cfg, seed=5)
    assert torch.equal(ds.train_x, again.train_x) and torch.equal(ds.test_y, again.test_y)
    other = load_dataset(cfg, seed=6)
    assert not torch.equal(ds.train_x, other.train_x)


def test_dict_config_is_accepted():
    ds = load_dataset(
        {
            "name": "synthetic",
            "num_samples": 50,
            "num_features": 4,
            "num_classes": 2,
            "noise": 1.0,
            "test_fraction": 0.2,
        },
        seed=0,
    )
    assert ds.input_shape == (4,)


def _write_fake_cifar(folder, per_batch: int = 6) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, per_batch).tolist()),
        }
        buf = io.BytesIO()
        pickle.dump(batch, buf)
        (folder / name).write_bytes(buf.getvalue())


@pytest.mark.parametrize("point_at_folder", [False, True])
def test_cifar10_from_python_batches(tmp_path, point_at_folder):
    folder = tmp_path / "cifar-10-batches-py"
    _write_fake_cifar(folder)
    root = folder if point_at_folder else tmp_path
    ds = load_dataset(_cfg(name="cifar10", root=str(root)), seed=0)
    _check(ds, (3, 32, 32), 10)
    assert len(ds.train_x) == 30 and len(ds.test_x) == 6
    channel_mean = ds.train_x.mean(dim=(0, 2, 3))
    assert torch.allclose(channel_mean, torch.zeros(3), atol=1e-4)


def test_cifar10_missing_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(_cfg(name="cifar10", root=str(tmp_path / "nope")), seed=0)
    msg = str(info.value)
    assert "\n" not in msg and "data.root" in msg and "cifar-10-python.tar.gz" in msg


def test_text_windows(tmp_path):
    path = tmp_path / "tiny.txt"
    text = "hello world, local sgd! " * 20  # 480 characters
    path.write_text(text)
    ds = load_dataset(_cfg(name="text", path=str(path), seq_len=15, test_fraction=0.25), seed=0)
    assert ds.task == "lm" and ds.input_shape == (15,)
    assert ds.num_classes == len(set(text)) and ds.vocab == "".join(sorted(set(text)))
    assert len(ds.train_x) + len(ds.test_x) == 480 // 16 and len(ds.test_x) == 8
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == y.shape
        assert x.shape[1] == 15
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    decoded = "".join(ds.vocab[i] for i in ds.train_x[0].tolist()) + ds.vocab[ds.train_y[0, -1]]
    assert decoded == text[:16]
    # The test windows are the file's last ones.
    last = "".join(ds.vocab[i] for i in ds.test_y[-1].tolist())
    assert last == text[(480 // 16) * 16 - 15 : (480 // 16) * 16]


def test_text_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path") as info:
        load_dataset(_cfg(name="text", path=str(tmp_path / "absent.txt")), seed=0)
    assert "\n" not in str(info.value)


def test_unknown_dataset():
    with pytest.raises(ValueError, match="data.name.*mnist1d"):
        load_dataset(SimpleNamespace(name="imagenet"), seed=0)


def _labels(n: int = 1000, classes: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def _shards(labels, world, partition, seed=0, **kw):
    return [shard_indices(labels, world, r, partition, seed, **kw) for r in range(world)]


def _assert_disjoint(shards) -> torch.Tensor:
    union = torch.cat(shards)
    assert len(union) == len(torch.unique(union))
    assert all(s.dtype == torch.int64 and len(s) > 0 for s in shards)
    return union


def test_iid_disjoint_covering_balanced():
    labels = _labels(1003)
    shards = _shards(labels, 4, "iid")
    union = _assert_disjoint(shards)
    assert torch.equal(union.sort().values, torch.arange(1003))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("world,cpw", [(4, 2), (5, 2), (8, 3), (3, 1), (2, 20)])
def test_by_class_limits_classes(world, cpw):
    labels = _labels()
    shards = _shards(labels, world, "by_class", classes_per_worker=cpw)
    union = _assert_disjoint(shards)
    for s in shards:
        assert len(torch.unique(labels[s])) <= cpw
    if world * cpw >= 10:  # enough slots to hold every class: nothing is dropped
        assert len(union) == len(labels)


def test_dirichlet_disjoint_and_skewed():
    labels = _labels()
    shards = _shards(labels, 4, "dirichlet", alpha=0.3)
    union = _assert_disjoint(shards)
    assert len(union) == len(labels)
    iid = _shards(labels, 4, "dirichlet", alpha=1000.0)
    assert np.std([len(s) for s in shards]) > np.std([len(s) for s in iid])


@pytest.mark.parametrize("partition", ["iid", "by_class", "dirichlet"])
def test_partition_deterministic_in_seed(partition):
    labels = _labels()
    a = _shards(labels, 4, partition, seed=3)
    b = _shards(labels, 4, partition, seed=3)
    c = _shards(labels, 4, partition, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_empty_shard_refused():
    labels = _labels(n=5)
    with pytest.raises(ValueError, match="data.partition"):
        shard_indices(labels, 8, 0, "iid", 0)


def test_lm_only_iid():
    targets = torch.zeros(20, 8, dtype=torch.int64)
    assert len(shard_indices(targets, 2, 1, "iid", 0)) == 10
    with pytest.raises(ValueError, match="data.partition"):
        shard_indices(targets, 2, 0, "by_class", 0)


def test_unknown_partition():
    with pytest.raises(ValueError, match="data.partition"):
        shard_indices(_labels(), 2, 0, "random", 0)


def test_sampler_epochs_cover_shard_and_drop_tail():
    idx = torch.arange(100, 123)  # 23 samples, batches of 5: 4 per epoch, 3 dropped
    sampler = ShardSampler(idx, batch_size=5, seed=0, rank=0)
    epoch = torch.cat([sampler.next_batch() for _ in range(4)])
    assert epoch.dtype == torch.int64 and len(torch.unique(epoch)) == 20
    assert set(epoch.tolist()) <= set(idx.tolist())
    nxt = torch.cat([sampler.next_batch() for _ in range(4)])
    assert sampler.state_dict()["epoch"] == 1
    assert not torch.equal(epoch, nxt)  # reshuffled


def test_sampler_ranks_differ_and_seed_repeats():
    idx = torch.arange(64)
    a = ShardSampler(idx, 8, seed=0, rank=0).next_batch()
    b = ShardSampler(idx, 8, seed=0, rank=1).next_batch()
    assert not torch.equal(a, b)
    assert torch.equal(a, ShardSampler(idx, 8, seed=0, rank=0).next_batch())


def test_sampler_state_round_trip(tmp_path):
    idx = torch.arange(37)
    reference = ShardSampler(idx, 6, seed=2, rank=3)
    expected = [reference.next_batch() for _ in range(20)]
    first = ShardSampler(idx, 6, seed=2, rank=3)
    for _ in range(9):  # stop mid-epoch (6 batches per epoch)
        first.next_batch()
    torch.save(first.state_dict(), tmp_path / "s.pt")
    resumed = ShardSampler(idx, 6, seed=2, rank=3)
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    for want in expected[9:]:
        assert torch.equal(resumed.next_batch(), want)


def test_sampler_batch_too_large():
    with pytest.raises(ValueError, match=r"trainer.batch_size \(11\).*\(10 samples\)") as info:
        ShardSampler(torch.arange(10), 11, seed=0, rank=0)
    assert "\n" not in str(info.value)
