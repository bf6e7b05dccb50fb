"""Weighted fragment rounds: per-worker step counts (`sync.inner_time_s`) under Streaming
DiLoCo (`StreamingAverager` with `weighted`).

Fragment p's pseudo-gradient grew over the samples a worker trained since p's values last
started from the global ones: its last merge (a blocking round merges at its launch), or under
`merge_rule="progress"`, which keeps what trained while a round was in flight, its last
launch. Its round weighs every worker by those samples. `FragmentSamples` keeps, per fragment,
the samples this rank had trained on at that point (checkpointed with the averager).
"""

from __future__ import annotations


class FragmentSamples:
    """Per fragment, this rank's samples trained when its values last started afresh."""

    def __init__(self, fragments: int, progress: bool):
        self.at = [0.0] * fragments
        self.progress = progress

    def restart(self, samples: float) -> None:
        """Every fragment starts here (each step of a synchronous warmup)."""
        self.at = [samples] * len(self.at)

    def weight(self, p: int, samples: float, launched: bool) -> float:
        """Fragment p's weight at its round, `samples` trained so far; a launched (delayed)
        round restarts the count at its merge, unless the merge keeps the progress."""
        own = samples - self.at[p]
        if not launched or self.progress:
            self.at[p] = samples
        return own

    def merged(self, p: int, samples: float) -> None:
        """Fragment p's launched round merged, replacing (or, at α > 0, mostly replacing) what
        trained while it was in flight."""
        if not self.progress:
            self.at[p] = samples


def weighing_refusal(outer: bool, eager: bool, inner_levels: bool, normalized: bool, alpha: float,
            robust: bool) -> str | None:  # fmt: skip
    """Why a weighted round cannot run with this averager's settings, or None."""
    if robust:
        return (
            "weighted rounds weigh each worker by the samples it reports, and a robust "
            "aggregate over fragments combines the contributions unweighted (an untrusted "
            "worker could inflate its weight): set weighted=False"
        )
    if not outer or eager or inner_levels or (normalized and alpha):
        return (
            "weighted rounds need an outer step (outer=True: the final average of plain "
            "streaming is one unweighted mean), eager=False and no inner_levels, and normalized "
            "ones merge_alpha=0 (a mixed merge leaves part of each worker's own values in its "
            "next pseudo-gradient, which its samples did not make): set weighted=False"
        )
    return None
