"""localsgd as an installed package: a wheel built from the source carries the configs, and its
console scripts train from any directory with that copy, not the source tree, imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from tests.helpers import FAST, ROOT

pytestmark = pytest.mark.slow


def _pip(*args: str, cwd) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel, and a `pip install --target` of it outside the repository."""
    base = tmp_path_factory.mktemp("package")
    # Built from a copy: an in-tree build would write build/ and *.egg-info into the checkout.
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("localsgd", "conf"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
    wheels = base / "wheels"
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), ".", cwd=src)
    (wheel,) = wheels.glob("localsgd-*.whl")
    target = base / "site"
    _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel), cwd=base)
    return wheel, target


@pytest.mark.timeout(120)
def test_wheel_holds_every_package_and_every_config(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = os.path.join(ROOT, "conf")
    for folder, _, files in os.walk(conf):
        for f in files:
            if f.endswith(".yaml"):
                rel = os.path.relpath(os.path.join(folder, f), conf).replace(os.sep, "/")
                assert f"localsgd/conf/{rel}" in names, rel
    pkg = os.path.join(ROOT, "localsgd")
    for folder, _, files in os.walk(pkg):
        if "__init__.py" in files:  # a package pyproject.toml must list
            rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
            assert f"{rel}/__init__.py" in names, f"{rel} is missing from pyproject's packages"


@pytest.mark.timeout(300)
def test_installed_wheel_trains_50_steps_from_another_directory(installed, tmp_path):
    _, target = installed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the installed copy on the path: the checkout is neither the cwd nor on PYTHONPATH
    # (the editable install's finder comes after PYTHONPATH and is never reached).
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import localsgd.train as t, localsgd.conf as c; print(t.__file__); print(c.__file__)",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    files = where.stdout.split()
    assert len(files) == 2 and all(f.startswith(str(target) + os.sep) for f in files), files

    run_dir = elsewhere / "run"
    script = target / "bin" / "localsgd-train"
    proc = subprocess.run(
        [sys.executable, str(script)]
        + FAST
        + ["trainer.max_steps=50", "dist.world_size=2", "sync.period=8"]
        + [f"hydra.run.dir={run_dir}"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 50 and summary["test_accuracy"] > 0.5
    # Hydra read the configs from the installed package
    hydra_cfg = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    sources = hydra_cfg["runtime"]["config_sources"]
    assert {"path": "localsgd.conf", "schema": "pkg", "provider": "main"} in sources

    report = subprocess.run(
        [sys.executable, str(target / "bin" / "localsgd-report"), str(run_dir), "--no-plots"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert (run_dir / "report.md").exists()


@pytest.mark.timeout(120)
def test_a_checkout_runs_without_any_install(tmp_path):
    # a bare copy of the source tree: `conf/` beside the package, nothing installed from it
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("localsgd", "conf"):
        shutil.copytree(os.path.join(ROOT, name), checkout / name, ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    code = "import localsgd.conf as c; print(c.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert where.stdout.strip() == str(checkout / "conf" / "__init__.py"), where.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", "--cfg", "job", "optim=adamw"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["optim"]["_target_"] == "torch.optim.AdamW"
