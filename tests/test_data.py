"""Data package: dataset shapes, partitions and the resumable sampler (all CPU, seconds)."""

from __future__ import annotations

import io
import pickle
from dataclasses import asdict

import numpy as np
import pytest
import torch

from localsgd.config import DATA_OPTIONS, ConfigError, DataOptions
from localsgd.data import ShardSampler, load_data, shard_indices
from localsgd.data.datasets import DataSplits, cifar10, digits, mnist1d, synthetic, text


def _check(ds: DataSplits, input_shape: tuple[int, ...], num_classes: int) -> None:
    assert ds.input_shape == input_shape
    assert ds.num_classes == num_classes
    for split in (ds.train, ds.test):
        x, y = split.tensors
        assert x.dtype == torch.float32 and tuple(x.shape[1:]) == input_shape
        assert y.dtype == torch.int64 and y.shape == (len(x),)
        assert torch.equal(split.targets, y)  # what the partition reads
        assert torch.isfinite(x).all()
        assert int(y.min()) >= 0 and int(y.max()) < num_classes
    assert ds.task == "classification"


def test_mnist1d_shapes_and_standardised():
    ds = mnist1d(num_samples=200, seed=0)
    _check(ds, (40,), 10)
    x = ds.train.tensors[0]
    assert len(ds.train) == 160 and len(ds.test) == 40
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-3


def test_mnist1d_leaves_global_rng_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSGD_DATA_DIR", str(tmp_path))  # generated here, not read back
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    mnist1d(num_samples=100, seed=7)
    assert np.random.rand() == expected


def test_mnist1d_is_generated_once_and_read_back_identically(tmp_path, monkeypatch):
    import mnist1d.data as generator

    monkeypatch.setenv("LOCALSGD_DATA_DIR", str(tmp_path))
    first, other = mnist1d(num_samples=200, seed=3), mnist1d(num_samples=200, seed=4)
    assert len(list((tmp_path / "mnist1d").glob("*.npz"))) == 2  # one file per argument set
    assert not torch.equal(first.train.tensors[0], other.train.tensors[0])

    def generate(args):
        raise AssertionError("generated again although the arrays were kept")

    monkeypatch.setattr(generator, "make_dataset", generate)
    again = mnist1d(num_samples=200, seed=3)
    for a, b in zip((first.train, first.test), (again.train, again.test), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))


def test_digits_shapes_and_stratified():
    ds = digits(test_fraction=0.25, seed=1)
    _check(ds, (1, 8, 8), 10)
    assert len(ds.train) + len(ds.test) == 1797
    assert set(ds.test.targets.tolist()) == set(range(10))
    x = ds.train.tensors[0]
    assert x.min() >= 0.0 and x.max() <= 1.0


def test_synthetic_shapes_and_seed():
    kw = dict(num_samples=300, num_features=7, num_classes=3, test_fraction=0.2)
    ds = synthetic(**kw, seed=5)
    _check(ds, (7,), 3)
    assert len(ds.train) == 240 and len(ds.test) == 60
    again = synthetic(**kw, seed=5)
    assert torch.equal(ds.train.tensors[0], again.train.tensors[0])
    assert torch.equal(ds.test.targets, again.test.targets)
    other = synthetic(**kw, seed=6)
    assert not torch.equal(ds.train.tensors[0], other.train.tensors[0])


def test_load_data_instantiates_the_target_with_the_run_seed_and_drops_own_keys():
    node = {
        "_target_": "localsgd.data.datasets.synthetic",
        "num_samples": 50,
        "num_features": 4,
        "num_classes": 2,
        # localsgd's own keys, every one of them: not passed to the callable (which takes none)
        **asdict(DataOptions(partition="by_class", num_workers=3)),
    }
    assert set(node) >= set(DATA_OPTIONS)
    ds = load_data({**node, "val_fraction": 0.0}, seed=9)  # the train set whole: no validation
    assert ds.input_shape == (4,) and len(ds.train) == 40
    assert torch.equal(ds.train.tensors[0], synthetic(50, 4, 2, seed=9).train.tensors[0])


def _write_fake_cifar(folder, per_batch: int = 6) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": list(rng.integers(0, 10, per_batch).tolist()),
        }
        buf = io.BytesIO()
        pickle.dump(batch, buf)
        (folder / name).write_bytes(buf.getvalue())


@pytest.mark.parametrize("point_at_folder", [False, True])
def test_cifar10_from_python_batches_without_md5(tmp_path, point_at_folder):
    folder = tmp_path / "cifar-10-batches-py"
    _write_fake_cifar(folder)  # not the official files: torchvision's md5 check would refuse
    ds = cifar10(str(folder if point_at_folder else tmp_path))
    assert ds.num_classes == 10 and len(ds.train) == 30 and len(ds.test) == 6
    assert len(ds.train.targets) == 30
    x, y = ds.test[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10
    # the test transform is the normalisation alone: pixel p becomes (p/255 - mean) / std
    raw = torch.from_numpy(ds.test.data[0]).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    assert torch.allclose(x, (raw - mean[:, None, None]) / std[:, None, None], atol=1e-5)


def test_cifar10_train_transform_crops_and_flips(tmp_path):
    _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    plain = cifar10(str(tmp_path), augment=False).train
    augmented = cifar10(str(tmp_path)).train
    torch.manual_seed(0)
    draws = [augmented[0][0] for _ in range(8)]
    assert all(d.shape == (3, 32, 32) for d in draws)
    assert any(not torch.equal(d, plain[0][0]) for d in draws)  # shifted and/or flipped
    assert torch.equal(plain[0][0], plain[0][0])  # no augmentation: deterministic


def test_cifar10_missing_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        cifar10(str(tmp_path / "nope"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("data.root ") and "cifar-10-python.tar.gz" in msg


def test_text_windows(tmp_path):
    path = tmp_path / "tiny.txt"
    content = "hello world, local sgd! " * 20  # 480 characters
    path.write_text(content)
    ds = text(str(path), seq_len=15, test_fraction=0.25)
    assert ds.task == "lm" and ds.input_shape == (15,)
    assert ds.num_classes == len(set(content)) and ds.vocab == "".join(sorted(set(content)))
    assert len(ds.train) + len(ds.test) == 480 // 16 and len(ds.test) == 8
    for split in (ds.train, ds.test):
        x, y = split.tensors
        assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == y.shape
        assert x.shape[1] == 15
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    x0, y0 = ds.train[0]
    decoded = "".join(ds.vocab[i] for i in x0.tolist()) + ds.vocab[y0[-1]]
    assert decoded == content[:16]
    # The test windows are the file's last ones.
    last = "".join(ds.vocab[i] for i in ds.test.targets[-1].tolist())
    assert last == content[(480 // 16) * 16 - 15 : (480 // 16) * 16]


def test_text_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="^data.path ") as info:
        text(str(tmp_path / "absent.txt"))
    assert "\n" not in str(info.value)


def test_unknown_target_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^data\._target_ must be an importable callable"):
        load_data({"_target_": "localsgd.data.datasets.imagenet"}, seed=0)


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


def test_lm_takes_iid_or_contiguous():
    targets = torch.zeros(20, 8, dtype=torch.int64)
    assert len(shard_indices(targets, 2, 1, "iid", 0)) == 10
    with pytest.raises(ValueError, match="data.partition"):
        shard_indices(targets, 2, 0, "by_class", 0)
    # contiguous: consecutive stretches of the text, in order (different plays), seed-free
    text = torch.zeros(21, 8, dtype=torch.int64)
    shards = [shard_indices(text, 4, r, "contiguous", seed=r).tolist() for r in range(4)]
    assert shards == [list(range(0, 6)), *(list(range(a, a + 5)) for a in (6, 11, 16))]


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
