from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

from tests.helpers import BASE, cli, compose_config


def _no_process(*args, **kwargs):
    raise AssertionError(
        "a test not marked slow started a process: `make test-fast` runs in-process only "
        "(mark it @pytest.mark.slow, or test the logic without a process)"
    )


def pytest_configure(config):
    # matplotlib (imported by the mnist1d package) builds its font cache on first import, running
    # `fc-list`: on a fresh machine that would be the first fast test's process. Build it here.
    import matplotlib.font_manager  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """Modules with the longest time limits first: `make test` hands whole modules to two pytest
    workers (`-n 2 --dist loadscope`, so module-scoped fixtures are set up once), and the two
    then end together instead of one waiting out a minute-long module collected last."""
    default = float(config.getini("timeout") or 0)

    def limit(item) -> float:
        mark = item.get_closest_marker("timeout")
        return mark.args[0] if mark else default

    longest: dict[str, float] = {}
    for item in items:
        longest[item.module.__name__] = max(longest.get(item.module.__name__, 0), limit(item))
    items.sort(key=lambda item: longest[item.module.__name__], reverse=True)


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """What `make test-fast` (-m "not slow") promises, enforced: no subprocess, no worker."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _no_process)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _no_process)


@pytest.fixture
def small_config():
    return compose_config


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """BASE trained without interruption: what every interrupted variant must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc, left = cli(BASE + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    return run_dir
