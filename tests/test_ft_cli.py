"""`ft=torchft` from the command line: the job outlives a dead worker.

Each worker is a replica group of one process; the command starts the lighthouse itself (on
127.0.0.1). Without a fault the run is bit-identical to the torch.distributed path; a worker
SIGKILLed between syncs is restarted and heals from a live peer (participants 3 -> 2 -> 3); a
worker with no restart left is lost for good and the others finish; bad setups get one line.
"""

from __future__ import annotations

import json
import re

import pytest

from localsgd.loop import checkpoint
from tests import faults
from tests.helpers import (
    FT_JOB,
    cli,
    refusal,
    same_model,
    survivors,
    tagged_env,
    torchrun_machine,
)

pytest.importorskip("torchft")

FT = FT_JOB


STREAMING = [  # Streaming DiLoCo, 2 fragments, 4-bit pseudo-gradients with error feedback
    "sync.outer=diloco",
    "optim=adamw",
    "optim.lr=0.003",
    "model.hidden=[64,64]",
    "sync.fragments=2",
    "sync.comm_dtype=int4",
    "sync.error_feedback=true",
]


SPARSELOCO = [  # top-k 2-bit pseudo-gradients with error feedback, all-gathered through torchft
    "sync=sparseloco",
    "sync.topk_chunk=256",
    "optim=adamw",
    "optim.lr=0.003",
    "model.hidden=[64,64]",
]


def _participants(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["participants"] for r in map(json.loads, lines) if "participants" in r]


def _drifts(run_dir) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["drift"]) for r in map(json.loads, lines) if "drift" in r]


def _collapse(seq: list[int]) -> list[int]:
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy",
    [
        [],
        # DiLoCo's anchor and outer momentum: Streaming DiLoCo's below has both, per fragment
        pytest.param(
            ["sync.outer=diloco", "optim=adamw", "optim.lr=0.003"], marks=pytest.mark.long
        ),
        [*STREAMING, "sync.delay_steps=1"],
        pytest.param([*STREAMING, "sync.eager=true"], marks=pytest.mark.long),
        pytest.param(SPARSELOCO, marks=pytest.mark.long),
        pytest.param(
            [*SPARSELOCO, "sync.fragments=2", "sync.delay_steps=1"], marks=pytest.mark.long
        ),  # fmt: skip
    ],
)
def test_no_fault_is_bit_identical_to_the_plain_path(tmp_path, strategy):
    """The same job through torch.distributed and through torchft's Manager: one quorum per
    sync, the same sums in the same order, the same model to the last bit (post-local SGD,
    DiLoCo with its anchor and outer momentum, and Streaming DiLoCo whose 4-bit messages are
    all-gathered through the Manager's process group, launched at a fragment's sync and merged
    a step later: a round from the launch to the merge; and eager, whose exchange completes
    inside its round and is used at the next)."""
    plain, ft = tmp_path / "plain", tmp_path / "ft"
    check = [] if "sync.delay_steps=1" in strategy else ["sync.check_replicas=true"]
    for run_dir, extra in ((plain, check), (ft, ["ft=torchft", *check])):
        proc, left = cli(FT + strategy + extra + [f"hydra.run.dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not left
        if "ft=torchft" in extra:  # the NaN guard does not reach torchft's all-reduce: said
            said = "the full-precision mean across replica groups is torchft's all-reduce"
            gathered = any("int4" in o or "sparseloco" in o for o in strategy)
            assert (said in proc.stderr) is not gathered
    assert same_model(plain / "model.pt", ft / "model.pt")
    # the replicas' drift, measured through the Manager's rounds: the same figures as the plain
    # path's (the same models, the mean of the same distances); not at a delayed merge, which
    # follows its round's commit
    drifts = {run: _drifts(run) for run in (plain, ft)}
    assert len(drifts[plain]) > 5 and all(0 < d < float("inf") for _, d in drifts[plain])
    if "sync.delay_steps=1" in strategy:
        assert drifts[ft] == []
    else:
        assert [s for s, _ in drifts[ft]] == [s for s, _ in drifts[plain]]
        assert [d for _, d in drifts[ft]] == pytest.approx([d for _, d in drifts[plain]], rel=1e-5)
    summary = json.loads((ft / "summary.json").read_text())
    if check:  # every sync checked, through torchft as on the plain path (eager: each merge)
        plain_summary = json.loads((plain / "summary.json").read_text())
        assert summary["replica_checks"] == plain_summary["replica_checks"] > 0
    assert summary["participants"] == summary["participants_min"] == 3
    assert summary["heals"] == summary["failed_syncs"] == 0
    assert set(_participants(ft)) == {3}
    # every sample of every worker reached a committed global state (the final average too)
    assert summary["merged_samples"] == 60 * 16 * 3


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy, victim",
    [
        ([], 0),
        pytest.param(
            ["sync.outer=diloco", "optim=adamw", "optim.lr=0.003"], 1, marks=pytest.mark.long
        ),  # the Streaming heal below covers its state
        ([*STREAMING, "sync.merge_alpha=0.5"], 1),
        pytest.param(SPARSELOCO, 1, marks=pytest.mark.long),
    ],
)
def test_a_killed_worker_is_restarted_and_heals_from_a_live_peer(tmp_path, strategy, victim):
    """A worker SIGKILLed at step 30 (between syncs): the next syncs go ahead with 2, it is
    restarted, heals from a live peer (model, optimizer, DiLoCo's anchor and outer momentum,
    Streaming DiLoCo's anchors and outer states, sampler position, loop state) and the job ends
    with 3, every sync checked bit-identical across the replica groups in what they share (the
    anchors too). Worker 0 is no exception: healed, it logs and writes the summary with the
    run's clock (not one started at its heal) and the fewest participants it saw."""
    run_dir = tmp_path / "run"
    once = tmp_path / "killed-once"
    proc, left = cli(
        FT + strategy + ["ft=torchft", "sync.check_replicas=true", f"hydra.run.dir={run_dir}"],
        fault=f"kill:{victim}:30:{once}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert f"ft: worker {victim} died (signal 9); restart 1 of 3" in proc.stderr
    assert _collapse(_participants(run_dir)) == [3, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heals"] == 1 and summary["failed_syncs"] == 0
    assert summary["participants_min"] == 2 and summary["participants"] == 3
    assert summary["steps"] == 60
    # the victim's steps from its last round to its heal never reached the global model
    assert 60 * 16 * 2 < summary["merged_samples"] < 60 * 16 * 3
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    clock = [r["wall_time_s"] for r in map(json.loads, lines) if "wall_time_s" in r]
    assert clock == sorted(clock) and summary["wall_time_s"] >= clock[-1], clock
    # the replicas' drift, measured through the Manager's rounds, on every line that follows an
    # average, before the kill and after (worker 0 healed: from its heal on)
    records = [json.loads(line) for line in lines]
    averaged = [r["step"] for r in records if "samples_per_s" in r and r["step"] >= 8]
    drifts = _drifts(run_dir)
    assert [step for step, _ in drifts] == averaged and averaged[-1] == 60
    assert all(0 < d < float("inf") for _, d in drifts), drifts


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [pytest.param(2, marks=pytest.mark.long), 0])
def test_a_worker_lost_for_good_leaves_the_others_to_finish(tmp_path, victim):
    """With no restart left, the others finish. Worker 0 is no exception: its metrics lines
    stop with it, and the first live worker writes the final evaluation, model and summary."""
    run_dir = tmp_path / "run"
    proc, left = cli(
        FT + ["ft=torchft", "ft.max_restarts=0", "ft.min_replicas=2", f"hydra.run.dir={run_dir}"],
        fault=f"kill:{victim}:30",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert f"ft: worker {victim} died (signal 9) with no restart left; lost for good" in proc.stderr
    assert _collapse(_participants(run_dir)) == ([3, 2] if victim else [3])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["participants"] == 2 and summary["heals"] == 0
    assert summary["steps"] == 60 and (run_dir / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.long  # the killed workers above are named in one line too
@pytest.mark.timeout(120)
def test_a_killed_peer_is_one_line_of_its_own_without_torchft_tracebacks(tmp_path):
    """Worker 1 SIGKILLed at step 33 with a delayed round (sync.delay_steps=1): the survivors'
    next collective still has it as a peer, and gloo's read fails (checked here: every time).
    torchft logged that as a traceback ending in gloo's `GLHF! 🏖️` per survivor, which looked
    like a crash; the launcher's line says what happened, on a line of its own under the
    progress bar (not glued to its end), and also in the run's train.log."""
    run_dir = tmp_path / "run"
    once = tmp_path / "killed-once"
    proc, left = cli(
        FT
        + ["ft=torchft", "sync.delay_steps=1", "trainer.progress=true"]
        + [f"hydra.run.dir={run_dir}"],
        fault=f"kill:1:33:{once}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert "GLHF" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    died = "ft: worker 1 died (signal 9); restart 1 of 3"
    assert any(line.startswith(died) for line in proc.stderr.splitlines()), proc.stderr[-2000:]
    assert f"[NOTICE] - {died}" in (run_dir / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_below_min_replicas_the_job_stops_with_a_checkpoint_and_resumes_at_another_size(tmp_path):
    """3 workers, ft.min_replicas=3, checkpoints every 8 steps. Worker 2 is lost for good at
    step 30: the next sync finds no quorum for ft.quorum_timeout_s, is rolled back, and the
    survivors stop with one line naming the checkpoint of the last global state (one shared
    state). The same run then continues from it with 2 workers (torchft's again, with
    ft.min_replicas=2: the ft settings may change on resume)."""
    run_dir = tmp_path / "run"
    base = [a for a in FT if not a.startswith("trainer.checkpoint_every")] + [
        "trainer.checkpoint_every=8",
        "trainer.keep_checkpoints=3",
        f"hydra.run.dir={run_dir}",
    ]
    ft = ["ft=torchft", "ft.max_restarts=0", "ft.min_replicas=3", "ft.quorum_timeout_s=3"]
    proc, left = cli(base + ft, fault="kill:2:30")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not left
    stop = checkpoint.step_dir(str(run_dir), 33)  # the sync after step 30
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ft: fewer than ft.min_replicas=3 replica groups for "), last
    assert f"stopped with the last global state in {stop}: run the same command" in last
    assert checkpoint.listed_steps(str(run_dir)) == [33, 25, 17]  # the first sync past 8k
    for step in (33, 25, 17):
        marker = checkpoint.verify(checkpoint.step_dir(str(run_dir), step))
        assert marker["shared"] and list(marker["files"]) == ["rank-0.pt"]
    assert not (run_dir / "summary.json").exists()

    proc, left = cli(base + ["ft=torchft", "ft.min_replicas=2", "dist.world_size=2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert f"resuming from {stop}" in proc.stderr
    assert "resuming at another world size: 3 workers' averaged model" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["world_size"] == 2
    assert summary["participants"] == summary["participants_min"] == 2


@pytest.mark.parametrize(
    "override,key",
    [
        ("ft.min_replicas=4", "ft.min_replicas"),  # more than dist.world_size=3
        ("ft.min_replicas=0", "ft.min_replicas"),
        ("ft.max_restarts=-1", "ft.max_restarts"),
        ("ft.timeout_s=0", "ft.timeout_s"),
        ("ft.grace_s=0", "ft.grace_s"),
        ("ft.grace_s=31", "ft.grace_s"),  # above ft.timeout_s=30
        ("ft.grace_factor=0.5", "ft.grace_factor"),
        ("ft.grace_min_s=0", "ft.grace_min_s"),
        ("ft.heartbeat_timeout_s=0", "ft.heartbeat_timeout_s"),
        ("ft.join_timeout_s=-1", "ft.join_timeout_s"),
        ("ft.stall_s=0", "ft.stall_s"),
        ("ft.heartbeat_timeout_s=4", "ft.grace_min_s"),  # above the adaptive window's floor (3)
        ("ft.retry_failed_sync=true sync.fragments=2 sync.outer=diloco", "ft.retry_failed_sync"),
        ("ft.replica_id=a", "ft.replica_id"),
        (
            "sync.levels=[{group_size:1,period:2},{group_size:world,period:4}]",
            "ft=torchft with sync.levels on one machine",
        ),
        ("sync.delay_steps=1 sync.fragments=4", "sync.delay_steps"),  # 4/4 = 1 step apart
        ("ft.lighthouse=127.0.0.1:1", "ft.lighthouse"),  # nothing listens on port 1
        ("ft.lighthouse=nohost", "ft.lighthouse"),
    ],
)
def test_bad_ft_settings_are_refused_in_one_line(override, key, capsys):
    line = refusal(FT + ["ft=torchft", *override.split()], capsys)
    assert line.startswith(f"error: {key}"), line


@pytest.mark.timeout(20)
def test_a_lighthouse_address_where_something_else_listens_is_refused_in_one_line(capsys):
    """It used to pass the check (a TCP connection was enough), then every worker waited
    ft.quorum_timeout_s and said only `no quorum: TimeoutError`. A plain HTTP server and a
    listener that never answers are refused at once, naming what answered; a lighthouse passes."""
    import http.server
    import socket
    import threading
    import time

    from localsgd.averaging.torchft import start_lighthouse
    from localsgd.cli.fault_tolerance import check_reachable

    class Page(http.server.BaseHTTPRequestHandler):  # e.g. TensorBoard left on that port
        def do_GET(self):
            body = b"<html><title>Some dashboard</title></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # not on the refusal's stderr
            pass

    web = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    server, address = start_lighthouse(1, join_timeout_ms=1000)
    try:
        port = web.server_address[1]
        line = refusal(FT + ["ft=torchft", f"ft.lighthouse=127.0.0.1:{port}"], capsys)
        assert line.startswith(f"error: ft.lighthouse: 127.0.0.1:{port} is not a torchft "), line
        assert "answered GET / with 200 OK, BaseHTTP/" in line, line
        assert "titled 'Some dashboard'" in line, line

        port = silent.getsockname()[1]
        begun = time.monotonic()
        line = refusal(
            FT + ["ft=torchft", "ft.timeout_s=1", f"ft.lighthouse=127.0.0.1:{port}"], capsys
        )
        assert time.monotonic() - begun < 5
        assert line.startswith(f"error: ft.lighthouse: 127.0.0.1:{port} is not a torchft "), line
        assert "accepts connections but sent no answer in 1 s" in line, line

        check_reachable(address, 2.0)  # no ConfigError
        check_reachable(address.removeprefix("http://"), 2.0)
    finally:
        web.shutdown()
        web.server_close()
        silent.close()
        server.shutdown()


def test_a_missing_torchft_is_refused_in_one_line(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    line = refusal(FT + ["ft=torchft"], capsys)
    assert "pip install torchft==0.2.0" in line


@pytest.mark.long  # ~45 s: tests/test_sharded_ft.py runs two loopback machines in make test
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_machines_each_a_replica_group_of_two_one_killed_and_restarted(tmp_path):
    """Several machines on loopback: a lighthouse, and per machine `torchrun --nproc-per-node=2
    ... ft=torchft ft.replica_id=group_I ft.replica_groups=2`, with hierarchical levels: each
    machine's two ranks average among themselves every 2 steps (torch.distributed), and every 4
    steps with the other machine too (torchft). Rank 2 (group 1's first) is
    SIGKILLed at step 10; torchrun restarts group 1, whose ranks heal from group 0 and train on."""
    from localsgd.averaging.torchft import start_lighthouse

    server, address = start_lighthouse(1, heartbeat_timeout_ms=1000, quorum_tick_ms=20)
    once = tmp_path / "killed-once"
    env, tag = tagged_env({"RUST_LOG": "warn"})
    try:
        groups = []
        for index in range(2):
            args = FT + [
                "ft=torchft",
                f"ft.lighthouse={address.removeprefix('http://')}",
                f"ft.replica_id=group_{index}",
                "ft.replica_groups=2",
                "ft.timeout_s=10",
                "sync.check_replicas=true",
                "dist.world_size=null",
                # hierarchical: each machine's pair every 2 steps (torch.distributed), both
                # machines every 4 (torchft), as torchft #171 asks
                "sync.levels=[{group_size:node,period:2},{group_size:world,period:4}]",
                # a slow link keeps group 0 training while torchrun restarts group 1
                "trainer.max_steps=200",
                "comm.simulate.latency_ms=250",
                f"hydra.run.dir={tmp_path / f'group_{index}'}",
                faults.override(f"kill:2:10:{once}"),
            ]
            groups.append(torchrun_machine(args, env))
        outputs = [g.communicate(timeout=200)[0] for g in groups]
    finally:
        for g in groups:
            g.kill()
        server.shutdown()
    assert [g.returncode for g in groups] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "ft: worker 2 healed from a live peer" in outputs[1], outputs[1][-3000:]
    run_dir = tmp_path / "group_0"  # global rank 0 writes the results
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 200
    assert summary["heals"] >= 1 and summary["participants"] == 2
    assert not (tmp_path / "group_1" / "summary.json").exists()
    inner, widest = summary["comm_levels"]
    assert inner["group_size"] == 2 and inner["rounds"] > 0  # inside the machine
    assert widest["group_size"] == 4 and widest["rounds"] > 0  # both machines, through torchft
    # the drift around the averages across the machines: summed inside each machine's pair,
    # then across the groups through the Manager
    drifts = _drifts(run_dir)
    assert len(drifts) > 20 and all(d > 0 for _, d in drifts), drifts
    assert not survivors(tag)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_under_ft_stops_every_worker_at_an_agreed_round_with_a_checkpoint(tmp_path):
    """SIGTERM reaches the supervisor (as from SLURM; here sent by worker 1 at step 20): every
    worker stops after the same round, which carried the request to every replica group, and
    the job exits 143 with a shared checkpoint (Streaming DiLoCo's workers, never all in sync,
    first take one blocking average). The same command resumes from it and finishes."""
    run_dir = tmp_path / "run"
    # Streaming DiLoCo (never all in sync: the stop takes one blocking average first); the
    # post-local path is the same round protocol with a checkpoint at once
    args = FT + STREAMING + ["ft=torchft", f"hydra.run.dir={run_dir}"]
    proc, left = cli(args, fault=f"sigterm:1:20:{tmp_path / 'once'}")
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert not left
    stopped = int(re.search(r"stopped after step (\d+) with a checkpoint", proc.stderr).group(1))
    assert 20 < stopped < 60
    assert checkpoint.verify(str(run_dir / "checkpoints" / f"step-{stopped}"))["shared"]
    assert not (run_dir / "summary.json").exists()
    resumed, left = cli(args)
    assert resumed.returncode == 0 and not left, resumed.stderr[-2000:]
    assert re.search(rf"resuming from \S*step-{stopped}\b", resumed.stderr), resumed.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 60


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_streaming_diloco_under_ft_checkpoints_its_global_state(tmp_path):
    """Streaming DiLoCo's workers are never all in sync, but every one holds the same anchors
    (the global model as of each fragment's last sync): a shared checkpoint of those, taken
    after a committed round, is what a run resumes from, losing only local progress."""
    import torch

    run_dir = tmp_path / "run"
    args = FT + STREAMING + ["ft=torchft", "trainer.checkpoint_every=20"]
    proc, left = cli(args + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    folders = sorted((run_dir / "checkpoints").glob("step-*"))
    mid = [f for f in folders if int(f.name.split("-")[1]) < 60]
    assert mid, folders
    assert checkpoint.verify(str(mid[0]))["shared"]
    state = torch.load(mid[0] / "rank-0.pt", weights_only=False)
    model = torch.cat([t.flatten() for t in state["model"].values()])
    anchors = torch.cat([a.flatten() for a in state["averager"]["rounds"]["anchors"]])
    assert torch.equal(model.sort().values, anchors.sort().values)  # the model is the anchors
    assert state["loop"]["in_sync"]
    # every worker's own error-feedback residual beside it, each its own
    step = mid[0].name.split("-")[1]
    own = [torch.load(run_dir / "checkpoints" / "own" / f"step-{step}" / f"rank-{r}.pt")
           for r in range(3)]  # fmt: skip

    def flat(tree):
        if isinstance(tree, torch.Tensor):
            return [tree.flatten()]
        return [t for item in tree or [] for t in flat(item)]

    first = [torch.cat(flat(o["residuals"])) for o in own]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    resumed, left = cli(args + [f"hydra.run.dir={tmp_path / 'again'}", f"trainer.resume={mid[0]}"])
    assert resumed.returncode == 0 and not left, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["steps"] == 60
