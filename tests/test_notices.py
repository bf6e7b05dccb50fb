"""One-line notices (`ft: worker 1 died ...`, `SIGTERM: stopped ...`) start a line of their own
while a progress bar is drawn, and land in the run's train.log; torchft's tracebacks of a
collective whose peer died are dropped (tests/test_ft_cli.py runs the whole story)."""

from __future__ import annotations

import io
import logging

import pytest

from localsgd.loop import metrics
from localsgd.loop.metrics import notice, progress_bar, set_notice_log


@pytest.fixture(autouse=True)
def _fresh_notice_state(monkeypatch):
    monkeypatch.setattr(metrics, "_notice_log", None)
    monkeypatch.setattr(metrics, "_bar_elsewhere", False)


def _lines(err: str) -> list[str]:
    return err.replace("\r", "\n").splitlines()  # as a log file or `less` shows a bar's redraws


@pytest.mark.timeout(10)
def test_a_notice_under_this_process_bar_starts_a_line_and_lands_in_train_log(tmp_path, capsys):
    log = tmp_path / "train.log"
    set_notice_log(str(log))
    bar = progress_bar(10, 0, enabled=True)
    bar.update(3)
    bar.refresh()
    notice("ft: worker 1 died (signal 9)")
    bar.close()
    assert "ft: worker 1 died (signal 9)" in _lines(capsys.readouterr().err)
    logged = log.read_text()  # the notice, then the bar's last state (what the console showed)
    assert "[localsgd][NOTICE] - ft: worker 1 died (signal 9)\n" in logged
    assert logged.splitlines()[-1].split("[localsgd][OUTPUT] - ")[1].startswith("train:  30%")


@pytest.mark.timeout(10)
def test_a_notice_under_another_process_bar_starts_a_line(capsys):
    import sys

    set_notice_log(None, bar_elsewhere=True)
    sys.stderr.write("\rtrain:  30%|###       | 3/10")  # a worker's bar: no newline after it
    notice("ft: worker 1 died (signal 9)")
    assert "ft: worker 1 died (signal 9)" in _lines(capsys.readouterr().err)


@pytest.mark.timeout(10)
def test_torchfts_traceback_of_a_dead_peer_is_dropped_and_other_errors_are_one_line():
    pytest.importorskip("torchft")
    from localsgd.averaging.torchft.services import _quiet_peer_loss

    _quiet_peer_loss()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("torchft.manager")
    logger.addHandler(handler)
    try:
        for message in (
            "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1252. "
            "This is typically caused by a remote worker crashing. GLHF! \N{UMBRELLA ON GROUND}",
            "something else went wrong",
        ):
            try:
                raise RuntimeError(message)
            except RuntimeError as e:
                logger.exception(f"got exception waiting for work {e}")
    finally:
        logger.removeHandler(handler)
    assert "GLHF" not in out.getvalue()
    assert out.getvalue() == "got exception waiting for work something else went wrong\n"
