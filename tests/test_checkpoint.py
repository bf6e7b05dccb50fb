"""Checkpoints and resume: a run killed or stopped anywhere ends bit-identical to one that never
was; partial checkpoints are never used; the same config and seed give the same model."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from localsgd.config import plain
from localsgd.loop import checkpoint
from tests.helpers import BASE, cli, compose_config, same_model, train_records


def _fake_checkpoint(run_dir, step: int, world_size: int = 2, complete: bool = True) -> str:
    folder = checkpoint.step_dir(str(run_dir), step)
    os.makedirs(folder)
    sizes = {}
    for r in range(world_size):
        path = checkpoint.rank_file(folder, r)
        torch.save({"step": step, "model": {"w": torch.ones(3) * r}}, path)
        sizes[os.path.basename(path)] = os.path.getsize(path)
    if complete:
        marker = {"step": step, "world_size": world_size, "files": sizes}
        with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
            json.dump(marker, f)
    return folder


def test_newest_complete_skips_partial_and_truncated_checkpoints(tmp_path):
    warnings = []
    good = _fake_checkpoint(tmp_path, 10)
    assert checkpoint.newest_complete(str(tmp_path), 2, warnings.append) == good
    _fake_checkpoint(tmp_path, 20, complete=False)  # killed before rank 0 wrote the marker
    truncated = _fake_checkpoint(tmp_path, 30)
    path = checkpoint.rank_file(truncated, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # e.g. a disk that filled up
    assert checkpoint.newest_complete(str(tmp_path), 2, warnings.append) == good
    assert len(warnings) == 2 and "step-30" in warnings[0] and "step-20" in warnings[1]
    assert checkpoint.verify(good, world_size=4)["world_size"] == 2  # any world size resumes it
    garbage = _fake_checkpoint(tmp_path, 40)
    path = checkpoint.rank_file(garbage, 0)
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"\0" * size)  # same size, wrong bytes
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.verify(garbage, world_size=2)


def test_prune_keeps_the_newest_complete_and_newer_partial_ones(tmp_path):
    for step in (5, 10, 15):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 3, complete=False)
    _fake_checkpoint(tmp_path, 20, complete=False)  # being written right now by a later save
    checkpoint.prune(str(tmp_path), keep=2)
    assert checkpoint.listed_steps(str(tmp_path)) == [20, 15, 10]


class _State:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value


def test_a_shared_checkpoint_is_one_state_and_the_first_writer_of_a_step_wins(tmp_path):
    """`save_shared` (ft=torchft's checkpoints): one rank state for a job of 3 workers, written
    with no collective; a second worker writing the same step (the survivors of a lost quorum
    race) leaves the first folder whole and no temporary folder behind; a partial folder of an
    earlier life is replaced."""
    loop = {"in_sync": True}
    first = checkpoint.save_shared(
        str(tmp_path), 8, 3, {"model": _State({"w": torch.ones(2)}), "loop": _State(loop)}, 2
    )
    again = checkpoint.save_shared(
        str(tmp_path), 8, 3, {"model": _State({"w": torch.zeros(2)}), "loop": _State(loop)}, 2
    )
    assert again == first and os.listdir(checkpoint.checkpoint_root(str(tmp_path))) == ["step-8"]
    assert sorted(os.listdir(first)) == [checkpoint.MARKER, "rank-0.pt"]
    marker = checkpoint.verify(first, world_size=2)  # any world size continues it
    assert marker["shared"] and marker["world_size"] == 3
    assert torch.equal(torch.load(checkpoint.rank_file(first, 0))["model"]["w"], torch.ones(2))
    partial = checkpoint.step_dir(str(tmp_path), 16)
    os.makedirs(partial)  # killed before its rename in an earlier life: no marker
    checkpoint.save_shared(str(tmp_path), 16, 3, {"loop": _State(loop)}, 2)
    assert checkpoint.verify(partial)["step"] == 16


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    path = tmp_path / "rng.pt"
    torch.save(checkpoint.rng_state(), path)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint.set_rng_state(torch.load(path, weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkilled_runs_resume_bit_identical_in_warmup_and_between_syncs(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    args = BASE + [f"hydra.run.dir={run_dir}"]
    # Rank 1 dies before step 7: the newest checkpoint (step 5) is inside the warmup.
    proc, left = cli(args, fault="kill:1:7")
    assert proc.returncode == 1 and "worker rank 1 died" in proc.stderr, proc.stderr[-2000:]
    assert not left, "a worker outlived the failed job"
    assert not (run_dir / "summary.json").exists()
    # Rank 0 dies before step 13: resumed from step 5, it checkpointed at 10, between syncs.
    proc, left = cli(args, fault="kill:0:13")
    assert proc.returncode == 1 and "worker rank 0 died" in proc.stderr, proc.stderr[-2000:]
    assert "resuming from" in proc.stderr and "step-5" in proc.stderr
    assert not left
    proc, left = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"resuming from \S*step-10", proc.stderr), proc.stderr[-2000:]

    assert same_model(run_dir / "model.pt", reference_run / "model.pt")
    ours = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((reference_run / "summary.json").read_text())
    for key in ("comm_rounds", "comm_bytes", "test_loss", "test_accuracy", "steps"):
        assert ours[key] == ref[key], key
    # metrics.jsonl was appended to, the lines of steps redone after a kill replaced, not doubled
    assert train_records(run_dir) == train_records(reference_run)
    assert checkpoint.listed_steps(str(run_dir)) == [24, 20]  # trainer.keep_checkpoints=2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_checkpoints_at_an_agreed_step_and_exits_cleanly(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    args = BASE + [f"hydra.run.dir={run_dir}"]
    # Rank 1 sends SIGTERM to the launcher before step 8, as SLURM would before pre-emption; the
    # launcher forwards it and the ranks agree to stop after the next sync (step 11).
    # (Signals arrive asynchronously: on a loaded machine the agreed sync may be a later one.)
    proc, left = cli(args, fault="sigterm:1:8")
    assert proc.returncode == 143, proc.stderr[-3000:]  # stopped, resumable: not finished
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", proc.stderr)
    assert stopped and int(stopped[1]) in (12, 17, 22), proc.stderr[-2000:]
    assert not left and not (run_dir / "summary.json").exists()
    step = int(stopped[1])
    assert checkpoint.listed_steps(str(run_dir))[0] == step
    checkpoint.verify(checkpoint.step_dir(str(run_dir), step), world_size=2)
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", reference_run / "model.pt")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_same_config_and_seed_give_bit_identical_parameters(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    proc, _ = cli(BASE + ["trainer.deterministic=true", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", reference_run / "model.pt")


def test_auto_resume_never_overwrites_a_run_whose_checkpoints_are_all_broken(tmp_path):
    from localsgd.cli.preflight import resolve_resume
    from localsgd.config import ConfigError

    cfg = {"trainer": {"resume": "auto"}}
    assert resolve_resume(cfg, 2, str(tmp_path), quiet=True) is None  # nothing there: fresh
    _fake_checkpoint(tmp_path, 5, complete=False)  # killed while writing the first one
    assert resolve_resume(cfg, 2, str(tmp_path), quiet=True) is None
    with pytest.raises(ConfigError, match="^trainer.resume=never .* holds checkpoints"):
        resolve_resume({"trainer": {"resume": "never"}}, 2, str(tmp_path))
    good = _fake_checkpoint(tmp_path, 10)
    assert resolve_resume(cfg, 2, str(tmp_path), quiet=True) == good
    with open(checkpoint.rank_file(good, 1), "r+b") as f:  # a disk error after it was complete
        f.truncate(10)
    with pytest.raises(ConfigError) as refused:
        resolve_resume(cfg, 2, str(tmp_path), quiet=True)
    assert str(refused.value) == (
        f"trainer.resume=auto found no usable checkpoint in {tmp_path}: each of the 2 is "
        f"partial or corrupt (the newest: {checkpoint.rank_file(good, 1)} is missing or "
        f"truncated); use another hydra.run.dir"
    )


def test_any_complete_checkpoint_resumes_at_another_world_size(tmp_path):
    """Between syncs too (the fake rank states hold no `loop`: not at a sync), and a
    complete checkpoint is never called broken."""
    from localsgd.cli.preflight import resolve_resume

    good = _fake_checkpoint(tmp_path, 10)  # written by 2 workers
    cfg = plain(compose_config([]))  # trainer.resume=auto, plain local SGD
    warnings = []
    assert checkpoint.newest_complete(str(tmp_path), 4, warnings.append) == good
    assert warnings == []
    assert resolve_resume(cfg, 4, str(tmp_path), quiet=True) == good
    assert resolve_resume(cfg, 1, str(tmp_path), quiet=True) == good


@pytest.mark.parametrize(
    "override,refused",
    [
        ("sync.overlap=true", "sync.overlap"),
        ("sync.bucket_mb=4", "sync.bucket_mb"),
        ("sync.comm_dtype=bfloat16", "sync.comm_dtype"),
        ("model.dropout=0.1", "model.dropout"),
        ("data.partition=by_class", "data.partition"),
        ("trainer.max_steps=5000", None),
        ("comm.simulate.latency_ms=100", None),
        ("logger.wandb.mode=disabled", None),
        ("trainer.checkpoint_every=7", None),
    ],
)
def test_resume_refuses_every_setting_outside_the_allowed_list(override, refused):
    saved = {"config": plain(compose_config([]))}
    diff = checkpoint.config_mismatch(saved, plain(compose_config([override])))
    if refused is None:
        assert diff is None
    else:
        assert diff is not None and diff.startswith(f"{refused}: ")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_finished_run_is_refused_with_how_to_extend_it_and_extends_so(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("trainer.max_steps=")] + [
        f"hydra.run.dir={run_dir}"
    ]
    proc, _ = cli([*args, "trainer.max_steps=10"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = cli([*args, "trainer.max_steps=10"])  # the same command again
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: hydra.run.dir: {run_dir} already holds a run finished after 10 steps; to train "
        f"it further, run the same command with trainer.max_steps above 10 (it continues from "
        f"its final checkpoint), or choose another directory"
    ]
    proc, left = cli([*args, "trainer.max_steps=14"])  # as the line says
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert re.search(r"resuming from \S*step-10\b", proc.stderr), proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 14


@pytest.mark.timeout(60)
def test_a_finished_run_without_its_final_checkpoint_cannot_be_extended(tmp_path, capsys):
    from tests.helpers import FAST, refusal

    (tmp_path / "summary.json").write_text('{"steps": 10}')
    line = refusal(FAST + ["trainer.max_steps=20", f"hydra.run.dir={tmp_path}"], capsys)
    assert line == (
        f"error: hydra.run.dir: {tmp_path} already holds a run finished after 10 steps, with no "
        f"checkpoint of its last step to continue from; choose another directory"
    )


class _Plain(_State):
    def load_state_dict(self, state):
        self.value = state


class _Moving(_Plain):
    """A component that says how its state moves to another world size."""

    def __init__(self, value, moved):
        super().__init__(value)
        self.moved, self.seen = moved, None

    def resharded_state(self, states, reshard):
        self.seen = (list(states), reshard.rank, reshard.world_size, reshard.old_world)
        return self.moved


def test_a_resume_at_another_world_size_asks_each_component_to_move_its_own_state(tmp_path):
    """The loader parses no component's state: each moves its own (`resharded_state`, given
    every old worker's state of it); one that returns None keeps its own (a new rank's RNG);
    one without the method takes the first old worker's state (what every worker shared)."""
    from localsgd.loop.checkpoint.reshard import load_resharded

    folder = checkpoint.step_dir(str(tmp_path), 6)
    os.makedirs(folder)
    sizes = {}
    for r in range(3):
        state = {"step": 6, "loop": {"in_sync": True}, "mine": r, "kept": r, "plain": 10 + r}
        torch.save(state, checkpoint.rank_file(folder, r))
        sizes[f"rank-{r}.pt"] = os.path.getsize(checkpoint.rank_file(folder, r))
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump({"step": 6, "world_size": 3, "files": sizes}, f)
    mine, kept, plain = _Moving(None, moved="moved"), _Moving("own", moved=None), _Plain(None)
    components = {"mine": mine, "kept": kept, "plain": plain, "loop": _Plain(None)}
    step = load_resharded(folder, 1, torch.device("cpu"), components, world_size=2)
    assert step == 6
    assert mine.value == "moved" and mine.seen == ([0, 1, 2], 1, 2, 3)
    assert kept.value == "own"
    assert plain.value == 10
