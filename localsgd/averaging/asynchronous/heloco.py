"""HeLoCo's correction (Al Asif et al. 2026, "HeLoCo: Efficient asynchronous low-communication
training under data and device heterogeneity", arXiv 2606.00271): a stale pseudo-gradient is
compared with the outer momentum, block by block, before the syncer merges it.

For each block b (a parameter tensor) of an incoming pseudo-gradient d, against the outer
momentum m:

    c = cos(d_b, m_b)                                  the block's alignment
    conf = |d_b| / (|d_b| + kappa |m_b| + eps)         how much the momentum may say
    c >= keep:      d_b unchanged                      aligned: kept
    c < 0:          d_b - beta c |d_b| m_b/|m_b|,      anti-aligned: that part of it shrunk,
                    beta = min(shrink (-c) conf, shrink_cap)
    0 <= c < keep:  |d_b| u / |u|, u = (1 - lam) d_b/|d_b| + lam m_b/|m_b|,
                    lam = min(reorient (1 - c) conf, 1)   weakly aligned: turned toward m_b

The paper's momentum is an average (m <- mu m + (1 - mu) G); the outer optimizers here keep
torch's sum (m <- mu m + G), so |m_b| in `conf` is that buffer times (1 - mu): the same
average. Blocks where either norm is 0 (no momentum yet) are kept. The rule above is as
written in a public summary of the paper; its hyperparameters' values were not in anything we
could read, so the defaults are ours (docs/asynchronous.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STALENESS_CORRECTIONS = ("none", "heloco")  # sync.staleness_correction
KEPT, SHRUNK, REORIENTED = "kept", "shrunk", "reoriented"
# each setting's allowed range (the config check reads it too)
RANGES = {
    "keep": (-1.0, 1.0),
    "shrink": (0.0, float("inf")),
    "shrink_cap": (0.0, 1.0),
    "reorient": (0.0, float("inf")),
    "kappa": (0.0, float("inf")),
}


def describe(allowed: tuple[float, float]) -> str:
    low, high = allowed
    return f">= {low:g}" if high == float("inf") else f"in [{low:g}, {high:g}]"


@dataclass
class HeLoCo:
    """The correction's settings (`keep` = c_ok, `shrink` = k_s, `shrink_cap` = beta_max,
    `reorient` = k_d, `kappa`) and how many blocks it kept, shrunk and reoriented so far
    (`counts`; a block its branch left as it was counts as kept)."""

    keep: float = 0.2
    shrink: float = 1.0
    shrink_cap: float = 0.5
    reorient: float = 0.5
    kappa: float = 1.0
    eps: float = 1e-12
    counts: dict = field(default_factory=lambda: {KEPT: 0, SHRUNK: 0, REORIENTED: 0})

    def __post_init__(self):
        for name, allowed in RANGES.items():
            low, high = allowed
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"sync.heloco.{name} must be {describe(allowed)}, got "
                                 f"{getattr(self, name)}")  # fmt: skip

    def correct_(
        self, blocks: list[tuple[torch.Tensor, torch.Tensor | None]], momentum: float
    ) -> None:
        """Correct each (pseudo-gradient block, momentum block) in place; `momentum` is the
        outer optimizer's coefficient mu (its buffer is a sum: see the module doc)."""
        for d, m in blocks:
            self.counts[self._correct_block_(d, m, momentum)] += 1

    def _correct_block_(self, d: torch.Tensor, m: torch.Tensor | None, mu: float) -> str:
        if m is None:
            return KEPT
        d_norm, m_norm = d.norm().item(), m.norm().item()
        if d_norm == 0 or m_norm == 0:
            return KEPT
        c = torch.dot(d.reshape(-1), m.reshape(-1)).item() / (d_norm * m_norm)
        if c >= self.keep:
            return KEPT
        conf = d_norm / (d_norm + self.kappa * (1 - mu) * m_norm + self.eps)
        if c < 0:
            beta = min(self.shrink * -c * conf, self.shrink_cap)
            if beta == 0:  # shrink or shrink_cap 0: nothing changes, and it is counted so
                return KEPT
            d.add_(m, alpha=-beta * c * d_norm / m_norm)
            return SHRUNK
        lam = min(self.reorient * (1 - c) * conf, 1.0)
        if lam == 0:
            return KEPT
        u = d.mul(1 - lam).div_(d_norm).add_(m, alpha=lam / m_norm)
        d.copy_(u.mul_(d_norm / max(u.norm().item(), self.eps)))
        return REORIENTED
