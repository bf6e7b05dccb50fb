"""`python -m localsgd.plan [options] [overrides]`: which sync settings suit this job and link.

The overrides are a run's (`python -m localsgd.train OVERRIDES`). The plan composes and checks
them as the training CLI does, times a few real steps of the job's workers here, takes the link
from `--bandwidth-gbps`/`--latency-ms`, else from `comm.simulate.*`, else measures it between the
workers, and prints for every setting of the grid (`localsgd.planner.grid`) the predicted
utilisation (`localsgd.planner.model`), the bytes per parameter per step, the seconds of a
round's communication left exposed, and what the studies say about its loss against sync
(`localsgd.planner.evidence`). Then the cheapest setting (fewest bytes) that reaches
`--target-utilisation` among those the studies back on this job, as overrides to paste.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from localsgd.config import ConfigError
from localsgd.planner.evidence import JOBS, Verdict, job_of, verdict
from localsgd.planner.grid import GRID, Setting
from localsgd.planner.model import Link, Prediction, predict, predict_run
from localsgd.planner.sizes import ModelShape

USAGE = (
    "python -m localsgd.plan [--bandwidth-gbps G] [--latency-ms MS] [--probe-link] "
    "[--target-utilisation U] [--steps N] [--like lm|mnist1d|none] [--json PATH] [overrides ...]"
)


class PlanError(ValueError):
    """Bad input to the plan: one line, exit 2."""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m localsgd.plan",
        usage=USAGE,
        add_help=True,
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--bandwidth-gbps", type=float, default=None)
    parser.add_argument("--latency-ms", type=float, default=None)
    parser.add_argument(
        "--probe-link",
        action="store_true",
        help="measure the link between the workers (the default without "
        "--bandwidth-gbps/--latency-ms or comm.simulate)",
    )
    parser.add_argument("--target-utilisation", type=float, default=0.95)
    parser.add_argument(
        "--steps", type=int, default=25, help="steps to time (the first fifth warms up, untimed)"
    )
    parser.add_argument(
        "--like",
        choices=("lm", "mnist1d", "none"),
        default=None,
        help="which studied job yours is like (default: from data and model)",
    )
    parser.add_argument("--json", default=None, help="also write the plan here")
    args, rest = parser.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        raise PlanError(f"unknown option {flags[0]}; usage: {USAGE}")
    if args.bandwidth_gbps is not None and not args.bandwidth_gbps > 0:
        raise PlanError(f"--bandwidth-gbps must be > 0, got {args.bandwidth_gbps:g}")
    if args.latency_ms is not None and not args.latency_ms >= 0:
        raise PlanError(f"--latency-ms must be >= 0, got {args.latency_ms:g}")
    if args.probe_link and (args.bandwidth_gbps is not None or args.latency_ms is not None):
        raise PlanError("--probe-link measures the link: give it or --bandwidth-gbps/--latency-ms")
    if not 0 < args.target_utilisation <= 1:
        raise PlanError(f"--target-utilisation must be in (0, 1], got {args.target_utilisation:g}")
    if args.steps < 2:
        raise PlanError(f"--steps must be >= 2 (one warms up, untimed), got {args.steps}")
    return args, rest


def compose(overrides: list[str]):
    """The config a run of `overrides` would get, checked as `python -m localsgd.train` checks
    it (ConfigError: one line). Returns (the DictConfig, the typed Config, steps)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from localsgd.cli.overrides import CONF_DIR, check_overrides, composition_error
    from localsgd.cli.train import preflight
    from localsgd.config import typed

    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise composition_error(e) from None
    if cfg.dist.virtual_workers is not None:
        raise ConfigError(
            "dist.virtual_workers: the plan times the workers as processes, side by side; drop "
            f"it (got {cfg.dist.virtual_workers})"
        )
    _, epoch_steps = preflight(cfg, None, quiet=True)
    run_cfg = typed(cfg)
    steps = epoch_steps if epoch_steps is not None else run_cfg.trainer.max_steps
    return cfg, run_cfg, steps


def measurement_config(run_cfg):
    """The job with communication off and a plain sync: what its steps cost alone (the grid
    replaces the sync settings anyway); no fault tolerance, callbacks, drift or checkpoints."""
    from localsgd.config import FtConfig, SyncConfig

    run_cfg.sync = SyncConfig()
    run_cfg.ft = FtConfig()
    run_cfg.comm.disabled = True
    run_cfg.trainer.callbacks = []
    run_cfg.trainer.track_drift = False
    run_cfg.trainer.checkpoint_every = 0
    run_cfg.trainer.progress = False
    return run_cfg


def measure(run_cfg, world_size: int, steps: int, probe: bool) -> list[dict]:
    """Each worker's record (`measure.measure_worker`), rank order."""
    from localsgd.cli.launch import spawn
    from localsgd.planner.measure import measure_worker

    with tempfile.TemporaryDirectory(prefix="localsgd-plan-") as out:
        skip = max(1, steps // 5)
        spawn(
            measure_worker,
            world_size,
            run_cfg.dist.timeout_s,
            args=(run_cfg, out, steps, skip, probe),
        )
        records = []
        for rank in range(world_size):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                records.append(json.load(f))
    return records


SIMULATED_STEPS = 1024  # the run the utilisation column simulates: the job's, up to this long
SIMULATED_REPS = 16


@dataclass
class Row:
    setting: Setting
    prediction: Prediction | None  # the steady-state round, every step at the worker's mean
    refused: str | None
    verdict: Verdict
    utilisation: float | None = None  # over the job's run, the barrier's jitter drawn in

    @property
    def util(self) -> float:
        return self.prediction.mean_utilisation if self.utilisation is None else self.utilisation


def plan_rows(
    shape: ModelShape, link: Link, step_times: list[list[float]], job: str | None, steps: int
) -> list[Row]:
    """Every grid setting for a model of `shape` on `link`, worker w's steps taking the times
    in `step_times[w]` (the job's `steps` steps simulated, up to SIMULATED_STEPS)."""
    step_s = [sum(t) / len(t) for t in step_times]
    rows = []
    for setting in GRID:
        schedule = setting.schedule(shape)
        said = verdict(setting.key, job)
        if isinstance(schedule, str):
            rows.append(Row(setting, None, schedule, said))
            continue
        util, _ = predict_run(
            schedule,
            link,
            step_s,
            min(steps, SIMULATED_STEPS),
            samples=step_times,
            reps=SIMULATED_REPS,
        )
        rows.append(
            Row(
                setting,
                predict(schedule, link, step_s, shape.params),
                None,
                said,
                sum(util) / len(util),
            )
        )
    return rows


def choose(rows: list[Row], target: float, runs=lambda row: True) -> tuple[Row | None, bool]:
    """The backed row with the fewest bytes per parameter per step at or above `target` (ties:
    the higher utilisation), and True; else the backed row of highest utilisation, and False.
    Only rows for which `runs(row)` holds (the job's other settings accept them) count."""
    backed = [r for r in rows if r.prediction is not None and r.verdict.backed]
    meeting = sorted(
        (r for r in backed if r.util >= target),
        key=lambda r: (r.prediction.bytes_per_param_step, -r.util),
    )
    for row in meeting:
        if runs(row):
            return row, True
    for row in sorted(backed, key=lambda r: (-r.util, r.prediction.bytes_per_param_step)):
        if runs(row):
            return row, False
    return None, False


def accepted_by(overrides: list[str], steps: int):
    """Whether the job with a row's setting in place of its sync settings passes the training
    CLI's checks (a setting a job's other settings refuse, e.g. with ft=torchft, is no choice);
    the refusals are noted on the rows."""

    def runs(row: Row) -> bool:
        try:
            compose(paste(overrides, row.setting, steps))
        except ConfigError as e:
            row.refused = f"refused with this job's settings: {e}"
            return False
        return True

    return runs


def paste(overrides: list[str], setting: Setting, steps: int) -> list[str]:
    """The user's overrides with their sync ones replaced by `setting`'s."""

    def is_sync(o: str) -> bool:
        key = o.lstrip("+~").split("=", 1)[0]
        return key == "sync" or key.startswith("sync.")

    return [o for o in overrides if not is_sync(o)] + setting.overrides(steps)


def render(
    rows: list[Row],
    link: Link,
    link_from: str,
    step_s: list[float],
    shape: ModelShape,
    job: str | None,
    target: float,
    chosen: Row | None,
    meets: bool,
    command: list[str],
    steps: int,
) -> str:
    slow, fast = max(step_s), min(step_s)
    steps_line = f"{slow * 1e3:.1f} ms a step" + (
        f" (fastest worker {fast * 1e3:.1f} ms)" if slow > 1.02 * fast else ""
    )
    lines = [
        f"job: {shape.params:,} parameters ({4 * shape.params / 1e6:.2f} MB in fp32), "
        f"{len(step_s)} workers, {steps_line}, measured here",
        f"link: {link.describe()} ({link_from})",
        f"studies: {JOBS[job] if job else 'none on a job like this one (only sync is backed)'}",
        "",
        "| setting | utilisation | bytes/param/step | exposed s/round | loss vs sync (studies) "
        "| study |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.prediction is None:
            lines.append(f"| {r.setting.label} | - | - | - | cannot run: {r.refused} | |")
            continue
        p = r.prediction
        refused = f" ({r.refused})" if r.refused else ""
        lines.append(
            f"| {r.setting.label} | {r.util:.3f} | {p.bytes_per_param_step:.4g} | "
            f"{p.exposed_s:.3f} | {r.verdict.text}{refused} | {r.verdict.study or '-'} |"
        )
    lines.append("")
    if chosen is None:
        lines.append("no setting of the grid that the studies back runs with this job's settings")
        return "\n".join(lines) + "\n"
    p = chosen.prediction
    if meets:
        lines.append(
            f"chosen: {chosen.setting.label}: the fewest bytes ({p.bytes_per_param_step:.4g} per "
            f"parameter per step) of the settings the studies back that reach utilisation "
            f"{target:g} (predicted {chosen.util:.3f})"
        )
    else:
        lines.append(
            f"no setting the studies back reaches utilisation {target:g} on this link; the "
            f"highest is {chosen.setting.label} (predicted {chosen.util:.3f}, "
            f"{p.bytes_per_param_step:.4g} bytes per parameter per step)"
        )
        faster = [r for r in rows if r.prediction is not None and r.util >= target]
        if faster:
            cheap = min(faster, key=lambda r: r.prediction.bytes_per_param_step)
            lines.append(
                f"  reaching it without the studies' backing: {cheap.setting.label} "
                f"({cheap.util:.3f}; loss: {cheap.verdict.text})"
            )
    lines.append("overrides: " + " ".join(chosen.setting.overrides(steps)))
    lines.append("command: python -m localsgd.train " + " ".join(command))
    return "\n".join(lines) + "\n"


def link_for(args, cfg) -> tuple[Link | None, str]:
    """The link the plan uses, and where it came from (None: to be measured)."""
    if args.bandwidth_gbps is not None or args.latency_ms is not None:
        return Link((args.latency_ms or 0.0) / 1e3, args.bandwidth_gbps), "given"
    sim = cfg.comm.simulate
    if not args.probe_link and (sim.bandwidth_gbps is not None or sim.latency_ms > 0):
        return Link(sim.latency_ms / 1e3, sim.bandwidth_gbps, simulated=True), "comm.simulate"
    return None, "measured between the workers here"


def main(argv: list[str] | None = None) -> int:
    from localsgd.loop.metrics import notice

    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse(argv)
        cfg, run_cfg, steps = compose(overrides)
        link, link_from = link_for(args, cfg)
    except (PlanError, ConfigError) as e:
        notice(f"error: {e}")
        return 2
    from localsgd.cli.launch import WorkerFailed
    from localsgd.cli.train import world_size_of
    from localsgd.planner.measure import link_of

    world_size = world_size_of(run_cfg)
    started = time.perf_counter()
    notice(
        f"plan: starting {world_size} workers to time {args.steps} steps of this job"
        + ("" if link else " and probe the link between them")
    )
    try:
        records = measure(measurement_config(run_cfg), world_size, args.steps, link is None)
    except WorkerFailed as e:
        notice(f"error: {e}")
        return 1
    if link is None:
        link = link_of(records[0]["link"])
    step_s = [r["step_s"] for r in records]
    step_times = [r["step_times"] for r in records]
    shape = ModelShape.from_dict(records[0]["shape"])
    job = (
        job_of(cfg.data._target_, cfg.model._target_)
        if args.like is None
        else (None if args.like == "none" else args.like)
    )
    rows = plan_rows(shape, link, step_times, job, steps)
    chosen, meets = choose(rows, args.target_utilisation, accepted_by(overrides, steps))
    command = paste(overrides, chosen.setting, steps) if chosen else []
    text = render(
        rows,
        link,
        link_from,
        step_s,
        shape,
        job,
        args.target_utilisation,
        chosen,
        meets,
        command,
        steps,
    )
    print(text, end="")
    print(f"(planned in {time.perf_counter() - started:.0f} s)")
    if args.json:
        write_json(args.json, rows, link, link_from, records, job, chosen, meets, command)
    return 0


def write_json(path, rows, link, link_from, records, job, chosen, meets, command) -> None:
    out = {
        "link": {
            "latency_s": link.latency_s,
            "bandwidth_gbps": link.bandwidth_gbps,
            "gather_gbps": link.gather_gbps,
            "from": link_from,
        },
        "workers": records,
        "job": job,
        "rows": [
            {
                "key": r.setting.key,
                "label": r.setting.label,
                "overrides": r.setting.overrides(1),
                "refused": r.refused,
                "utilisation": None if r.prediction is None else r.util,
                "bytes_per_param_step": None
                if r.prediction is None
                else r.prediction.bytes_per_param_step,
                "exposed_s": None if r.prediction is None else r.prediction.exposed_s,
                "backed": r.verdict.backed,
                "loss": r.verdict.text,
                "study": r.verdict.study,
            }
            for r in rows
        ],
        "chosen": chosen.setting.key if chosen else None,
        "meets_target": meets,
        "command": command,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
