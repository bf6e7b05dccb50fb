"""Averaging through torchft's Manager (localsgd.averaging.torchft): a replica killed
between syncs is dropped and, once
restarted, heals from a live peer; a replica killed inside the all-reduce makes the round roll
back on the survivors, never leaving a half-average.

Three single-process replica groups on gloo, one in-process lighthouse, all on 127.0.0.1. That
no fault equals the torch.distributed path bit for bit (periodic averaging and DiLoCo) is
tests/test_ft_cli.py's, through the command line.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from localsgd.cli.forkserver import start_method

pytest.importorskip("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

W = 3
PERIOD = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * index + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _averager(kind: str, model: torch.nn.Module):
    from localsgd.averaging import OuterAverager, PeriodicAverager, StreamingAverager

    if kind == "outer":
        return OuterAverager(PERIOD, module=model)
    # fragment 0 launches after steps 0, 4, 8, 12; fragment 1 after 2, 6, 10
    if kind.startswith("streaming"):
        delay = 1 if kind == "streaming_delayed" else 0  # merged one step after the launch
        return StreamingAverager(
            PERIOD, module=model, fragments=2, merge_alpha=0.5, delay_steps=delay
        )
    return PeriodicAverager(PERIOD, module=model)


def _replica(cfg: dict) -> None:
    """One worker, a replica group of one process. Writes what it saw to `out/INDEX.pt`."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    faulthandler.dump_traceback_later(80, exit=True)  # a hung worker says where, then dies
    torch.set_num_threads(1)
    index, steps = cfg["index"], cfg["steps"]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: dict = {"participants": {}, "after": {}, "before": {}, "post": {}, "drift": {}}
    from localsgd.averaging.torchft import (
        FaultTolerantRounds,
        TorchftCommunicator,
        make_manager,
    )

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    av = _averager(cfg["kind"], model)
    manager = make_manager(
        replica_id=f"replica_{index:02d}",
        lighthouse=cfg["lighthouse"],
        min_replicas=1,
        timeout_s=cfg.get("timeout_s", 10.0),
    )
    comm = TorchftCommunicator(manager, replicas=W)
    ft = FaultTolerantRounds(av, comm)
    ft.register_state("model", model.state_dict, model.load_state_dict)
    ft.register_state("optimizer", opt.state_dict, opt.load_state_dict)
    meter = None
    if cfg["kind"] == "periodic":  # the replicas' drift, measured through the rounds
        from localsgd.loop.drift import RoundDriftMeter

        meter = RoundDriftMeter(av.flat.buffers, comm)
        av.global_hooks.append(meter)
        ft.round_ended.append(meter.round_ended)
    if cfg.get("fail_at") is not None and index == cfg["victim"]:
        real_mean, real_launch = comm.mean_, comm.launch_mean_

        def mean_(flat, through=None):
            if av.step == cfg["fail_at"]:
                os.kill(os.getpid(), signal.SIGKILL)  # inside the round, mid all-reduces
            real_mean(flat, through)

        def launch_mean_(pieces, through=None):
            if av.step == cfg["fail_at"]:
                os.kill(os.getpid(), signal.SIGKILL)  # the round opened, nothing sent yet
            return real_launch(pieces, through)

        comm.mean_, comm.launch_mean_ = mean_, launch_mean_
    if cfg.get("restarted"):
        open(cfg["ready"], "w").close()
    seen["start"] = ft.start(wait_for=1 if cfg.get("restarted") else W)
    if seen["start"] == "sync":
        seen["participants"][av.step - 1] = ft.participants
        seen["after"][av.step - 1] = [b.clone() for b in av.flat.buffers]
    try:
        while av.step < steps:
            step = av.step
            if step == cfg.get("kill_at") and index == cfg.get("victim"):
                os.kill(os.getpid(), signal.SIGKILL)
            if step == cfg.get("hold_at") and cfg.get("ready"):
                deadline = time.monotonic() + 60
                while not os.path.exists(cfg["ready"]) and time.monotonic() < deadline:
                    time.sleep(0.02)
            x, y = _batch(index, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            seen["before"][step] = [b.clone() for b in av.flat.buffers]
            synced = ft.maybe_average() if ft is not None else av.maybe_average()
            seen["post"][step] = [b.clone() for b in av.flat.buffers]
            if meter is not None:
                seen["drift"][step] = meter.take()
            if synced:
                seen["after"][step] = [b.clone() for b in av.flat.buffers]
                if ft is not None:
                    seen["participants"][step] = ft.participants
        if ft is not None:
            seen.update(ft.state_dict())
        seen["flat"] = [b.clone() for b in av.flat.buffers]
        if cfg["kind"].startswith("streaming"):
            seen["anchors"] = [a.clone() for a in av.rounds.anchors.first]
        torch.save(seen, os.path.join(cfg["out"], f"{index}.pt"))
    finally:
        if ft is not None:
            ft.manager.shutdown(wait=False)
        dist.destroy_process_group()


class Job:
    """The worker processes of one test; every one is killed at the end."""

    def __init__(self, tmp_path, **common):
        # forked from the session's preloaded server (torch imported once), as the CLI's workers
        self.ctx = multiprocessing.get_context(start_method())
        self.common = {"out": str(tmp_path), **common}
        self.procs: dict[int, multiprocessing.Process] = {}

    def start(self, index: int, **extra) -> None:
        proc = self.ctx.Process(target=_replica, args=({**self.common, "index": index, **extra},))
        proc.start()
        self.procs[index] = proc

    def wait(self, index: int, timeout: float = 60) -> int:
        self.procs[index].join(timeout)
        assert self.procs[index].exitcode is not None, f"replica {index} hangs"
        return self.procs[index].exitcode

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)


@pytest.fixture
def lighthouse():
    from localsgd.averaging.torchft import start_lighthouse

    server, address = start_lighthouse(1, heartbeat_timeout_ms=1000, quorum_tick_ms=20)
    yield address
    server.shutdown()


def _results(tmp_path, indices) -> dict:
    return {i: torch.load(tmp_path / f"{i}.pt") for i in indices}


def _identical(results: dict) -> None:
    first, *others = results.values()
    for other in others:
        for a, b in zip(first["flat"], other["flat"], strict=True):
            assert torch.equal(a, b)


def test_killed_between_syncs_then_heals(tmp_path, lighthouse):
    """Replica 2 dies at step 6; the sync after step 8 goes ahead with 2; restarted, it heals
    from a live peer (model, optimizer, outer state) at the first sync it reaches (the one
    after step 8 when its process starts fast, else a later one), which counts the 2 live
    replicas; from the next sync on all 3 average, bit-identical."""
    ready = str(tmp_path / "ready")
    job = Job(
        tmp_path,
        kind="outer",
        steps=25,
        lighthouse=lighthouse,
        victim=2,
        kill_at=6,
        hold_at=9,
        ready=ready,
    )
    try:
        for i in range(W):
            job.start(i)
        assert job.wait(2) == -signal.SIGKILL
        job.start(2, kill_at=None, restarted=True)
        for i in range(W):
            assert job.wait(i) == 0
    finally:
        job.kill_all()
    got = _results(tmp_path, range(W))
    _identical(got)
    healed_at = min(got[2]["participants"])  # the round replica 2 healed in
    assert healed_at in (8, 12, 16, 20), got[2]["participants"]
    syncs = range(0, 25, PERIOD)
    want = {s: 3 if s < 8 or s > healed_at else 2 for s in syncs}
    assert got[0]["participants"] == want  # 3 -> 2 -> 3
    assert got[2]["participants"] == {s: want[s] for s in syncs if s >= healed_at}
    assert got[2]["start"] == "sync" and got[2]["heals"] == 1
    assert got[0]["heals"] == 0 and got[0]["failed_syncs"] == 0
    assert got[0]["heals_seen"] == got[2]["heals_seen"] == 1  # every replica counts the heal
    for a, b in zip(got[0]["after"][healed_at], got[2]["after"][healed_at], strict=True):
        assert torch.equal(a, b)


def _killed_inside_the_sync_after_step_8(tmp_path, lighthouse, kind: str) -> dict:
    """3 replicas, 13 steps; replica 2 SIGKILLed inside the sync after step 8. Returns what the
    two survivors saw."""
    job = Job(
        tmp_path,
        kind=kind,
        steps=13,
        lighthouse=lighthouse,
        victim=2,
        fail_at=8,
        timeout_s=5.0,
    )
    try:
        for i in range(W):
            job.start(i)
        assert job.wait(2) == -signal.SIGKILL
        for i in range(2):
            assert job.wait(i) == 0
    finally:
        job.kill_all()
    return _results(tmp_path, range(2))


def test_killed_inside_all_reduce_rolls_back(tmp_path, lighthouse):
    """Replica 2 dies inside the sync after step 8: the survivors' round fails to commit and
    they hold exactly the global weights of the sync after step 4 (no half-average); the sync
    after step 12 commits with 2, and the survivors end identical. The drift is measured at
    every committed sync (at 12 the mean of the two survivors' distances to their average, as
    computed here), and the failed one adds none."""
    got = _killed_inside_the_sync_after_step_8(tmp_path, lighthouse, "periodic")
    _identical(got)
    for r in got.values():
        assert r["failed_syncs"] == 1
        for a, b in zip(r["after"][4], r["after"][8], strict=True):
            assert torch.equal(a, b)  # rolled back to the last global weights
        assert r["participants"][12] == 2
    drifts = {s: d for s, d in got[0]["drift"].items() if d is not None}
    assert sorted(drifts) == [0, 4, 12] and got[1]["drift"] == got[0]["drift"]
    assert all(d > 0 for d in drifts.values())

    def distance(r, step):
        before, after = torch.cat(r["before"][step]), torch.cat(r["after"][step])
        return torch.linalg.vector_norm(before - after).item()

    by_hand = sum(distance(r, 12) for r in got.values()) / 2
    assert drifts[12] == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("kind", ["streaming", "streaming_delayed"])
def test_a_streaming_round_killed_inside_its_all_reduce_is_undone(tmp_path, lighthouse, kind):
    """Streaming DiLoCo (2 fragments, alpha 0.5) through torchft: replica 2 dies inside
    fragment 0's sync after step 8. The survivors' round fails and is undone: they hold exactly
    their state before it (the other fragment keeps its local progress, fragment 0 its anchor
    and outer state); the next syncs commit with 2, and the anchors end identical. With
    tau = 1 the round opens at the launch and fails at the merge a step later, which then
    merges nothing."""
    got = _killed_inside_the_sync_after_step_8(tmp_path, lighthouse, kind)
    for r in got.values():
        assert r["failed_syncs"] == 1
        if kind == "streaming":
            for a, b in zip(r["before"][8], r["after"][8], strict=True):
                assert torch.equal(a, b)  # undone: no half-average, no progress lost
        else:  # the round opened at the launch after step 8 fails at the merge after step 9
            for a, b in zip(r["before"][9], r["post"][9], strict=True):
                assert torch.equal(a, b)  # it merged nothing: the local values stand
        assert r["participants"][10] == r["participants"][12] == 2
    for a, b in zip(got[0]["anchors"], got[1]["anchors"], strict=True):
        assert torch.equal(a, b)


def test_import_does_not_load_torchft():
    """The modules that hold the torchft glue, and the CLI and the trainer that reach it,
    import no torchft module until a run asks for ft=torchft."""
    import subprocess
    import sys

    code = (
        "import sys, localsgd.averaging.torchft, localsgd.loop.fault_tolerance, "
        "localsgd.loop.trainer, localsgd.cli.train, localsgd.cli.fault_tolerance; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchft') == [])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
