"""How long a torchft round's collectives wait for a peer before the round fails.

A worker that stops answering (SIGSTOP, a swapping host, a hung link) is not dead: its sockets
stay open, so its peers' collectives would wait for it up to the process group's timeout
(`ft.timeout_s`). A `GraceWindow` gives each collective of a round a shorter timeout: when it
passes, gloo closes the connections of the op (nothing is waited out: every later op of that
process group fails at once), the round fails like a round with a dead peer and is rolled back,
and the next quorum forms without the frozen worker once the lighthouse has missed its
heartbeats. A frozen worker thus costs the others one window and the rest of the lighthouse's
heartbeat timeout, not `ft.timeout_s`.

The window is fixed (`fixed_s`) or adaptive: `factor` times the longest single collective of
the last `history` committed rounds, never below `min_s` nor above `max_s` (`ft.timeout_s`).
The longest, not the median: a window that is too short fails a round of live workers (a
rollback, and the round is retried), one that is too long only costs waiting when a worker does
freeze; after one slow round the window widens at once. A round whose window ran out while every
replica group stayed in the next quorum (a slow peer, not a frozen one) counts as a round whose
collective took the whole window, so the window grows by `factor` until the collective fits:
the adaptive window cannot fail the same slow collective forever.

Every worker of a round waits the same window. Each worker's adaptive reading (`proposal()`)
is its own: a worker whose collective failed at once (its peers had already closed the
connections) does not grow, while those whose window ran out do. Left alone, a round would fail
on the shortest window among its workers and stall for the longest (a 16-s stall in the chaos
study, docs/reliability.md). So the round's first collective, the count all-reduce
(`TorchftCommunicator.begin`), carries every member's proposal and each takes the largest
(`agree`): the rest of the round, and the next round's count, wait that. The largest, for the
reason above: a window too short fails a round of live workers.

No torchft or torch import: the arithmetic is tested on its own.
"""

from __future__ import annotations

from collections import deque

__all__ = ["GraceWindow"]


class GraceWindow:
    """The per-collective timeout of a torchft round: `seconds()`; `committed(longest_s)` after
    a committed round, `ran_out(window_s)` after a round whose window passed,
    `next_quorum(same_members)` at the next round's quorum, and `agree(largest_s)` once the
    round's members have compared their `proposal()`s."""

    def __init__(
        self,
        *,
        fixed_s: float | None = None,
        factor: float = 4.0,
        min_s: float = 3.0,
        max_s: float = 30.0,
        history: int = 16,
    ):
        if fixed_s is not None and fixed_s <= 0:
            raise ValueError(f"a grace window must be > 0 s, got {fixed_s}")
        if factor < 1 or min_s <= 0 or max_s <= 0 or history < 1:
            raise ValueError(
                f"GraceWindow needs factor >= 1, min_s > 0, max_s > 0 and history >= 1, got "
                f"factor={factor}, min_s={min_s}, max_s={max_s}, history={history}"
            )
        self.fixed_s, self.factor, self.max_s = fixed_s, factor, max_s
        self.min_s = min(min_s, max_s)  # a short ft.timeout_s bounds the floor too
        self.recent: deque[float] = deque(maxlen=history)  # longest collective per round
        self._pending: float | None = None  # a window that ran out, not yet judged
        self.agreed_s: float | None = None  # the largest proposal of the last round's members

    @property
    def adaptive(self) -> bool:
        return self.fixed_s is None

    def seconds(self) -> float:
        """The timeout of the next collective: the fixed window, else the one the members of
        the last round agreed on (this worker's own proposal before any agreement)."""
        if self.fixed_s is not None:
            return self.fixed_s
        return self.agreed_s if self.agreed_s is not None else self.proposal()

    def proposal(self) -> float:
        """This worker's own reading of the window, from what its collectives took."""
        if self.fixed_s is not None:
            return self.fixed_s
        longest = max(self.recent, default=0.0)
        return min(self.max_s, max(self.min_s, self.factor * longest))

    def committed(self, longest_s: float) -> None:
        """A round committed; its longest single collective took `longest_s` seconds."""
        self._pending = None
        self.recent.append(max(0.0, longest_s))

    def ran_out(self, window_s: float) -> None:
        """A collective of this round waited its whole window (`window_s`) and failed."""
        self._pending = window_s

    def agree(self, largest_s: float) -> None:
        """The largest `proposal()` among this round's members: the window from now on (within
        `max_s`: the proposals travel in float32, which may round one up)."""
        if not largest_s > 0:
            raise ValueError(f"an agreed window must be > 0 s, got {largest_s}")
        self.agreed_s = min(self.max_s, largest_s)

    def next_quorum(self, same_members: bool) -> None:
        """The quorum after a round whose window ran out: with the same replica groups in it,
        no peer was frozen (the lighthouse drops a frozen one), so the collective needed at
        least the whole window: count it as such."""
        if self._pending is not None and same_members:
            self.recent.append(self._pending)
        self._pending = None
