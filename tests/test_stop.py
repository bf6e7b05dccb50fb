"""The agreed stop's protocol (`localsgd.loop.stop.StopAgreement`), in-process over one store:
every rank stops after the same sync step, wherever the signal finds each one."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from localsgd.loop import stop

pytestmark = pytest.mark.timeout(30)


def _overlap_schedule(pending_at: int | None):
    """next_sync as an overlapped average (period 4, launches after 6, 10, 14, merges one step
    later) answers it on a rank whose average launched after `pending_at - 1` is in flight."""

    def next_sync(step: int) -> int | None:
        if step == pending_at:
            return step  # this step merges the average in flight
        launch = 6 + -(-(max(step, 6) - 6) // 4) * 4
        return launch + 1 if launch + 1 < 24 else None

    return next_sync


@pytest.fixture
def signalled(monkeypatch):
    monkeypatch.setattr(stop, "_signalled", True)


def test_under_overlap_a_rank_that_passed_the_merge_still_stops_with_the_proposer(signalled):
    """The failure of issue 49: rank 1 has merged the average launched after step 6 (its check
    after step 7 done) when rank 0, signalled before step 7, proposes; a stop after step 7 would
    stop rank 0 there and rank 1 a sync later. Both must stop after the same step."""
    store = dist.HashStore()
    rank0 = stop.StopAgreement(store, "run", cleans=True)
    rank1 = stop.StopAgreement(store, "run", cleans=False)
    rank1.after_sync(7)  # rank 1 merged after step 7, before any signal was seen
    rank0.before_step(7, _overlap_schedule(pending_at=7))
    rank0.after_sync(7)
    rank1.before_step(9, _overlap_schedule(pending_at=None))
    stops = {}
    for name, agreement, syncs in (("rank0", rank0, (11,)), ("rank1", rank1, (11,))):
        for step in range(8, 24):
            if step - 1 in syncs:
                agreement.after_sync(step - 1)
            if agreement.should_stop(step):
                stops[name] = step
                break
    assert stops == {"rank0": 12, "rank1": 12}


def test_a_rank_that_never_saw_the_signal_learns_the_stop_at_the_sync(signalled):
    store = dist.HashStore()
    proposer = stop.StopAgreement(store, "run")
    other = stop.StopAgreement(store, "run")
    proposer.before_step(3, lambda s: 5 if s <= 5 else 9)
    for agreement in (proposer, other):
        agreement.after_sync(5)
    assert proposer.stop_at == other.stop_at == 6


def test_without_a_signal_nothing_stops_and_old_keys_are_deleted():
    store = dist.HashStore()
    agreement = stop.StopAgreement(store, "run", cleans=True)
    for step in range(100):
        agreement.after_sync(step)
        assert not agreement.should_stop(step + 1)
    assert store.num_keys() <= stop._KEEP_KEYS


def test_a_forwarded_ctrl_c_is_named_ctrl_c_by_the_workers(monkeypatch):
    """The launcher forwards a first Ctrl-C to its workers as SIGTERM (they ignore SIGINT); the
    store tells them what it was, so their stop line does not say SIGTERM."""
    import signal

    monkeypatch.setattr(stop, "_first_signal", signal.SIGTERM)  # what the worker itself got
    store = dist.HashStore()
    assert stop.StopAgreement(store, "run").reason() == "SIGTERM"
    stop.announce(store, signal.SIGINT)
    assert stop.StopAgreement(store, "run").reason() == "Ctrl-C"
