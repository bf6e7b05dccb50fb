"""`sync.excluded_shard=reassign|take_over`: an excluded worker's shard (and batch) split among
the others."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from localsgd.data.loader import MemoryBatches
from localsgd.data.partition import shard_indices
from localsgd.data.sampler import ShardSampler
from localsgd.loop.data_shard import ShardReassignment
from tests.helpers import FAST, cli, compose_config, same_model, train_records

WORLD, N = 4, 103


def _shard_of(rank: int) -> torch.Tensor:
    return shard_indices(torch.zeros(N, dtype=torch.int64), WORLD, rank, "iid", seed=5)


def _batches(rank: int) -> MemoryBatches:
    data = torch.utils.data.TensorDataset(torch.arange(N).float(), torch.arange(N))
    return MemoryBatches(data, ShardSampler(_shard_of(rank), 4, seed=5, rank=rank), "cpu")


def test_the_excluded_shard_is_split_among_the_rest_exactly_once():
    """Worker 1 excluded: workers 0, 2 and 3 each add a third of its shard, the thirds are
    disjoint and make up the whole shard; worker 1 changes nothing; a second call with the same
    verdicts changes nothing either (the sampler does not restart its epoch)."""
    trust = SimpleNamespace(excluded={1: 2})
    taken = {}
    for rank in range(WORLD):
        batches = _batches(rank)
        reassign = ShardReassignment(_shard_of, rank, WORLD, batches, announce=False)
        reassign.after_sync(SimpleNamespace(excluded={}), step=9)
        assert batches.sampler.sources == []
        reassign.after_sync(trust, step=19)
        sampler = batches.sampler
        if rank == 1:
            assert sampler.sources == [] and len(sampler.indices) == len(_shard_of(1))
            continue
        assert sampler.sources == [1] and sampler.epoch == 1
        taken[rank] = sampler.extra
        assert torch.equal(sampler.indices, torch.cat([_shard_of(rank), sampler.extra]))
        reassign.after_sync(trust, step=29)
        assert sampler.epoch == 1
    together = torch.cat(list(taken.values())).sort().values
    assert torch.equal(together, _shard_of(1))


def test_a_resumed_sampler_trains_on_the_indices_taken_over():
    """The sampler's state carries the indices taken over: loaded into a fresh sampler of the
    same worker, the next batches are the same; a state from before the reassignment loads
    into the plain shard."""
    batches = _batches(2)
    ShardReassignment(_shard_of, 2, WORLD, batches, False).after_sync(
        SimpleNamespace(excluded={1: 0}), step=0
    )
    for _ in range(7):
        batches.next()
    state = batches.state_dict()
    again = _batches(2)
    again.load_state_dict(state)
    for _ in range(12):  # past the end of the (larger) epoch
        assert torch.equal(again.next()[1], batches.next()[1])
    plain = _batches(2)
    plain.load_state_dict(_batches(2).state_dict())
    assert plain.sampler.sources == [] and torch.equal(plain.sampler.indices, _shard_of(2))


def test_take_over_splits_the_excluded_workers_batch_too():
    """`take_over`: worker 1's batch of 4 goes to workers 0, 2, 3 as 2, 1, 1 more samples a
    step (the group's 16 in all), with its shard as under `reassign`; worker 1's own batch is
    unchanged. The batch is in the sampler's state: a resumed worker draws the same batches,
    past the end of its larger epoch, and a state from before loads the plain batch."""
    trust = SimpleNamespace(excluded={1: 2})
    sizes = {}
    for rank in range(WORLD):
        batches = _batches(rank)
        ShardReassignment(_shard_of, rank, WORLD, batches, False, batch_size=4).after_sync(
            trust, step=19
        )
        sizes[rank] = len(batches.next()[1])
        if rank != 1:
            assert batches.sampler.sources == [1]
    assert sizes == {0: 6, 1: 4, 2: 5, 3: 5}
    assert sum(sizes[r] for r in (0, 2, 3)) == WORLD * 4
    batches = _batches(0)
    ShardReassignment(_shard_of, 0, WORLD, batches, False, batch_size=4).after_sync(trust, 0)
    for _ in range(3):
        batches.next()
    again = _batches(0)
    again.load_state_dict(batches.state_dict())
    for _ in range(8):
        assert torch.equal(again.next()[1], batches.next()[1])
    plain = _batches(0)
    plain.load_state_dict(_batches(0).state_dict())
    assert plain.sampler.batch_size == 4


def test_bad_values_are_refused_in_one_line():
    for overrides, said in (
        (["sync.excluded_shard=give"], "sync.excluded_shard"),
        (["sync.excluded_shard=reassign"], "only scoring excludes a worker"),
        (
            ["sync.excluded_shard=reassign", "sync.score=true", "sync.exclude_after=0"],
            "sync.exclude_after >= 1",
        ),
        (["sync.excluded_shard=take_over"], "only scoring excludes a worker"),
        (
            ["sync.excluded_shard=take_over", "sync.score=true", "dist.shard_size=2"],
            "dist.shard_size > 1 with sync.excluded_shard=reassign or take_over",
        ),
    ):
        with pytest.raises(ConfigError, match=said):
            validate(compose_config(overrides), 4)
    validate(compose_config(["sync.excluded_shard=reassign", "sync.score=true"]), 4)
    validate(compose_config(["sync.excluded_shard=take_over", "sync.score=true"]), 4)


def test_scoring_reassigns_by_default():
    """`sync.excluded_shard` null: reassign when scoring (the trust study: better on every
    setting), nothing to reassign without it; `skip` keeps the old behaviour."""
    from localsgd.data import load_data
    from localsgd.loop.data_shard import worker_batches

    for overrides, built in (
        ([], False),
        (["sync.score=true"], True),
        (["sync.score=true", "sync.excluded_shard=skip"], False),
    ):
        cfg = compose_config([*FAST, *overrides])
        _, reassign = worker_batches(cfg, load_data(cfg.data, seed=0), 1, 4, torch.device("cpu"))
        assert isinstance(reassign, ShardReassignment) is built, overrides


@pytest.mark.slow
@pytest.mark.long  # ~20 s on 2 cores each: `make test-long`
@pytest.mark.timeout(240)
@pytest.mark.parametrize("shard", ["reassign", "take_over"])
def test_cli_reassigns_the_shard_of_an_excluded_attacker(tmp_path, shard):
    """From the command line: the free rider is excluded at round 1 (its second bad round, on
    probation: `sync.probation_rounds`) and rank 0 says that its
    shard (and under take_over its batch) goes to the others from the next step; the run
    trains on and ends."""
    attack = "{_target_:localsgd.loop.attacks.Attack,kind:'zeros',rank:1}"
    args = [
        *FAST,
        "dist.world_size=4",
        "trainer.max_steps=60",
        "sync.period=10",
        "sync.score=true",
        f"sync.excluded_shard={shard}",
        f"trainer.callbacks=[{attack}]",
        f"hydra.run.dir={tmp_path}",
    ]
    proc, left = cli(args)
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trust"]["excluded"] == {"1": 1}
    if shard == "reassign":
        assert "trust: worker(s) 1's shard is split among workers 0, 2, 3 from step 11" in said
    else:
        batch = compose_config(FAST).trainer.batch_size
        assert (
            f"trust: worker(s) 1's shard and batch are split among workers 0, 2, 3 "
            f"(batches of {batch + (batch + 2) // 3}, "
        ) in said, said[-3000:]


@pytest.mark.slow
@pytest.mark.long  # three jobs, ~15 s on 2 cores: `make test-long`
@pytest.mark.timeout(300)
def test_a_run_killed_after_the_batch_was_taken_over_resumes_bit_identical(tmp_path):
    """`take_over` from the command line, killed after the exclusion (round 2, step 20: the
    batches grow from step 21) and resumed from its checkpoint at step 30: the sampler's state
    carries the indices and the batch taken over, so the model and every logged step equal an
    uninterrupted run's."""
    attack = "{_target_:localsgd.loop.attacks.Attack,kind:'zeros',rank:1}"
    once = tmp_path / "killed-once"
    kill = f"{{_target_:tests.faults.Fault,spec:'kill:2:35:{once}'}}"
    args = [
        *FAST,
        "dist.world_size=4",
        "trainer.max_steps=50",
        "sync.period=10",
        "sync.score=true",
        "sync.excluded_shard=take_over",
        "trainer.checkpoint_every=30",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc, left = cli([*args, f"trainer.callbacks=[{attack}]", f"hydra.run.dir={ref}"])
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    assert "shard and batch are split among workers 0, 2, 3" in proc.stdout + proc.stderr
    killed = [*args, f"trainer.callbacks=[{attack},{kill}]", f"hydra.run.dir={run}"]
    proc, left = cli(killed)
    assert proc.returncode != 0 and "worker rank 2 died" in proc.stderr, proc.stderr[-2000:]
    proc, left = cli(killed)  # the marker file keeps the kill from firing again
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    assert "resuming from" in proc.stderr and "step-30" in proc.stderr
    assert same_model(run / "model.pt", ref / "model.pt")

    # drift, the workers' distance from the average, counts the excluded attacker's model too,
    # which depends on the attack's in-memory anchor (localsgd.loop.attacks: not checkpointed)
    def records(run_dir):
        return [{k: v for k, v in r.items() if k != "drift"} for r in train_records(run_dir)]

    assert records(run) == records(ref) and len(records(ref)) == 3  # steps 25, 50, the test
