"""The streaming data path: a DataLoader per rank over its shard, seeded per batch, resumable."""

from __future__ import annotations

import json
import multiprocessing
import pathlib

import numpy as np
import pytest
import torch

from localsgd.cli.forkserver import start_method
from localsgd.data import ShardSampler, load_data, make_batches, shard_indices
from localsgd.data.datasets import cifar10, image_folder, synthetic
from localsgd.data.loader import StreamBatches
from tests.helpers import BASE, cli, fake_cifar, same_model, train_records

CPU = torch.device("cpu")


def _take(batches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batches.next() for _ in range(n)]


def _same(a, b) -> bool:
    pairs = zip(a, b, strict=True)
    return all(torch.equal(x, y) for pa, pb in pairs for x, y in zip(pa, pb, strict=True))


@pytest.mark.slow  # DataLoader worker processes
@pytest.mark.timeout(120)
def test_augmented_batches_repeat_for_any_worker_count_and_after_a_mid_epoch_restore(tmp_path):
    # in a fresh process: the DataLoader forks its workers, and a test process that ran
    # in-process collectives before (gloo, torchft's managers) may hold native threads whose
    # state a fork copies half-made (seen: a loader worker aborted at its first thread)
    ctx = multiprocessing.get_context(start_method())
    child = ctx.Process(target=_augmented_batches_repeat, args=(str(tmp_path),))
    child.start()
    child.join(100)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, f"the checks failed in the child (exit code {child.exitcode})"


def _augmented_batches_repeat(tmp: str) -> None:
    tmp_path = pathlib.Path(tmp)
    fake_cifar(tmp_path, per_batch=8)  # 40 train images
    data = cifar10(str(tmp_path))
    cfg = {"loader": "auto", "num_workers": 0}

    def batches(workers: int) -> StreamBatches:
        sampler = ShardSampler(torch.arange(40), 6, seed=3, rank=1)  # 6 batches an epoch
        return make_batches(data, {**cfg, "num_workers": workers}, sampler, CPU)

    torch.manual_seed(0)
    ref = batches(0)
    assert isinstance(ref, StreamBatches)  # cifar10 is not a TensorDataset: streamed
    expected = _take(ref, 10)
    after_loading = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after_loading)  # the loader left the global RNG alone
    two = batches(2)
    first = _take(two, 4)
    state = two.state_dict()  # mid-epoch; the DataLoader has prefetched past this point
    assert state["position"] == 4 * 6 and state["epoch"] == 0
    resumed = batches(1)
    resumed.load_state_dict(state)
    assert _same(first + _take(resumed, 6), expected)  # crosses into the second epoch
    # the worker counts compared were in effect (0 in this process, 2, then 1 loader process)
    assert (ref.num_workers, two.num_workers, resumed.num_workers) == (0, 2, 1)
    two.close()
    resumed.close()
    # augmentation is on (the batches differ from the unaugmented set's): what repeated above
    # are random crops and flips, not fixed images that would repeat anyway
    plain = make_batches(cifar10(str(tmp_path), augment=False), cfg, batches(0).sampler, CPU)
    assert not _same(expected[:6], _take(plain, 6))


@pytest.mark.slow  # DataLoader worker processes
@pytest.mark.timeout(60)
def test_tensor_sets_take_the_in_memory_path_and_stream_gives_the_same_batches():
    # in a fresh process, as above: its one loader process is forked (aborted once in CI
    # after other tests had run in this test process)
    ctx = multiprocessing.get_context(start_method())
    child = ctx.Process(target=_tensor_sets_take_the_in_memory_path)
    child.start()
    child.join(50)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, f"the checks failed in the child (exit code {child.exitcode})"


def _tensor_sets_take_the_in_memory_path() -> None:
    data = synthetic(num_samples=200, num_features=4, seed=0)
    sampler = lambda: ShardSampler(torch.arange(100), 8, seed=0, rank=0)  # noqa: E731
    memory = make_batches(data, {"loader": "auto"}, sampler(), CPU)
    stream = make_batches(data, {"loader": "stream", "num_workers": 1}, sampler(), CPU)
    assert type(memory).__name__ == "MemoryBatches"
    assert isinstance(stream, StreamBatches)  # else the comparison below is of one path twice
    assert _same(_take(memory, 20), _take(stream, 20))
    stream.close()


@pytest.mark.timeout(60)
def test_image_folder_reads_a_folder_of_pngs(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    data = image_folder(str(tmp_path), image_size=16)
    assert data.num_classes == 2 and len(data.train) == 6 and len(data.test) == 4
    assert data.train.targets == [0, 0, 0, 1, 1, 1]
    x, y = data.test[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 0


STREAM = [a for a in BASE if not a.startswith(("data", "model"))] + ["model=resnet20"]


@pytest.mark.slow
@pytest.mark.long  # ~18 s: `make test-long`; the first test restores a stream mid-epoch in-process
@pytest.mark.timeout(420)
def test_streamed_cifar_killed_mid_epoch_resumes_bit_identical(tmp_path):
    fake_cifar(tmp_path / "cifar")  # 200 train images: 100 a rank, 12 batches of 8 an epoch
    data = ["data=cifar10", f"data.root={tmp_path / 'cifar'}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    proc, _ = cli(STREAM + data + [f"hydra.run.dir={ref_dir}"], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the killed run loads with a worker process: the batches must not depend on it
    args = STREAM + data + ["data.num_workers=1", f"hydra.run.dir={run_dir}"]
    proc, left = cli(args, fault="kill:1:7", timeout=200)  # last checkpoint: step 5, mid-epoch
    assert proc.returncode == 1 and "worker rank 1 died" in proc.stderr, proc.stderr[-2000:]
    assert not left, "a worker (or a loader process) outlived the failed job"
    # resumed with no loader process: allowed (it changes no batch), and still bit-identical
    proc, left = cli([a for a in args if a != "data.num_workers=1"], timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr and "step-5" in proc.stderr
    assert not left
    assert same_model(run_dir / "model.pt", ref_dir / "model.pt")
    assert train_records(run_dir) == train_records(ref_dir)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_max_epochs_counts_passes_over_the_smallest_shard(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("trainer.max_steps")]
    partition = ["data.partition=dirichlet", "data.alpha=5"]  # shards of unequal size
    proc, _ = cli(args + partition + ["trainer.max_steps=null", "trainer.max_epochs=2"]
                  + [f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    node = {"_target_": "localsgd.data.datasets.synthetic", "num_samples": 600, "val_fraction": 0.1}
    labels = load_data(node, seed=0).train.targets  # less the validation split
    shards = [len(shard_indices(labels, 2, r, "dirichlet", 0, alpha=5.0)) for r in range(2)]
    assert shards[0] != shards[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 * (min(shards) // 8)


@pytest.mark.long  # a benchmark at toy size: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dataloader_benchmark_runs_at_tiny_size(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = tmp_path / "DATALOADER.md"
    proc = subprocess.run(
        [sys.executable, "experiments/bench/dataloader.py", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "| 2 | memory |" in text and "| 2 | stream |" in text
    assert "| stream / memory |" in text and "x** |" in text  # the ratio, measured


class _NoTargets(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int):
        return torch.zeros(2, 3), i % 2


def test_labels_from_targets_or_one_pass_and_shape_from_the_data_or_a_sample():
    from types import SimpleNamespace

    from localsgd.data import input_shape_of, labels_of

    assert labels_of(_NoTargets()).tolist() == [0, 1, 0, 1, 0]  # one pass over the set
    with_targets = _NoTargets()
    with_targets.targets = [4, 3, 2, 1, 0]
    assert labels_of(with_targets).tolist() == [4, 3, 2, 1, 0]  # no pass: read as given
    assert input_shape_of(SimpleNamespace(train=_NoTargets())) == (2, 3)
    assert input_shape_of(SimpleNamespace(train=None, input_shape=[7])) == (7,)


def test_memory_is_refused_for_a_set_that_is_not_tensors():
    from localsgd.config import ConfigError
    from localsgd.data.loader import in_memory

    with pytest.raises(ConfigError, match="^data.loader must be auto or stream"):
        in_memory(_NoTargets(), "memory")
    assert not in_memory(_NoTargets(), "auto")


def test_loader_memory_is_pinned_for_cuda_only():
    # building the DataLoader touches no GPU: this checks the setting on a machine without one
    data = synthetic(num_samples=50, num_features=4, seed=0)
    sampler = ShardSampler(torch.arange(40), 8, seed=0, rank=0)
    for device, pinned in ((torch.device("cuda"), True), (CPU, False)):
        loader = StreamBatches(data.train, sampler, device, num_workers=1)._loader()
        assert loader.pin_memory is pinned and loader.num_workers == 1
