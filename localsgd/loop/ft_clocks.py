"""The clocks of `ft=torchft`, built from its settings: the rounds' grace window, the heartbeat
gate (a worker heartbeats to the lighthouse only while it is healthy), and the clock that warns
when rounds outlast the lighthouse's join timeout."""

from __future__ import annotations

import statistics
import time

from localsgd.averaging.torchft.grace import GraceWindow
from localsgd.averaging.torchft.heartbeat_gate import HeartbeatGate
from localsgd.config import FtConfig
from localsgd.loop.metrics import notice


def grace_window(ft: FtConfig) -> GraceWindow:
    """The per-collective timeout of the rounds (`ft.grace_s`, or adaptive from
    `ft.grace_factor` and `ft.grace_min_s`), never above `ft.timeout_s`."""
    return GraceWindow(
        fixed_s=ft.grace_s, factor=ft.grace_factor, min_s=ft.grace_min_s, max_s=ft.timeout_s
    )


def heartbeat_gate(ft: FtConfig) -> HeartbeatGate | None:
    """This worker's heartbeat gate (`ft.heartbeat_gate`, `ft.stall_s`); None: torchft's own
    heartbeats, which go on whatever the worker does."""
    return HeartbeatGate(ft.stall_s) if ft.heartbeat_gate is not False else None


def gate_notice(worker: int, ft: FtConfig):
    """`on_change(open, why)` for a worker's gate: one line when it stops heartbeating, one when
    it heartbeats again."""

    def said(open_: bool, why: str) -> None:
        if open_:
            notice(f"ft: worker {worker} heartbeats again")
        else:
            notice(
                f"ft: worker {worker} stopped heartbeating ({why}): the others' next quorum forms "
                f"without it after ft.heartbeat_timeout_s; it rejoins and heals when it is back"
            )

    return said


class RoundClock:
    """Times committed rounds against the lighthouse's join timeout (`ft.join_timeout_s`).

    torchft's lighthouse forms a quorum without waiting for stragglers once the earliest member
    waiting joined `join_timeout_s` ago. A worker that misses a quorum (it arrived a moment after
    it formed, or restarted) waits inside the next one from the moment it missed, so when rounds
    last longer than the join timeout, the next quorum forms as soon as most workers arrive, the
    last to arrive misses it and waits in turn: every round from then on one worker sits out
    and heals, losing its round (measured: 25-58 heals where 4-5 faults needed 4-5). `committed()`
    returns a one-line warning the first time the median of the last `window` gaps between
    committed rounds exceeds the join timeout, else None."""

    def __init__(self, join_timeout_s: float, window: int = 5, clock=time.monotonic):
        self.join_timeout_s, self.window, self.clock = join_timeout_s, window, clock
        self.last: float | None = None
        self.gaps: list[float] = []
        self.warned = False

    def committed(self) -> str | None:
        now = self.clock()
        if self.last is not None:
            self.gaps = [*self.gaps, now - self.last][-self.window :]
        self.last = now
        if self.warned or len(self.gaps) < self.window:
            return None
        typical = statistics.median(self.gaps)
        if typical <= self.join_timeout_s:
            return None
        self.warned = True
        return (
            f"ft: rounds last {typical:.1f} s, longer than the lighthouse's join timeout "
            f"(ft.join_timeout_s={self.join_timeout_s:g}): once a worker misses a quorum, every "
            "later quorum forms without the last worker to arrive, which heals and loses its "
            "round; set ft.join_timeout_s above a round's length"
        )
