"""Resuming at another world size (localsgd.loop.checkpoint.reshard): 4 -> 2 and 2 -> 4.

A run is SIGKILLed after its step-10 checkpoint (taken at a sync) and resumed with another
`dist.world_size`. Every new worker starts from rank 0's averaged model, the step and the
averager's state (DiLoCo's anchor and outer momentum), with the old workers' mean optimizer state
and its new shard at the old epoch's fraction; the run finishes."""

from __future__ import annotations

import json

import pytest
import torch

from localsgd.loop import checkpoint
from tests.helpers import BASE, cli, refusal

pytestmark = pytest.mark.slow

# averages after step indices 4, 9, 14, ...: the step-10 checkpoint is taken at a sync, step 15
# too; the kill at step 13 leaves 10 as the newest
RESHARD = BASE + ["sync.warmup_steps=4", "sync.period=5", "trainer.checkpoint_every=5"]


def _run(args, run_dir, world, fault=None):
    return cli(args + [f"hydra.run.dir={run_dir}", f"dist.world_size={world}"], fault=fault)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
    return [t for item in items for t in _tensors(item)]


def _mean(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(len(tensors))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "before,after,extra",
    [
        # shrinking DiLoCo: its 2 -> 1 between syncs below stays in make test
        pytest.param(
            4, 2, ["sync.outer=diloco", "optim=adamw", "optim.lr=0.01"], marks=pytest.mark.long
        ),
        (2, 4, []),
    ],
)
def test_resume_at_another_world_size(tmp_path, before, after, extra):
    run_dir, probe = tmp_path / "run", tmp_path / "probe"
    args = RESHARD + extra
    proc, left = _run(args, run_dir, before, fault="kill:0:13")
    assert proc.returncode == 1 and not left, proc.stderr[-2000:]
    saved = checkpoint.step_dir(str(run_dir), 10)
    old = [torch.load(checkpoint.rank_file(saved, r), weights_only=True) for r in range(before)]
    snap = f"trainer.callbacks=[{{_target_:tests.faults.Snapshot,dir:'{probe}'}}]"
    proc, left = _run(args + [snap], run_dir, after)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert f"resuming at another world size: {before} workers'" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == after and summary["steps"] == 24
    for rank in range(after):
        got = torch.load(probe / f"rank-{rank}.pt", weights_only=False)
        assert got["step"] == 10
        for name, value in old[0]["model"].items():  # the averaged model, bit for bit
            assert torch.equal(got["model"][name], value), name
        assert got["averager"]["step"] == old[0]["averager"]["step"]
        ref = _tensors(old[0]["averager"]["rounds"])  # DiLoCo's anchors and outer momentum
        mine = _tensors(got["averager"]["rounds"])
        assert len(mine) == len(ref) and all(
            torch.equal(a, b) for a, b in zip(mine, ref, strict=True)
        )
        for index, entry in old[0]["optimizer"]["state"].items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
                    want = _mean([o["optimizer"]["state"][index][name] for o in old])
                    assert torch.equal(got["optimizer"]["state"][index][name], want)
        assert got["sampler"]["epoch"] == old[0]["sampler"]["epoch"]
        assert got["sampler"]["num_indices"] != old[0]["sampler"]["num_indices"]  # new shards
    if extra:  # anchors and momentum buffers were compared
        assert len(_tensors(old[0]["averager"]["rounds"])) >= 2  # flat: anchor, momentum


def test_a_checkpoint_between_syncs_resumes_and_per_worker_state_is_refused(tmp_path, capsys):
    """No process needed: a fake rank state written by 2 workers between syncs."""
    folder = checkpoint.step_dir(str(tmp_path), 7)
    import os

    os.makedirs(folder)
    sizes = {}
    for r in range(2):
        path = checkpoint.rank_file(folder, r)
        torch.save({"step": 7, "loop": {"in_sync": False}}, path)
        sizes[os.path.basename(path)] = os.path.getsize(path)
    marker = {"step": 7, "world_size": 2, "files": sizes, "config": None}
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump(marker, f)
    assert checkpoint.verify(folder, world_size=4)["world_size"] == 2  # any complete one
    for r in range(2):  # now taken at a sync
        torch.save({"step": 7, "loop": {"in_sync": True}}, checkpoint.rank_file(folder, r))
        sizes[f"rank-{r}.pt"] = os.path.getsize(checkpoint.rank_file(folder, r))
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump({**marker, "files": sizes}, f)
    assert checkpoint.verify(folder, world_size=4)["world_size"] == 2
    line = refusal(
        BASE + ["dist.world_size=4", f"trainer.resume={folder}", "sync.overlap=true"], capsys
    )
    assert line.startswith("error: dist.world_size must stay 2") and "sync.overlap" in line


# Checkpoints every 7 steps: averages after step indices 4, 9, 14, ... (steps 5, 10, 15 done), so
# the one at step 7 is taken 2 local steps after a sync, where the replicas differ; the kill at
# step 9 leaves it the newest.
BETWEEN = BASE + ["sync.warmup_steps=4", "sync.period=5", "trainer.checkpoint_every=7"]


def _between_syncs(tmp_path, extra, before, after):
    """Killed after the step-7 checkpoint at `before` workers, resumed at `after`: (the old rank
    states, what each new worker held before its first step, the resumed run's stderr)."""
    run_dir, probe = tmp_path / "run", tmp_path / "probe"
    proc, left = _run(BETWEEN + extra, run_dir, before, fault="kill:0:9")
    assert proc.returncode == 1 and not left, proc.stderr[-2000:]
    saved = checkpoint.step_dir(str(run_dir), 7)
    old = [torch.load(checkpoint.rank_file(saved, r), weights_only=True) for r in range(before)]
    assert not old[0]["loop"]["in_sync"]
    first = next(iter(old[0]["model"]))
    assert not torch.equal(old[0]["model"][first], old[1]["model"][first])  # replicas differ
    snap = f"trainer.callbacks=[{{_target_:tests.faults.Snapshot,dir:'{probe}'}}]"
    proc, left = _run(BETWEEN + extra + [snap], run_dir, after)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 24
    new = [torch.load(probe / f"rank-{r}.pt", weights_only=False) for r in range(after)]
    assert all(n["step"] == 7 for n in new)
    return old, new, proc.stderr


@pytest.mark.timeout(180)
def test_a_checkpoint_between_syncs_resumes_at_another_world_size_from_the_mean_model(tmp_path):
    old, new, err = _between_syncs(tmp_path, [], before=2, after=1)
    assert (
        "resuming at another world size: the checkpoint was taken 2 local steps after the last "
        "sync, so 1 worker start from the mean of the 2 workers' models;" in err
    ), err[-2000:]
    for name in old[0]["model"]:  # the old workers' mean, bit for bit, before the first step
        assert torch.equal(new[0]["model"][name], _mean([o["model"][name] for o in old])), name


@pytest.mark.timeout(180)
def test_diloco_between_syncs_resumes_at_another_world_size_from_the_anchor(tmp_path):
    extra = ["sync.outer=diloco", "optim=adamw", "optim.lr=0.01"]
    old, new, err = _between_syncs(tmp_path, extra, before=2, after=1)
    assert (
        "so 1 worker start from the model of the last outer step (the anchor, the same on every "
        "worker), dropping the 2 local steps since; the step (7), the LR schedule, the outer "
        "state and the data go on from the checkpoint," in err
    ), err[-2000:]
    anchor = torch.cat([a.flatten() for a in old[0]["averager"]["rounds"]["anchors"]])
    model = torch.cat([v.flatten() for v in new[0]["model"].values()])
    assert torch.equal(model, anchor)  # the last global model, not either worker's nor the mean
    assert not torch.equal(model, torch.cat([v.flatten() for v in old[0]["model"].values()]))
    ref, mine = old[0]["averager"]["rounds"], new[0]["averager"]["rounds"]
    assert all(torch.equal(a, b) for a, b in zip(_tensors(mine), _tensors(ref), strict=True))


def _fake(folder, world: int, state: dict) -> str:
    import os

    os.makedirs(folder)
    sizes = {}
    for r in range(world):
        path = checkpoint.rank_file(folder, r)
        torch.save({"step": 7, **state}, path)
        sizes[os.path.basename(path)] = os.path.getsize(path)
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump({"step": 7, "world_size": world, "files": sizes}, f)
    return folder


@pytest.mark.timeout(30)
def test_the_resume_line_says_where_the_new_workers_start(tmp_path):
    from localsgd.loop.checkpoint.reshard import resume_line

    loop = {"loop": {"in_sync": False}}
    plain = _fake(tmp_path / "plain", 4, {**loop, "averager": {"last_average": 4}})
    assert resume_line(plain, 4) is None  # its own states
    assert resume_line(plain, 2).startswith(
        "resuming at another world size: the checkpoint was taken 2 local steps after the last "
        "sync, so 2 workers start from the mean of the 4 workers' models;"
    )
    outer = {"last_average": 4, "rounds": {"anchors": [], "optimizers": [{}]}}
    diloco = _fake(tmp_path / "diloco", 2, {**loop, "averager": outer})
    assert "dropping the 2 local steps since; the step (7)," in resume_line(diloco, 1)
    levels = _fake(tmp_path / "levels", 4, {**loop, "averager": {"levels": []}})
    assert "the checkpoint was taken between syncs, so 2 workers" in resume_line(levels, 2)
    at_sync = _fake(tmp_path / "sync", 4, {"loop": {"in_sync": True}})
    assert resume_line(at_sync, 2).startswith(
        "resuming at another world size: 4 workers' averaged model, step, outer state and "
        "schedule continue with 2,"
    )


@pytest.mark.timeout(180)
def test_error_feedback_residuals_move_to_another_world_size_as_their_mean(tmp_path):
    """4-bit DiLoCo with error feedback, 2 -> 3 from a checkpoint at a sync: every new worker
    starts with the old residuals' sum over the old world size (what the next average would
    have added), not rank 0's (counted 3 times) and not none (lost)."""
    run_dir, probe = tmp_path / "run", tmp_path / "probe"
    args = RESHARD + [
        "sync.outer=diloco", "optim=adamw", "optim.lr=0.01", "sync.comm_dtype=int4",
        "sync.error_feedback=true",
    ]  # fmt: skip
    proc, left = _run(args, run_dir, 2, fault="kill:0:13")
    assert proc.returncode == 1 and not left, proc.stderr[-2000:]
    saved = checkpoint.step_dir(str(run_dir), 10)
    old = [torch.load(checkpoint.rank_file(saved, r), weights_only=True) for r in range(2)]
    residuals = [_tensors(o["averager"]["rounds"]["residuals"]) for o in old]
    assert residuals[0] and not torch.equal(residuals[0][0], residuals[1][0])
    snap = f"trainer.callbacks=[{{_target_:tests.faults.Snapshot,dir:'{probe}'}}]"
    proc, left = _run(args + [snap], run_dir, 3)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    for rank in range(3):
        got = torch.load(probe / f"rank-{rank}.pt", weights_only=False)
        mine = _tensors(got["averager"]["rounds"]["residuals"])
        for a, b, m in zip(*residuals, mine, strict=True):
            assert torch.equal(m, (a + b) * 0.5)
