"""The first stage of a round: what a worker offers, per part.

- `values`: its values themselves (plain averaging in full precision: the mean is the model);
- `change`: its change since the part's last sync, `local - anchor` (every rank holds the same
  anchor, so `anchor + mean(change)` is the same everywhere): what a lossy wire rounds and what a
  robust rule judges, small where the values are not;
- `pseudo_gradient`: DiLoCo's `anchor - local`, the gradient of the outer step.

A normalized weighted round (`Averager.normalized`) scales it over the parameters by the round's
largest weight over this worker's own, so a slow worker's short change is not shrunk; `values`
then scale about the anchor (`anchor + f (local - anchor)`). Floating-point buffers (BatchNorm
statistics) are never scaled.
"""

from __future__ import annotations

import torch

from localsgd.averaging.rounds.part import Part, Tensors

KINDS = ("values", "change", "pseudo_gradient")


class Contribution:
    """Writes a part's contribution into `out` (the part's views of the buffers themselves for a
    round in place, or a copy). `anchors(level)`: the anchor set of a level (None: `values`
    without a weighted scale); `staging`: host scratch per part when the anchors are in host
    memory (`sync.outer_state=cpu`)."""

    def __init__(self, kind: str, anchors=None, host: bool = False):
        if kind not in KINDS:
            raise ValueError(f"a contribution is one of {', '.join(KINDS)}, got {kind!r}")
        self.kind = kind
        self.anchors = anchors
        self.host = host

    @property
    def sign(self) -> int:
        """A candidate model is `anchor + sign * contribution` (a judge's view)."""
        return -1 if self.kind == "pseudo_gradient" else 1

    def offer_(
        self,
        part: Part,
        local: Tensors,
        out: Tensors,
        level: int = 0,
        scale: float | None = None,
        staging: Tensors | None = None,
    ) -> None:
        for i, (g, s, n, e) in enumerate(part):
            here, o = local[g][s:e], out[i]
            if self.kind == "values":
                if scale is not None and self.anchors is None:
                    raise ValueError(
                        "normalized weighted rounds scale each change since the last average, "
                        "which plain averaging does not keep: build the averager with "
                        "round_starts=True, or set normalized=False"
                    )
                if scale is not None:  # about the anchor: anchor + f (local - anchor)
                    start = self.anchors.at(level)[g][s:n]
                    here[: n - s].sub_(start).mul_(scale).add_(start)
                if o is not here:
                    o.copy_(here)
                continue
            anchor = self.anchors.at(level)[g][s:e]
            if self.kind == "change":
                torch.sub(here, anchor, out=o)
            elif self.host:  # the host anchor: the difference taken on the host, copied up
                stage = staging[i]
                stage.copy_(here)
                torch.sub(anchor, stage, out=stage)
                o.copy_(stage)
            else:
                torch.sub(anchor, here, out=o)
            if scale is not None:
                o[: n - s].mul_(scale)
