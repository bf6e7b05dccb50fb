"""The one table of what does not combine (`localsgd.cli.refusals`): every row is reached by a
config that the check refuses with exactly that row's line, the docs show the table as it is,
and what the rows do not name is accepted."""

from __future__ import annotations

import os
import re

import pytest

from localsgd.cli import refusals
from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from tests.helpers import compose_config, refusal

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIRTUAL = ["dist.virtual_workers=4", "dist.world_size=null"]
TORCHRUN = "torchrun"  # the case runs as a torchrun rank of a replica group of 2 processes

# each row's condition: a config that reaches it first
CASES: dict[str, list[str]] = {
    "sync.eager=true with sync.delay_steps > 0": [
        "+experiment=diloco", "sync.eager=true", "sync.delay_steps=1"],
    "sync.eager=true with sync.outer=none": ["sync.eager=true"],
    "sync.overlap=true with sync.delay_steps > 1 or sync.merge_alpha > 0": [
        "sync.overlap=true", "sync.merge_alpha=0.5"],
    "sync.merge_rule=progress with sync.delay_steps=0": ["sync.merge_rule=progress"],
    "sync.merge_rule=progress with sync.merge_alpha > 0": [
        "sync.merge_rule=progress", "sync.delay_steps=1", "sync.merge_alpha=0.5"],
    "sync.outer_warmup_rounds > 0 with sync.outer=none": ["sync.outer_warmup_rounds=2"],
    "sync.outer_state=cpu with sync.outer=none": ["sync.outer_state=cpu"],
    "sync.error_feedback=true with sync.comm_dtype=float32 and sync.compress=none": [
        "sync.error_feedback=true"],
    "sync.error_feedback_decay < 1 with sync.error_feedback=false": [
        "sync.error_feedback_decay=0.9"],
    "sync.compress=topk with sync.comm_dtype other than float32": [
        "sync.compress=topk", "sync.error_feedback=true", "sync.comm_dtype=int4"],
    "sync.compress=topk with sync.error_feedback=false": [
        "sync.compress=topk", "sync.error_feedback=false"],
    "sync.compress=topk with sync.aggregate=trimmed_mean or median or sign": [
        "sync.compress=topk", "sync.error_feedback=true", "sync.aggregate=median"],
    "sync.topk_mean=senders with sync.aggregate=trimmed_mean or median or sign": [
        "sync.topk_mean=senders", "sync.aggregate=median"],
    "sync.aggregate other than mean, or sync.score=true, with sync.levels": [
        "sync=hierarchical", "sync.aggregate=median"],
    "sync.aggregate other than mean, or sync.score=true, with sync.eager=true": [
        "+experiment=diloco", "sync.eager=true", "sync.aggregate=median"],
    "sync.score=true with sync.inner_time_s": ["sync.inner_time_s=1", "sync.score=true"],
    "sync.budget_merge without sync.inner_time_s or sync.mode=async, or with a robust "
    "sync.aggregate": [
        "sync.inner_time_s=1", "sync.aggregate=median", "sync.budget_merge=weighted"],
    "sync.aggregate other than mean, sync.score=true or sync.mode=async, with "
    "sync.drop_nonfinite=false": ["sync.mode=async", "sync.drop_nonfinite=false"],
    "sync.score=true with sync.aggregate=mean and sync.warmup_steps > 0": [
        "sync.score=true", "sync.warmup_steps=4"],
    "sync.aggregate other than mean with sync.warmup_steps > 0 and trainer.precision=16-mixed": [
        "sync.aggregate=median", "sync.warmup_steps=4", "trainer.precision=16-mixed"],
    "sync.excluded_shard=reassign or take_over without sync.score=true and "
    "sync.exclude_after >= 1": ["sync.excluded_shard=reassign"],
    "ft=torchft with comm.disabled=true": ["ft=torchft", "comm.disabled=true"],
    "ft=torchft with sync.warmup_steps > 0 and sync.aggregate other than mean or sync.score": [
        "ft=torchft", "sync.aggregate=median", "sync.warmup_steps=4"],
    "ft=torchft with sync.drop_nonfinite=true and a 16/32-bit sync.comm_dtype": [
        "ft=torchft", "sync.drop_nonfinite=true"],
    "ft.retry_failed_sync=true with Streaming DiLoCo (sync.fragments, delay_steps, merge_alpha, "
    "eager)": [
        "+experiment=streaming_diloco", "ft=torchft", "ft.retry_failed_sync=true"],
    "ft=torchft with dist.shard_size > 1 on one machine": ["ft=torchft", "dist.shard_size=2"],
    "ft=torchft with sync.levels on one machine": ["ft=torchft", "sync=hierarchical"],
    "ft=torchft, sync.aggregate other than mean or sync.score=true, and replica groups of "
    "several processes (torchrun)": [TORCHRUN, "ft=torchft", "sync.aggregate=median"],
    "ft=torchft with sync.inner_time_s and replica groups of several processes (torchrun)": [
        TORCHRUN, "ft=torchft", "sync.inner_time_s=1"],
    "ft=torchft with sync.excluded_shard=reassign or take_over": [
        "ft=torchft", "sync.score=true", "sync.excluded_shard=reassign"],
    "dist.shard_size > 1 with trainer.nan_policy=skip": [
        "dist.shard_size=2", "trainer.nan_policy=skip"],
    "dist.shard_size > 1 with sync.excluded_shard=reassign or take_over": [
        "+experiment=untrusted", "dist.shard_size=2", "sync.excluded_shard=reassign"],
    "dist.virtual_workers with ft=torchft": [*VIRTUAL, "ft=torchft"],
    "dist.virtual_workers with dist.shard_size > 1": [*VIRTUAL, "dist.shard_size=2"],
    "dist.virtual_workers with sync.inner_time_s and no comm.simulate.worker_speed": [
        *VIRTUAL, "sync.inner_time_s=1"],
    "dist.virtual_workers with comm.simulate.bandwidth_gbps or comm.simulate.latency_ms > 0": [
        *VIRTUAL, "comm.simulate.latency_ms=5"],
    "sync.inner_time_s with sync.merge_alpha > 0 and sync.budget_merge=normalized (or null)": [
        "+experiment=streaming_diloco", "sync.inner_time_s=1"],
    "sync.inner_time_s with sync.levels under an outer step (Streaming DiLoCo's levels)": [
        "sync=hierarchical", "sync.outer=diloco", "sync.inner_time_s=1"],
    "sync.inner_time_s with comm.disabled=true": ["comm.disabled=true", "sync.inner_time_s=1"],
    "comm.simulate.step_s without comm.simulate.worker_speed": ["comm.simulate.step_s=0.01"],
    "comm.disabled=true with sync.warmup_steps > 0": ["comm.disabled=true", "sync.warmup_steps=4"],
    "comm.disabled=true with sync.outer_state=cpu": [
        "comm.disabled=true", "sync.outer=diloco", "sync.outer_state=cpu"],
    "sync.mode=async with sync.eager=true": [
        "sync.mode=async", "sync.outer=diloco", "sync.eager=true"],
    "sync.mode=async with sync.score=true": ["sync.mode=async", "sync.score=true"],
    "sync.mode=async with sync.optimizer_state=average or desloc": [
        "sync.mode=async", "sync.optimizer_state=desloc"],
    "sync.mode=async with sync.schedule=step or adaptive and sync.inner_time_s": [
        "sync.mode=async", "sync.schedule=adaptive", "sync.inner_time_s=0.5"],
    "sync.mode=async with sync.schedule=adaptive and dist.shard_size > 1 without "
    "comm.simulate.worker_speed": [
        "sync.mode=async", "sync.schedule=adaptive", "dist.shard_size=2"],
    "sync.staleness_correction=heloco with sync.mode=sync, sync.outer=none or "
    "sync.outer_momentum=0": ["+experiment=diloco", "sync.staleness_correction=heloco"],
    "sync.mode=async with comm.disabled=true": ["sync.mode=async", "comm.disabled=true"],
    "sync.max_staleness with sync.mode=sync": ["+experiment=diloco", "sync.max_staleness=2"],
    "sync.min_quorum > 1, sync.grace_s or sync.outer_delay with sync.mode=sync": [
        "+experiment=diloco", "sync.outer_delay=4"],
    "trainer.track_drift=true with ft=torchft and sync.mode=async": [
        "ft=torchft", "sync.mode=async", "trainer.track_drift=true"],
    "trainer.track_drift=true with ft=torchft and sync.delay_steps > 0 or sync.overlap=true": [
        "ft=torchft", "sync.overlap=true", "trainer.track_drift=true"],
    "ft.heartbeat_gate=true with sync.mode=async": [
        "ft=torchft", "sync.mode=async", "ft.heartbeat_gate=true"],
    "sync.mode=async with ft=torchft and ft.retry_failed_sync=true or ft.min_replicas > 1": [
        "sync.mode=async", "ft=torchft", "ft.min_replicas=2"],
    "sync.mode=async with sync.merge_alpha > 0 and sync.delay_steps=0": [
        "sync.mode=async", "sync.merge_alpha=0.5", "sync.inner_time_s=0.1"],
    "sync.mode=async with dist.virtual_workers and no comm.simulate.worker_speed": [
        "sync.mode=async", *VIRTUAL],
    "sync.mode=async with ft=torchft and ft.lighthouse or ft.replica_groups set, or "
    "sync.warmup_steps > 0": ["sync.mode=async", "ft=torchft", "sync.warmup_steps=5"],
}  # fmt: skip


def _as_torchrun(monkeypatch) -> list[str]:
    """A torchrun rank of replica group 0 of 2, 2 processes each (the lighthouse not asked)."""
    monkeypatch.setattr("localsgd.cli.forkserver.under_torchrun", lambda: True)
    monkeypatch.setattr("localsgd.cli.fault_tolerance.replica_group_processes", lambda: 2)
    monkeypatch.setattr("localsgd.cli.fault_tolerance.check_reachable", lambda *a: None)
    return ["ft.lighthouse=127.0.0.1:1", "ft.replica_groups=2", "ft.replica_id=group_0"]


def test_every_row_has_a_case():
    assert sorted(CASES) == sorted(row.condition for row in refusals.REFUSALS)


@pytest.mark.parametrize("condition", sorted(CASES))
def test_each_row_refuses_its_combination_in_its_own_line(condition, monkeypatch):
    (row,) = [r for r in refusals.REFUSALS if r.condition == condition]
    overrides = CASES[condition]
    if TORCHRUN in overrides:
        overrides = [o for o in overrides if o != TORCHRUN] + _as_torchrun(monkeypatch)
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, 4, None if TORCHRUN not in CASES[condition] else 2)
    assert str(info.value) == row.line()
    assert "\n" not in row.line() and row.kind in (
        refusals.MEANINGLESS,
        refusals.UNAVAILABLE,
        refusals.DESIGN,
    )
    # the condition names every key the row reads (ft.backend as ft=torchft)
    named = condition.replace("ft=torchft", "ft.backend")
    assert all(key in named for key in row.keys), row.keys


def test_the_docs_show_the_table_as_the_registry_writes_it():
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        text = f.read()
    shown = re.search(r"<!-- refusals:start -->\n(.*?)<!-- refusals:end -->", text, re.S)
    assert shown is not None and shown.group(1) == refusals.markdown()


def test_the_cli_exits_2_with_the_rows_line(tmp_path, capsys):
    line = refusal(["+experiment=diloco", "sync.eager=true", "sync.delay_steps=1",
                    f"hydra.run.dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    assert line == "error: " + refusals.REFUSALS[0].line()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        # what used to be refused and composes now (issue 47's pair matrix, among others)
        ["sync.delay_steps=1", "sync.comm_dtype=int4", "sync.error_feedback=true"],
        ["sync.delay_steps=1", "sync.aggregate=median"],
        ["sync.overlap=true", "sync.score=true"],
        ["sync.fragments=2", "sync.outer=none", "sync.compress=topk", "sync.error_feedback=true"],
        ["+experiment=streaming_diloco", "sync.optimizer_state=desloc"],
        ["+experiment=streaming_diloco", "sync.schedule=adaptive"],
        ["sync=hierarchical", "sync.schedule=adaptive", "sync.optimizer_state=desloc"],
        ["sync=hierarchical", "sync.inner_time_s=1"],
        ["+experiment=diloco", "sync.eager=true", "sync.inner_time_s=1"],
        ["sync.aggregate=median", "sync.outer=diloco", "sync.outer_state=cpu"],
        ["sync.score=true", "sync.schedule=adaptive", "sync.optimizer_state=desloc"],
        ["ft=torchft", "sync.optimizer_state=desloc", "sync.schedule=adaptive"],
        ["ft=torchft", "sync.outer=diloco", "sync.outer_state=cpu"],
        ["ft=torchft", "+experiment=diloco", "sync.eager=true", "trainer.checkpoint_every=8"],
        ["ft=torchft", "sync.delay_steps=1", "sync.check_replicas=true"],
        # asynchronous Streaming DiLoCo: a fragment a phase, on every wire, under ft too
        [
            "sync.mode=async",
            "+experiment=diloco",
            "sync.fragments=2",
            "sync.comm_dtype=int4",
            "sync.error_feedback=true",
            "sync.aggregate=median",
        ],
        ["ft=torchft", "sync.mode=async", "+experiment=diloco", "sync.fragments=2"],
        # the asynchronous syncer's merge drops NaN/Inf: no all-reduce that cannot
        ["ft=torchft", "sync.mode=async", "sync.drop_nonfinite=true", "sync.check_replicas=true"],
        # by default drift is measured where it can be and the gate runs where a lighthouse does
        ["ft=torchft", "sync.mode=async", "trainer.track_drift=false", "ft.heartbeat_gate=false"],
        ["ft=torchft", "ft.heartbeat_gate=true", "trainer.track_drift=false"],
        # synchronous rounds under ft: measured through the Manager's rounds
        ["ft=torchft", "trainer.track_drift=true", "+experiment=diloco", "sync.fragments=2"],
        ["ft=torchft", "trainer.track_drift=true", "sync.check_replicas=true"],
        ["sync.mode=async", "trainer.track_drift=true", "ft.heartbeat_gate=true"],
        ["dist.shard_size=2", "optim=muon", "model=mlp"],
        # a budget's rounds under a robust rule: unweighted
        ["sync.inner_time_s=1", "sync.aggregate=median"],
        # asynchronous rounds over sharded replica groups: a syncer per shard
        ["sync.mode=async", "+experiment=diloco", "dist.shard_size=2", "sync.fragments=2"],
        [
            *VIRTUAL,
            "sync.inner_time_s=0.2",
            "comm.simulate.worker_speed=[1,1,1,3]",
            "comm.simulate.step_s=0.01",
        ],
    ],
)
def test_what_the_rows_do_not_name_is_accepted(overrides):
    validate(compose_config(overrides), 4)
