"""The training loop's communication: when it talks, what it sends, and what replicas look like."""

from __future__ import annotations

import math
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import SMALL, CollectiveCounter, compose_config, run_distributed

pytestmark = pytest.mark.slow


def _replicas_identical(trainer: Trainer) -> bool:
    """Checksum-free exact check: every rank's full flat buffer gathered and compared bytewise."""
    flat = torch.cat([b.reshape(-1) for b in trainer.sync.averager.flat.buffers])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _schedule_worker(rank, world_size, cfg):
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            cfg, WorkerInfo(rank, world_size, rank, world_size), torch.device("cpu"), run_dir
        )
        per_step, identical = [], []
        for step in range(cfg.trainer.max_steps):
            with CollectiveCounter() as counter:
                trainer.train_step(step)
            per_step.append(counter.count)
            identical.append(_replicas_identical(trainer))  # outside the counted region
        return {
            "per_step": per_step,
            "identical": identical,
            "rounds": trainer.comm_stats.rounds,
            "bytes": trainer.comm_stats.bytes,
            "numel": trainer.sync.averager.flat.numel,
        }


@pytest.mark.timeout(120)
# drift None: the default, measured wherever there is a mean (as true)
@pytest.mark.parametrize("period,warmup,drift", [(4, 5, None), (3, 0, False)])
def test_collectives_only_at_syncs_and_replicas_identical_after_each(period, warmup, drift):
    steps = 23
    cfg = compose_config(
        SMALL
        + [
            f"sync.period={period}",
            f"sync.warmup_steps={warmup}",
            f"trainer.max_steps={steps}",
            f"trainer.track_drift={'null' if drift is None else drift}",
        ]
    )
    results = run_distributed(_schedule_worker, 4, cfg)
    warm = [s < warmup for s in range(steps)]
    avg = [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    for r in results:
        # one flat buffer each: one all-reduce per warmup step, one per average (plus the drift
        # meter's scalar one when it is on), none otherwise
        measured = drift is not False
        expected = [int(w) + (1 + measured) * int(a) for w, a in zip(warm, avg, strict=True)]
        assert r["per_step"] == expected
        assert r["identical"] == [w or a for w, a in zip(warm, avg, strict=True)]
        assert r["rounds"] == warmup + math.ceil((steps - warmup) / period)
        assert r["bytes"] == 4 * r["numel"] * r["rounds"]


_EVAL_DELAY_S = 0.3


def _slow_evaluation_worker(rank, world_size, cfg):
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            cfg, WorkerInfo(rank, world_size, rank, world_size), torch.device("cpu"), run_dir
        )
        evaluate = trainer.evaluate

        def slow(full: bool = False, split: str | None = None):
            if not full:  # only the periodic ones: the final evaluation is outside the timing
                time.sleep(_EVAL_DELAY_S)
            return evaluate(full, split)

        trainer.evaluate = slow
        return trainer.train()


@pytest.mark.timeout(120)
def test_eval_seconds_counts_the_periodic_evaluations_inside_wall_time():
    cfg = compose_config(
        SMALL
        + ["sync.period=2", "trainer.max_steps=12", "trainer.eval_every=4"]
        + ["logger.wandb.mode=disabled", "trainer.checkpoint_every=0"]
    )
    summary = run_distributed(_slow_evaluation_worker, 2, cfg)[0]
    evaluations = 2  # after steps 4 and 8; the one at the last step is the final evaluation
    assert evaluations * _EVAL_DELAY_S <= summary["eval_seconds"] < summary["wall_time_s"]
    assert summary["eval_seconds"] < evaluations * _EVAL_DELAY_S + 1.0
