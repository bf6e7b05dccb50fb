"""`python -m localsgd.plan`: bad input refused in one line before any worker starts; on a tiny
job it times the workers, prints the table and a setting, and the setting it prints runs and
sends the bytes it predicted."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import tempfile

import pytest

from localsgd.cli.forkserver import start_method
from localsgd.planner.cli import main
from localsgd.planner.grid import BY_KEY
from localsgd.planner.model import sync_steps
from localsgd.planner.sizes import ModelShape
from tests.helpers import ROOT, _comm, _lingering, _set_comm, cli, tagged_env

TINY = [
    "data=synthetic",
    "data.num_samples=400",
    "model=mlp",
    "model.hidden=[16]",
    "dist.world_size=2",
    "trainer.max_steps=32",
    "trainer.batch_size=8",
    "trainer.eval_every=1000",
    "trainer.log_every=32",
    "trainer.progress=false",
    "trainer.checkpoint_every=0",
    "dist.timeout_s=60",
    "logger.wandb.mode=disabled",
    "logger.plots=false",
]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--target-utilisation", "1.5"], "--target-utilisation must be in (0, 1], got 1.5"),
        (["--bandwidth-gbps", "0"], "--bandwidth-gbps must be > 0, got 0"),
        (["--latency-ms", "-1"], "--latency-ms must be >= 0, got -1"),
        (["--probe-link", "--latency-ms", "5"], "--probe-link measures the link"),
        (["--steps", "1"], "--steps must be >= 2"),
        (["--bandwith-gbps", "1"], "unknown option --bandwith-gbps"),
        (["sync.peroid=4"], "sync.peroid"),
        (["dist.virtual_workers=2", "dist.world_size=2"], "dist.virtual_workers: the plan"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main([*TINY, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def _plan_command(argv, env, out, err, comm) -> None:
    """What `python -m localsgd.plan ARGV` does, in a child of the session's forkserver."""
    _set_comm(comm)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def plan(argv: list[str], timeout: float = 120) -> tuple[int, str, str]:
    env, tag = tagged_env()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = multiprocessing.get_context(start_method()).Process(
            target=_plan_command, args=(argv, env, out, err, _comm(tag))
        )
        child.start()
        child.join(timeout)
        assert child.exitcode is not None, "the plan hung"
        with open(out) as o, open(err) as e:
            result = child.exitcode, o.read(), e.read()
    assert not _lingering(tag)
    return result


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_plan_prints_a_table_and_a_setting_that_runs(tmp_path):
    report = tmp_path / "plan.json"
    link = ["--bandwidth-gbps", "1", "--latency-ms", "1", "--target-utilisation", "0.5"]
    code, out, err = plan([*TINY, *link, "--steps", "6", "--like", "lm", "--json", str(report)])
    assert code == 0, err[-3000:]
    assert "plan: timing your job's steps" in err  # the progress bar
    assert "| DiLoCo H=16, 4-bit |" in out and "| DDP-like (gradients every step) |" in out
    # an MLP of one hidden layer has 2 blocks: no 4 fragments
    assert "| Streaming DiLoCo H=16 P=4 τ=1 α=0.5 | - | - | - | cannot run:" in out
    plan_json = json.loads(report.read_text())
    chosen = BY_KEY[plan_json["chosen"]]
    assert plan_json["meets_target"] and f"chosen: {chosen.label}:" in out
    assert chosen.key == "diloco-h16-int4"  # the fewest bytes the studies back on the LM
    command = out.split("command: python -m localsgd.train ", 1)[1].splitlines()[0].split()
    assert command == plan_json["command"] and command[: len(TINY)] == TINY
    # the command runs (here on a 30 ms simulated link), and its loop sends what the plan
    # predicted, byte for byte
    run_dir, clock = tmp_path / "run", tmp_path / "clock"
    callback = f"trainer.callbacks=[{{_target_:localsgd.planner.measure.StepClock,out:'{clock}'}}]"
    proc, left = cli(
        [
            *command,
            "logger=jsonl",
            "comm.simulate.latency_ms=30",
            callback,
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in lines if "loss" in r][-1]
    schedule = chosen.schedule(ModelShape.from_dict(plan_json["workers"][0]["shape"]))
    syncs = sync_steps(schedule, 32)
    assert last["comm_bytes"] == sum(schedule.fragment_bytes[p] for p, _, _ in syncs)
    # compute_seconds leaves the link's time out: at least 30 ms a sync is not compute
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["compute_seconds"] <= summary["wall_time_s"] - 0.03 * len(syncs)
    assert 0 < last["compute_seconds"] <= last["wall_time_s"] - 0.03 * len(syncs)
    # StepClock: each rank's compute and loop seconds after the last step
    ranks = [json.loads((clock / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["compute_s"] == pytest.approx(summary["compute_seconds"], abs=1e-3)
    assert all(r["steps"] == 32 and len(r["compute_trace"]) == 32 for r in ranks)
    assert all(r["compute_s"] < r["wall_s"] - 0.03 * len(syncs) for r in ranks)
