"""The validation split (localsgd/data/validation.py): carved from the training data of every
built-in data set, seeded and the same on every rank, a held-out span for text; periodic
evaluation, `sync.score`'s held-out batches and the objective read it, and the test set is read
once, by the final evaluation; summary.json reports both."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from localsgd.data import load_data
from localsgd.data.validation import validation_of, with_validation
from localsgd.loop import trainer as trainer_module
from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import BASE, SMALL, compose_config, fake_cifar, refusal

pytestmark = pytest.mark.timeout(60)


def _rows(dataset) -> set[bytes]:
    return {torch.as_tensor(dataset[i][0]).numpy().tobytes() for i in range(len(dataset))}


@pytest.mark.parametrize(
    "node",
    [
        {"_target_": "localsgd.data.datasets.synthetic", "num_samples": 500},
        {"_target_": "localsgd.data.datasets.digits"},
        {"_target_": "localsgd.data.datasets.mnist1d", "num_samples": 400},
    ],
)
def test_a_tensor_set_holds_out_a_seeded_draw_of_its_train_samples(node):
    whole = load_data({**node, "val_fraction": 0.0}, seed=0)
    data = load_data({**node, "val_fraction": 0.2}, seed=0)
    n = len(whole.train)
    assert validation_of(whole) is None
    assert len(data.val) == round(0.2 * n) and len(data.train) == n - len(data.val)
    train, val = _rows(data.train), _rows(data.val)
    assert not train & val and train | val == _rows(whole.train)  # carved from train, disjoint
    assert _rows(data.test) == _rows(whole.test)  # the test set untouched
    again = load_data({**node, "val_fraction": 0.2}, seed=0)  # another rank: the same split
    assert torch.equal(again.val.tensors[0], data.val.tensors[0])
    other = load_data({**node, "val_fraction": 0.2}, seed=1)
    assert not torch.equal(other.val.tensors[0], data.val.tensors[0])
    assert isinstance(data.train, torch.utils.data.TensorDataset)  # still trained from memory


def test_text_holds_out_the_span_just_before_the_test_span(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(97 + i % 26) for i in range(65 * 100)))
    node = {"_target_": "localsgd.data.datasets.text", "path": str(corpus), "seq_len": 64}
    whole = load_data({**node, "val_fraction": 0.0}, seed=0)
    data = load_data({**node, "val_fraction": 0.1}, seed=0)
    assert len(whole.train) == 90 and len(data.train) == 81 and len(data.val) == 9
    assert torch.equal(data.train.tensors[0], whole.train.tensors[0][:81])
    assert torch.equal(data.val.tensors[0], whole.train.tensors[0][81:])  # contiguous, last
    assert torch.equal(data.test.tensors[0], whole.test.tensors[0])


def test_augmented_image_sets_are_validated_without_their_augmentation(tmp_path):
    fake_cifar(tmp_path / "cifar")  # 200 train images
    node = {"_target_": "localsgd.data.datasets.cifar10", "root": str(tmp_path / "cifar")}
    data = load_data({**node, "val_fraction": 0.1}, seed=0)
    assert len(data.val) == 20 and len(data.train) == 180
    assert sorted(data.train.indices + data.val.indices) == list(range(200))
    torch.manual_seed(0)
    first = data.val[0][0]
    torch.manual_seed(1)
    assert torch.equal(first, data.val[0][0])  # no random crop or flip
    assert torch.equal(first, data.train_eval[data.val.indices[0]][0])
    labels = torch.tensor(data.train.dataset.targets)[data.train.indices]
    from localsgd.data import labels_of

    assert torch.equal(labels_of(data.train), labels)  # read from targets, not image by image


def test_image_folder_is_validated_without_its_augmentation(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 5), ("test", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    node = {"_target_": "localsgd.data.datasets.image_folder", "root": str(tmp_path)}
    data = load_data({**node, "image_size": 16, "val_fraction": 0.2}, seed=0)
    assert len(data.val) == 2 and len(data.train) == 8
    torch.manual_seed(0)
    first = data.val[0][0]
    torch.manual_seed(1)
    assert torch.equal(first, data.val[0][0])


def test_a_callables_own_validation_split_is_kept_and_bad_fractions_are_refused():
    class Own:
        train = test = val = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4))

    assert with_validation(Own, 0.5, 0) is Own
    for fraction in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"data.val_fraction must be in \[0, 1\)"):
            with_validation(load_data({"_target_": "localsgd.data.datasets.synthetic",
                                       "val_fraction": 0.0}, 0), fraction, 0)  # fmt: skip


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_training_reads_the_validation_split_and_the_test_set_once_at_the_end(
    lone_group, tmp_path, monkeypatch
):
    cfg = compose_config(
        SMALL + ["trainer.max_steps=24", "trainer.eval_every=6", "sync.period=3",
                 "logger.wandb.mode=disabled", "logger.plots=false", "dist.world_size=1"]
    )  # fmt: skip
    trainer = Trainer(cfg, WorkerInfo(0, 1, 0, 1), torch.device("cpu"), str(tmp_path))
    read = []
    real = trainer_module.eval_batches
    monkeypatch.setattr(
        trainer_module,
        "eval_batches",
        lambda dataset, *a, **k: read.append(dataset) or real(dataset, *a, **k),
    )
    held = []
    real_held = trainer_module.held_out_loss
    monkeypatch.setattr(
        trainer_module,
        "held_out_loss",
        lambda model, dataset, *a, **k: held.append(dataset) or real_held(model, dataset, *a, **k),
    )
    summary = trainer.train()
    trainer.held_out_loss(0, 16)  # what sync.score's judge calls
    test, val = trainer.data.test, trainer.data.val
    assert sum(d is test for d in read) == 1 and read[-2] is test  # the final evaluation's
    assert all(d is val for d in read if d is not test) and len(read) > 2
    assert held == [val]
    assert {"val_loss", "val_accuracy", "test_loss", "test_accuracy"} <= summary.keys()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    periodic = [r for r in records[:-1] if "val_loss" in r]
    assert periodic and not any("test_loss" in r for r in records[:-1])
    assert {"val_loss", "test_loss"} <= records[-1].keys()


def test_a_sweep_on_the_validation_metric_without_a_validation_split_is_refused(capsys):
    line = refusal(BASE + ["-m", "data.val_fraction=0", "seed=0,1"], capsys)
    assert line.startswith(
        "error: optimized_metric=val_accuracy needs the validation split, and "
        "data.val_fraction=0 leaves none: set data.val_fraction > 0, or "
        "optimized_metric=test_accuracy to tune on the test set"
    )
    assert refusal(BASE + ["data.val_fraction=1.5"], capsys) == (
        "error: data.val_fraction must be in [0, 1), got 1.5"
    )


def test_a_checkpoint_from_before_the_split_resumes_as_val_fraction_0():
    from localsgd.loop.checkpoint import config_mismatch

    old = {"config": {"data": {"_target_": "x", "partition": "iid"}}}  # no val_fraction then
    assert config_mismatch(old, {"data": {"_target_": "x", "partition": "iid",
                                          "val_fraction": 0.0}}) is None  # fmt: skip
    changed = config_mismatch(old, {"data": {"_target_": "x", "partition": "iid",
                                             "val_fraction": 0.1}})  # fmt: skip
    assert changed == "data.val_fraction: 0.0 in the checkpoint, 0.1 now"
