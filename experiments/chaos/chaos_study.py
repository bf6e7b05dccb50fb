"""Chaos on `make train`'s job through torchft: a seeded schedule of kills, freezes and
partitions among 4 workers, and the goodput the job keeps against the fault-free run.

The job: MNIST-1D, the CNN, 4 workers, post-local SGD (300 synchronous steps, then k = 16),
3000 steps, `ft=torchft` (every worker a replica group, restarts on). Per seed, side by side in
this one invocation, the fault-free run and the chaos run (same seed, same settings), in three
settings: the job as `make train` runs it (7-12 ms a step here, a sync every 0.1-0.2 s); the
same with the grace window fixed at the adaptive one's floor (`ft.grace_s=3`); and the job with
every step padded to 50 ms (`comm.simulate.step_s`, a compute-heavier job: a sync every 0.8 s).
A fault every ~20 syncs is then one every ~3-5 s of fault-free training in the first two and
every ~16 s in the third.

The schedule (`schedule()`, from the seed, written into the json): a fault every `--every`
syncs on average (gaps drawn uniformly in [0.5, 1.5] x every x 16 steps), each on a worker
drawn from those not hit by the two faults before, of a kind drawn uniformly from

- `kill`: SIGKILL; the launcher restarts it and it heals from a live peer at its next round;
- `freeze`: SIGSTOP inside its next round, SIGCONT 2-6 s later (`tests/faults.py`): the others
  wait one grace window, go on without it, and it heals on waking;
- `partition`: its next round's collectives send nothing for 2-6 s while the process and its
  heartbeats run on (`tests/faults.py`: the data plane cut, the control plane up). Not a cut at
  the network level: that needs firewall rules on the loopback the machine's other jobs share.

Each fault fires at the first step at or after its step that its worker reaches (a worker
still down or frozen then fires it late), once (a marker file survives the restart), and the
marker records the step it fired at.

Goodput: `merged_samples` (summary.json under ft: the samples whose training reached a committed
global state, all workers') per second of training (`wall_time_s - eval_seconds`, the
writer's clock), as a ratio to the fault-free run of the same seed and setting. Loss: the final
test loss against the fault-free run's. Writes experiments/chaos/chaos_study.{md,json,png}.

    python experiments/chaos/chaos_study.py            # 3 seeds x 3 settings x 2 runs, ~30 min
    python experiments/chaos/chaos_study.py --tiny     # smoke test: 1 seed, 900 steps, in /tmp
    python experiments/chaos/chaos_study.py --report   # the .md and .png again from the .json
    # the loss at equal samples: each chaos run of these files against a fault-free run of its
    # seed and setting stopped at the samples the chaos run merged
    python experiments/chaos/chaos_study.py --same-samples chaos_async_mnist1d ... --out NAME
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS, BATCH, PERIOD, WARMUP = 4, 32, 16, 300  # the post_local_sgd preset's
KINDS = ("kill", "freeze", "partition")
SETTINGS = {  # name: overrides
    "make train": [],
    # the window fixed at the adaptive one's floor: what the adaptive growth costs
    "make train, ft.grace_s=3": ["ft.grace_s=3"],
    "steps padded to 50 ms": [
        "comm.simulate.worker_speed=[1,1,1,1]",
        "comm.simulate.step_s=0.05",
    ],
    # the same job with membership that moves in about half a second (added after the runs
    # above): the lighthouse drops a silent worker after 0.5 s (a kill's cost), a quorum waits at
    # most 1 s for a live worker that has not joined (a partition's), and the window's floor
    # follows the heartbeat (a freeze's)
    "50 ms, membership in 0.5 s": [
        "comm.simulate.worker_speed=[1,1,1,1]",
        "comm.simulate.step_s=0.05",
        "ft.heartbeat_timeout_s=0.5",
        "ft.join_timeout_s=1",
        "ft.grace_min_s=0.75",
    ],
    # the retry with the default membership (added after the retried runs below)
    "steps padded to 50 ms, retried": [
        "comm.simulate.worker_speed=[1,1,1,1]",
        "comm.simulate.step_s=0.05",
        "ft.retry_failed_sync=true",
    ],
    # and a failed sync retried at once from the survivors' state before it (added after the
    # membership runs showed most of what was left lost as rolled-back work)
    "50 ms, membership in 0.5 s, retried": [
        "comm.simulate.worker_speed=[1,1,1,1]",
        "comm.simulate.step_s=0.05",
        "ft.heartbeat_timeout_s=0.5",
        "ft.join_timeout_s=1",
        "ft.grace_min_s=0.75",
        "ft.retry_failed_sync=true",
    ],
    # the last one with rounds of 50 steps (2.5 s): a fault every ~20 syncs is then one every
    # ~50 s, where the faults' own downtime leaves room for 97% (added after the runs above).
    # The join timeout above a round's length: with 1 s, once a worker missed a quorum every
    # later one formed without the last to arrive (58 heals for 5 faults on seed 0:
    # `RoundClock` in localsgd/loop/fault_tolerance.py)
    "H = 50, 50 ms, heartbeat 0.5 s, join 5 s, retried": [
        "sync.period=50",
        "comm.simulate.worker_speed=[1,1,1,1]",
        "comm.simulate.step_s=0.05",
        "ft.heartbeat_timeout_s=0.5",
        "ft.join_timeout_s=5",
        "ft.grace_min_s=0.75",
        "ft.retry_failed_sync=true",
    ],
}


# the Shakespeare LM of experiments/lm_shakespeare (the trust study's: a 215k-parameter GPT,
# inner AdamW) under DiLoCo with H = 16, every step padded to 250 ms (its compute here is about
# 0.07-0.2 s a step with 4 workers on 2 cores): a sync every 4 s, a fault every ~80 s; the join
# timeout above the round, as in the H = 50 setting
SETTINGS["LM DiLoCo, 250 ms, heartbeat 0.5 s, join 6 s, retried"] = [
    "data=shakespeare", "model=transformer", "model.n_layers=4", "model.n_heads=4",
    "model.d_model=64", "optim=adamw", "optim.lr=0.002", "lr_schedule.warmup_steps=40",
    "trainer.batch_size=16", "trainer.eval_samples=1024", "trainer.eval_batch_size=256",
    "sync=diloco", "sync.period=16", "sync.warmup_steps=0", "sync.outer_warmup_rounds=0",
    "comm.simulate.worker_speed=[1,1,1,1]", "comm.simulate.step_s=0.25",
    "ft.heartbeat_timeout_s=0.5", "ft.join_timeout_s=6", "ft.grace_min_s=0.75",
    "ft.retry_failed_sync=true",
]  # fmt: skip


def _without_grace(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("sync.grace_s=")]


# Asynchronous rounds (issue 48, docs/asynchronous.md#under-fttorchft): the syncer in the
# launcher, each worker on its own clock, nobody waiting for a worker that is away. The same
# two jobs: the LM as above, and MNIST-1D under DiLoCo with H = 16 and 50-ms steps (a sync
# every 0.8 s, a fault every ~16 s). No torchft round is run, so the ft membership keys do not
# apply; the grace window's floor (0.75 s) bounds one transfer with a worker and the last
# meeting's wait for a worker behind. (sync.grace_s=0: these ran before the adaptive window
# became the default.)
SETTINGS["async LM DiLoCo, 250 ms"] = [
    *(o for o in SETTINGS["LM DiLoCo, 250 ms, heartbeat 0.5 s, join 6 s, retried"]
      if not o.startswith("ft.")),
    "sync.mode=async", "ft.grace_min_s=0.75", "sync.grace_s=0",
]  # fmt: skip
# ... and with a grace window (sync.grace_s): a merge waits up to that long for the other
# workers' contributions of the same phase, so that workers in step take one merge together, not
# one each (added after seed 3 of the first: without it the LM's fault-free loss was 2.61,
# against 1.92 for synchronous rounds)
SETTINGS["async LM DiLoCo, 250 ms, grace 0.25 s"] = [
    *_without_grace(SETTINGS["async LM DiLoCo, 250 ms"]), "sync.grace_s=0.25",
]  # fmt: skip
# ... with each exchange in flight (`sync.overlap=true`): a worker cut off trains on
SETTINGS["async LM DiLoCo, 250 ms, grace 0.25 s, in flight"] = [
    *SETTINGS["async LM DiLoCo, 250 ms, grace 0.25 s"], "sync.overlap=true",
]  # fmt: skip
# ... with the adaptive window, the default since sync.grace_s=null (one measured step)
SETTINGS["async LM DiLoCo, 250 ms, adaptive grace"] = _without_grace(
    SETTINGS["async LM DiLoCo, 250 ms"]
)
SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms"] = [
    "sync=diloco", "optim=adamw", "optim.lr=0.003", "sync.period=16", "sync.warmup_steps=0",
    "comm.simulate.worker_speed=[1,1,1,1]", "comm.simulate.step_s=0.05",
    "sync.mode=async", "ft.grace_min_s=0.75", "sync.grace_s=0",
]  # fmt: skip
# rounds of 50 steps (2.5 s), as the synchronous "H = 50" setting above, 6000 steps: a fault
# every ~50 s, where the faults' own downtime leaves room for 97%
SETTINGS["async MNIST-1D DiLoCo, H = 50, 50 ms, grace 0.1 s"] = [
    *(o for o in _without_grace(SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms"])
      if o != "sync.period=16"),
    "sync.period=50", "sync.grace_s=0.1",
]  # fmt: skip
SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"] = [
    *_without_grace(SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms"]), "sync.grace_s=0.1",
]  # fmt: skip
# ... the stale contributions of a worker back from a freeze or a partition corrected against
# the outer momentum (HeLoCo, its defaults)
# ... or not merged where more than 3 merges old, the most the fault-free runs merged
SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s, max staleness 3"] = [
    *SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"], "sync.max_staleness=3",
]  # fmt: skip
SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s, HeLoCo"] = [
    *SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"],
    "sync.staleness_correction=heloco",
]  # fmt: skip
# ... with each exchange in flight (`sync.overlap=true`, added with asynchronous exchanges in
# flight): a worker cut off from the syncer, or held for its merge, trains on
SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s, in flight"] = [
    *SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"], "sync.overlap=true",
]  # fmt: skip
# ... as Streaming DiLoCo: 2 fragments, each phase of 8 steps sending one (added with
# asynchronous fragments: what a fault costs where each message is half the model)
SETTINGS["async MNIST-1D Streaming DiLoCo, H = 16, P = 2, 50 ms, grace 0.1 s"] = [
    *SETTINGS["async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"], "sync.fragments=2",
]  # fmt: skip


def _override(setting: str, key: str, default):
    for override in SETTINGS[setting]:
        if override.startswith(key + "="):
            return type(default)(override.split("=", 1)[1])
    return default


def batch_of(setting: str) -> int:
    return _override(setting, "trainer.batch_size", BATCH)


def period_of(setting: str) -> int:
    """The setting's k: the preset's, or its `sync.period=` override."""
    return _override(setting, "sync.period", PERIOD)


def schedule(seed: int, steps: int, every: float, period: int = PERIOD) -> list[dict]:
    """The faults of one seed: step, kind, worker and (freeze, partition) seconds."""
    rng = random.Random(seed)
    gap = every * period
    faults: list[dict] = []
    step = 0
    while True:
        step += int(rng.uniform(0.5, 1.5) * gap)
        if step > steps - 4 * period:  # the last one leaves time to heal
            return faults
        recent = [f["rank"] for f in faults[-2:]]
        fault = {
            "step": step,
            "kind": rng.choice(KINDS),
            "rank": rng.choice([r for r in range(WORKERS) if r not in recent]),
        }
        if fault["kind"] != "kill":
            fault["seconds"] = round(rng.uniform(2.0, 6.0), 1)
        faults.append(fault)


class Chaos:
    """A trainer callback (`trainer.callbacks`) that plays this worker's faults of the schedule
    in `path` (`{"faults": [...]}`), each once, through `tests.faults.Fault`."""

    def __init__(self, path: str):
        with open(path) as f:
            self.faults = json.load(f)["faults"]
        self.dir = os.path.dirname(path)
        self.started = False

    def on_step_start(self, trainer, step: int) -> None:
        from tests.faults import Fault

        rank = trainer.info.rank
        if not self.started:  # a process restarted after its kill: when it is back (`back-i`)
            self.started = True
            for i, fault in enumerate(self.faults):
                if fault["rank"] == rank and fault["kind"] == "kill":
                    fired = os.path.join(self.dir, f"fired-{i}")
                    back = os.path.join(self.dir, f"back-{i}")
                    if os.path.exists(fired) and not os.path.exists(back):
                        with open(back, "w") as f:
                            json.dump({"time": time.time()}, f)
        for i, fault in enumerate(self.faults):
            if fault["rank"] != rank or step < fault["step"]:
                continue
            try:  # once, even across the restart a kill causes
                marker = os.path.join(self.dir, f"fired-{i}")
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, json.dumps({"fired_step": step, "time": time.time()}).encode())
            os.close(fd)
            spec = f"{fault['kind']}:{rank}:{step}"
            if "seconds" in fault:
                spec += f":{fault['seconds']}"
            Fault(spec).on_step_start(trainer, step)
            return

    def on_step_end(self, trainer, step: int) -> None:
        pass


class RoundLog:
    """A trainer callback that appends one line per torchft round of this worker to
    `DIR/rank-R.log` (its step, how long the quorum and count took, the window, the commit and
    whether the window ran out): how the 16-s stall in docs/reliability.md was traced."""

    def __init__(self, dir: str):
        self.dir, self.ready = dir, False

    def on_step_start(self, trainer, step: int) -> None:
        if self.ready:
            return
        self.ready = True
        comm = trainer.sync.fault_tolerance.rounds.comm
        path = os.path.join(self.dir, f"rank-{trainer.info.rank}.log")
        begin, commit = comm.begin, comm.commit

        def write(line: str) -> None:
            with open(path, "a") as f:
                f.write(f"{time.time():.3f} step {trainer.step} {line}\n")

        def logged_begin(*args, **kwargs):
            start = time.perf_counter()
            healed = begin(*args, **kwargs)
            write(f"begin {time.perf_counter() - start:.2f} s window {comm.window_s}")
            return healed

        def logged_commit():
            ok = commit()
            write(f"commit {ok} ran_out {comm.ran_out}")
            return ok

        comm.begin, comm.commit = logged_begin, logged_commit

    def on_step_end(self, trainer, step: int) -> None:
        pass


def run_one(setting: str, seed: int, args, run_dir: str, faults: list[dict] | None) -> dict:
    own_sync = any(o.startswith("sync=") for o in SETTINGS[setting])  # the LM's DiLoCo
    experiment = [] if own_sync else ["+experiment=post_local_sgd"]
    command = [
        sys.executable, "-m", "localsgd.train", *experiment, "ft=torchft",
        f"dist.world_size={WORKERS}", f"trainer.max_steps={args.steps}",
        "trainer.checkpoint_every=0", "trainer.progress=false", "logger=jsonl",
        *SETTINGS[setting], f"seed={seed}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    if faults is not None:
        path = run_dir + "-faults/schedule.json"
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            json.dump({"faults": faults}, f)
        command.append(
            f"trainer.callbacks=[{{_target_:experiments.chaos.chaos_study.Chaos,path:'{path}'}}]"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{setting} seed {seed} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    fired, fired_at, back_at = {}, {}, {}
    for marker in glob.glob(run_dir + "-faults/fired-*"):
        with open(marker) as f:
            got = json.load(f)
        fired[int(marker.rsplit("-", 1)[1])] = got["fired_step"]
        fired_at[int(marker.rsplit("-", 1)[1])] = got["time"]
    for marker in glob.glob(run_dir + "-faults/back-*"):
        with open(marker) as f:
            back_at[int(marker.rsplit("-", 1)[1])] = json.load(f)["time"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    progress = [
        [r["step"], r["wall_time_s"], r.get("participants")]
        for r in lines
        if "loss" in r and "wall_time_s" in r
    ]
    return {
        "setting": setting,
        "seed": seed,
        "chaos": faults is not None,
        "faults": [
            {
                **fault,
                "fired_step": fired.get(i),
                "down_s": downtime(fault, i, fired_at, back_at, in_flight(setting)),
            }
            for i, fault in enumerate(faults or [])
        ],
        "command_wall_s": round(wall, 2),
        "train_s": round(s["wall_time_s"] - s["eval_seconds"], 3),
        "test_loss": s["test_loss"],
        "test_accuracy": s["test_accuracy"],
        "merged_samples": int(s["merged_samples"]),
        "samples_total": args.steps * batch_of(setting) * WORKERS,
        # torchft's rounds; asynchronous rounds have none: their sessions and merges instead
        "participants_min": s.get("participants_min"),
        "heals": s.get("heals", sum(s.get("async_sessions", [])) - WORKERS),
        "failed_syncs": s.get("failed_syncs", s.get("async_failed_sessions")),
        "retried_syncs": s.get("retried_syncs", 0),
        "grace_timeouts": s.get("grace_timeouts"),
        "grace_waited_s": s.get("grace_waited_s"),
        "grace_s_end": s.get("grace_s"),
        "async_merges": s.get("async_merges"),
        "async_max_staleness": s.get("async_max_staleness"),
        # asynchronous ft: sessions dropped mid-transfer and rejoins, to tell a lost phase from
        # a late one when a run loses merges
        "async_failed_sessions": s.get("async_failed_sessions"),
        "async_rejoins": s.get("async_rejoins"),
        "async_dropped_stale": len(s.get("async_dropped_stale") or []),
        "restarts": proc.stderr.count("died (signal 9); restart"),
        "progress": progress,  # rank 0's log lines: step, training seconds, participants
    }


def _cell(value) -> str:
    """A table cell: '-' where the run has no such figure (asynchronous rounds: no quorum)."""
    return "-" if value is None else f"{value:g}"


def in_flight(setting: str) -> bool:
    """Whether the setting's exchanges are in flight (`sync.overlap`): a worker cut off from
    the syncer trains on."""
    return "sync.overlap=true" in SETTINGS[setting]


def downtime(
    fault: dict, i: int, fired_at: dict, back_at: dict, trains_through: bool = False
) -> float | None:
    """The seconds the fault itself took its worker out: a freeze's or a partition's length
    (none for a partition where the worker trains through it: `trains_through`); for a kill,
    from the kill to the restarted process's first step (its start-up: the launcher's restart,
    imports, data and model, the lighthouse)."""
    if i not in fired_at:
        return None
    if fault["kind"] == "partition" and trains_through:
        return 0.0
    if fault["kind"] != "kill":
        return fault["seconds"]
    return round(back_at[i] - fired_at[i], 2) if i in back_at else None


def compare(free: dict, chaos: dict) -> dict:
    """Goodput and loss of a chaos run against its fault-free run, and the seconds of
    fault-free training each fault cost (`1 - goodput` is about that over the gap between
    faults)."""
    free_rate = free["merged_samples"] / free["train_s"]
    rate = chaos["merged_samples"] / chaos["train_s"]
    fired = sum(f["fired_step"] is not None for f in chaos["faults"])
    lost_s = chaos["train_s"] - chaos["merged_samples"] / free_rate
    steps_per_s = free["progress"][-1][0] / free["train_s"]
    period = period_of(chaos["setting"])
    stalls = {kind: [] for kind in KINDS}
    for fault in chaos["faults"]:
        if fault["fired_step"] is not None:
            stalls[fault["kind"]].append(
                round(stall(chaos["progress"], fault, steps_per_s, period), 2)
            )
    down = [f.get("down_s") for f in chaos["faults"] if f["fired_step"] is not None]
    # the most a job can keep: each fault takes one of the workers out for its downtime
    ceiling = None if None in down else 1 - sum(down) / (WORKERS * chaos["train_s"])
    return {
        "goodput": rate / free_rate,
        "ceiling": ceiling,
        "loss_vs_free": chaos["test_loss"] / free["test_loss"] - 1,
        "faults_fired": fired,
        "seconds_lost_per_fault": lost_s / max(fired, 1),
        "seconds_between_faults": chaos["train_s"] / max(fired, 1),
        "samples_lost": chaos["samples_total"] - chaos["merged_samples"],
        "stall_s": stalls,
    }


def stall(progress: list, fault: dict, steps_per_s: float, period: int = PERIOD) -> float:
    """An estimate of the seconds rank 0's progress stood still around one fault: the time
    from its last log line at or before the fault's step to its first one 3 syncs after it,
    less what those steps take at the fault-free run's pace (its log lines come every 25 steps,
    so it is no finer than that; a fault on rank 0 itself shows its own downtime)."""
    step = fault["fired_step"]
    before = [p for p in progress if p[0] <= step] or progress[:1]
    after = [p for p in progress if p[0] >= step + 3 * period] or progress[-1:]
    (s0, t0), (s1, t1) = before[-1][:2], after[0][:2]
    return (t1 - t0) - (s1 - s0) / steps_per_s


def plot(runs: list[dict], rows: list[dict], out: str, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in runs))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    axes = list(axes.flat)
    seed = seeds[0]
    for ax, setting in zip(axes, settings, strict=False):
        for r in runs:
            if r["setting"] != setting or r["seed"] != seed:
                continue
            steps = [p[0] for p in r["progress"]]
            secs = [p[1] for p in r["progress"]]
            label = "chaos" if r["chaos"] else "fault-free"
            ax.plot(secs, steps, label=label, color="C3" if r["chaos"] else "C0")
            if r["chaos"]:
                for f in r["faults"]:
                    if f["fired_step"] is None:
                        continue
                    t = next((p[1] for p in r["progress"] if p[0] >= f["fired_step"]), None)
                    if t is not None:
                        marker = {"kill": "x", "freeze": "s", "partition": "^"}[f["kind"]]
                        ax.plot(t, f["fired_step"], marker, color="k", ms=6)
        ax.set_title(f"{setting}, seed {seed} (x kill, ■ freeze, ▲ partition)", fontsize=9)
        ax.set_xlabel("training seconds (rank 0's clock)")
        ax.set_ylabel("step")
        ax.legend(fontsize=8)
    ax = axes[len(settings)]
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        values = [r["goodput"] for r in rows if r["setting"] == setting]
        ax.bar([s + i * width for s in range(len(values))], values, width, label=setting)
    ax.axhline(0.97, color="k", ls="--", lw=1, label="target 0.97")
    ax.set_xticks([s + width / 2 for s in range(len(seeds))], [f"seed {s}" for s in seeds])
    ax.set_ylabel("goodput vs fault-free (merged samples/s)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def _command(args: argparse.Namespace) -> str:
    """The command that made the report (the options that differ from the study's)."""
    cmd = "python experiments/chaos/chaos_study.py"
    if args.tiny:
        return cmd + " --tiny"
    if getattr(args, "out", "chaos_study") != "chaos_study":
        settings = " ".join(f'"{s}"' for s in args.settings)
        seeds = " ".join(map(str, args.seeds))
        cmd += f" --seeds {seeds} --settings {settings} --out {args.out}"
        if args.steps != 3000:
            cmd += f" --steps {args.steps}"
        if args.every != 20:
            cmd += f" --every {args.every:g}"
        if list(getattr(args, "kinds", KINDS)) != list(KINDS):
            cmd += " --kinds " + " ".join(args.kinds)
    return cmd


def write_report(data: dict, out: str) -> None:
    """experiments/chaos/chaos_study.{md,png} from the study's json (`data`)."""
    args, runs, rows = argparse.Namespace(**data["args"]), data["runs"], data["rows"]
    lines = [
        "# Chaos on `make train`'s job through torchft: goodput against fault-free",
        "",
        f"    {_command(args)}",
        "",
        f"Run {data['stamp']}, {data['elapsed_s']:.0f} s on 2 CPUs shared with other jobs: "
        + (
            f"the Shakespeare LM (the 215k-parameter GPT), DiLoCo, {WORKERS} workers, "
            f"{args.steps} steps (k = 16, no warmup)"
            if all(setting.startswith("LM") for setting in args.settings)
            else f"MNIST-1D, the CNN, {WORKERS} workers, {args.steps} steps ({WARMUP} "
            f"synchronous, then k = {PERIOD} unless the setting names another)"
        )
        + ", `ft=torchft`, a fault every "
        f"~{args.every:g} syncs (x k steps) "
        "among the 4 workers, the schedule drawn from the seed (seeds "
        f"{', '.join(map(str, args.seeds))}; the same schedule in every setting of a seed; "
        "`chaos_study.json` lists it, with the step each fault fired at). Every ratio is against "
        "the fault-free run of the same seed and setting, run just before it in this "
        "invocation. Goodput: merged samples (summary.json's `merged_samples`: whose training "
        "reached a committed global state) per training second. Seconds lost per fault: the "
        "chaos run's training seconds less the seconds its merged samples take at the "
        "fault-free run's rate, per fault; `1 - goodput` is about that over the seconds "
        "between faults.",
        "",
        "Faults: `kill` (SIGKILL; restarted, it heals from a live peer), `freeze` (SIGSTOP "
        "inside a round, SIGCONT 2-6 s later) and `partition` (the worker's collectives send "
        "nothing for 2-6 s while its process and heartbeats run on). The partition is not cut "
        "at the network level: that needs firewall rules on the loopback this shared machine's "
        "other jobs use; it is the worker's data plane held, its control plane up, which is "
        "what its peers and the lighthouse see of such a cut.",
        "",
        "Ceiling: the most goodput a job can keep when each fault takes one of the 4 workers "
        "out for its own downtime (a freeze's or partition's length, a partition's none where "
        "the exchanges are in flight, `sync.overlap`, since the worker trains through it; a "
        "kill's restart, from the kill to the new process's first step): "
        "1 - sum(downtime) / (4 x training seconds); "
        "'-' where the run did not record a kill's restart (runs before it was added).",
        "",
        "| setting | seed | faults fired (kill/freeze/partition) | goodput | ceiling | test "
        "loss vs fault-free | seconds lost per fault | seconds between faults | samples lost | "
        "participants min | heals | failed syncs | window at the end (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        chaos = next(r for r in runs if r["chaos"] and r["seed"] == row["seed"]
                     and r["setting"] == row["setting"])  # fmt: skip
        kinds = "/".join(
            str(sum(f["kind"] == k and f["fired_step"] is not None for f in chaos["faults"]))
            for k in KINDS
        )
        lines.append(
            f"| {row['setting']} | {row['seed']} | {row['faults_fired']} ({kinds}) | "
            f"{row['goodput']:.3f} | "
            + (f"{row['ceiling']:.3f}" if row.get("ceiling") is not None else "-")
            + f" | {row['loss_vs_free']:+.2%} | "
            f"{row['seconds_lost_per_fault']:.2f} | {row['seconds_between_faults']:.1f} | "
            f"{row['samples_lost']:,} of {chaos['samples_total']:,} | "
            f"{_cell(chaos['participants_min'])} | {chaos['heals']} | "
            f"{chaos['failed_syncs']} | {_cell(chaos['grace_s_end'])} |"
        )
    lines += [
        "",
        "Rank 0's stall around each fault, by kind (seconds; an estimate from its log lines, "
        "every 25 steps: see `stall()`), all seeds:",
        "",
        "| setting | kill | freeze | partition |",
        "|---|---|---|---|",
    ]
    for setting in args.settings:
        cells = []
        for kind in KINDS:
            got = sorted(x for r in rows if r["setting"] == setting for x in r["stall_s"][kind])
            cells.append(", ".join(f"{x:.1f}" for x in got) or "-")
        lines.append(f"| {setting} | {' | '.join(cells)} |")
    lines += ["", "Reading: [docs/reliability.md](../../docs/reliability.md#a-chaos-study)."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(runs, rows, out, args.seeds)
    print("\n".join(lines))


def same_samples(names: list[str], out: str) -> None:
    """OUT.{json,md}: each chaos run of the studies `names` (their .json here) against the
    fault-free run of its seed and setting stopped where the fleet has trained the samples the
    chaos run merged (`trainer.max_steps`, so a step schedule spans the shorter run), and
    against its own fault-free run (the same steps), as the study wrote it."""
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            with open(os.path.join(HERE, name + ".json")) as f:
                data = json.load(f)
            for row in data["rows"]:
                runs = [r for r in data["runs"]
                        if r["seed"] == row["seed"] and r["setting"] == row["setting"]]  # fmt: skip
                chaos = next(r for r in runs if r["chaos"])
                free = next(r for r in runs if not r["chaos"])
                setting, seed = row["setting"], row["seed"]
                per_step = batch_of(setting) * WORKERS
                steps = round(chaos["merged_samples"] / per_step)
                args = argparse.Namespace(steps=steps)
                label = "".join(c if c.isalnum() else "_" for c in setting)
                matched = run_one(setting, seed, args, os.path.join(tmp, f"{label}-{seed}"), None)
                rows.append({
                    "file": name, "setting": setting, "seed": seed,
                    "faults_fired": row["faults_fired"], "steps": steps,
                    "samples": chaos["merged_samples"], "chaos_loss": chaos["test_loss"],
                    "free_loss": free["test_loss"], "matched_loss": matched["test_loss"],
                    "vs_same_steps": chaos["test_loss"] / free["test_loss"] - 1,
                    "vs_same_samples": chaos["test_loss"] / matched["test_loss"] - 1,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    elapsed = time.perf_counter() - started
    with open(out + ".json", "w") as f:
        json.dump({"names": names, "stamp": stamp, "elapsed_s": round(elapsed, 1),
                   "rows": rows}, f, indent=1)  # fmt: skip
    lines = [
        "# Chaos runs against fault-free at equal samples",
        "",
        f"    python experiments/chaos/chaos_study.py --same-samples {' '.join(names)} "
        f"--out {os.path.basename(out)}",
        "",
        f"Run {stamp}, {elapsed:.0f} s on 2 CPUs shared with other jobs. Each chaos run of "
        "those files (its test loss as the file has it) against a fault-free run of its seed "
        "and setting stopped at the samples the chaos run merged (`trainer.max_steps` = merged "
        "samples / (4 workers x batch), so the learning-rate schedule spans the shorter run), "
        "and against its own fault-free run at the same steps.",
        "",
        "| file | setting | seed | faults | chaos merged (steps) | test loss vs fault-free, "
        "same samples | same steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['file']} | {r['setting']} | {r['seed']} | {r['faults_fired']} | "
            f"{r['samples']:,} ({r['steps']}) | {r['vs_same_samples']:+.2%} | "
            f"{r['vs_same_steps']:+.2%} |"
        )
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=float, default=20, help="syncs between faults")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
        help="play only the schedule's faults of these kinds (the others' steps stay fault-free)",
    )  # fmt: skip
    parser.add_argument(
        "--same-samples", nargs="+", metavar="STUDY",
        help="no new chaos: each chaos run of these studies (experiments/chaos/STUDY.json) "
        "against a fault-free run stopped at the samples it merged",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--report", action="store_true", help="rewrite the .md/.png from the json")
    parser.add_argument(
        "--out",
        default="chaos_study",
        help="experiments/chaos/OUT.{json,md,png} (a partial run beside the study)",
    )
    args = parser.parse_args()
    out = os.path.join(HERE, args.out)
    if args.tiny:
        asked = args.settings != list(SETTINGS)  # a setting named: smoke-test that one
        args.seeds, args.steps, args.every = [0], 900, 10
        args.settings = args.settings if asked else ["make train"]
        out = os.path.join(tempfile.gettempdir(), "chaos_study_tiny")
    if args.same_samples:
        same_samples(args.same_samples, out)
        return
    if args.report:
        with open(out + ".json") as f:
            write_report(json.load(f), out)
        return
    started = time.perf_counter()
    runs, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for setting in args.settings:
                faults = schedule(seed, args.steps, args.every, period_of(setting))
                # --kinds: the same schedule's faults of those kinds only (an ablation)
                faults = [f for f in faults if f["kind"] in args.kinds]
                pair = []
                for chaos in (False, True):
                    label = "".join(c if c.isalnum() else "_" for c in setting)
                    name = f"{label}-{seed}-{'chaos' if chaos else 'free'}"
                    run = run_one(setting, seed, args, os.path.join(tmp, name),
                                  faults if chaos else None)  # fmt: skip
                    runs.append(run)
                    pair.append(run)
                    brief = {k: v for k, v in run.items() if k not in ("progress", "faults")}
                    print(json.dumps(brief), flush=True)
                rows.append({"setting": setting, "seed": seed, **compare(*pair)})
                print(json.dumps(rows[-1]), flush=True)
    data = {
        "args": {k: v for k, v in vars(args).items() if k != "report"},
        "stamp": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "rows": rows,
        "runs": runs,
    }
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    write_report(data, out)


if __name__ == "__main__":
    main()
