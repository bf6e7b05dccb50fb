"""The planner's MNIST-1D evidence is what experiments/mnist1d_grid measured: one finding per
setting and configuration with the study's gaps, and backed exactly where every seed of every
configuration ended within 2% of sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localsgd.planner.evidence import FINDINGS, MNIST1D, WITHIN, verdict
from localsgd.planner.grid import GRID

STUDY = Path(__file__).resolve().parents[1] / "experiments" / "mnist1d_grid" / "study.json"


def measured() -> dict[tuple[str, str], tuple[int, list[float]]]:
    """(setting, configuration): (workers, percent gap to sync per seed), from the study's runs."""
    runs = json.loads(STUDY.read_text())["runs"]
    out = {}
    for config, by_setting in runs.items():
        sync = by_setting["ddp"]
        for setting, seeds in by_setting.items():
            if setting == "ddp":
                continue
            workers = {o for r in seeds.values() for o in r["overrides"] if "world_size" in o}
            assert sync.keys() == seeds.keys() and len(workers) == 1
            gaps = [100 * (seeds[s]["test_loss"] / sync[s]["test_loss"] - 1) for s in sorted(seeds)]
            out[setting, config] = (int(workers.pop().split("=")[1]), gaps)
    return out


def test_each_finding_of_the_study_is_its_measured_gap():
    found = {
        (f.setting, f.study.split(": ")[1].split(" ")[0]): f
        for f in FINDINGS
        if f.study.startswith("mnist1d_grid:")
    }
    study = measured()
    assert found.keys() == study.keys()  # every setting x configuration, nothing else
    assert {s for s, _ in study} == {s.key for s in GRID} - {"ddp"}
    for key, (workers, gaps) in study.items():
        f = found[key]
        assert f.job == MNIST1D and f.workers == workers, key
        assert f.gaps == pytest.approx(gaps, abs=0.006), key


def test_the_planner_backs_on_mnist1d_exactly_what_ended_within_2_percent_everywhere():
    study = measured()
    held = {
        s for s, _ in study if all(max(g) <= WITHIN for (t, _), (_, g) in study.items() if t == s)
    }
    assert held == {"stream-h16-p4-t4", "stream-h16-p4-t1-int4"}
    backed = {s.key for s in GRID if s.key != "ddp" and verdict(s.key, MNIST1D).backed}
    assert backed == held
    # plain H=16: within 2% at 4 workers (the k-sweep's and this study's), not at 2 workers
    plain = verdict("plain-h16", MNIST1D)
    assert not plain.backed and "some of the studied settings only" in plain.text
    assert "ksweep/iid" in plain.study and "mnist1d_grid" in plain.study
    assert "at 4 workers (MLP 128-128-128)" in verdict("stream-h16-p4-t4", MNIST1D).text
