"""Why the eager outer step diverged at 4 workers: the outer step linearised, blocking and eager.

    python experiments/lm_shakespeare/eager_stability.py     # -> eager_stability.md (< 1 s)

Take one direction of the loss along which every worker's H inner steps move the model by the
same fraction c of its distance e to the minimum (c near 1 where the inner loop converges, small
where it barely moves): each pseudo-gradient is d_t = c e_t. With M workers that agree (iid
shards, the linearisation's deterministic part), the eager step's `d_t/M + D_{t-1} - d_{t-1}/M`
(`localsgd/averaging/streaming/averager.py`) is `(c/M) e_t + (1 - 1/M) c e_{t-1}`: a quarter fresh
and three quarters one round late at M = 4. Blocking DiLoCo uses `c e_t`. The outer optimizer is
torch's SGD with Nesterov momentum mu and lr eta:

    v_t = mu v_{t-1} + g_t,    e_{t+1} = e_t - eta (g_t + mu v_t)

a linear recursion in (e_t, e_{t-1}, v_{t-1}); it diverges when its transition matrix has a
spectral radius above 1 for some c in (0, 1]. Momentum on a delayed gradient is the classic way
to lose stability, and the delayed share, 1 - 1/M, grows with M.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SETTINGS = [(0.7, 0.9), (0.5, 0.9), (0.35, 0.9), (0.7, 0.8), (0.7, 0.0)]  # (outer lr, momentum)
WORKERS = (2, 4, 8)


def radius(c: float, workers: int, lr: float, mu: float, eager: bool) -> float:
    """Spectral radius of one outer round (state e_t, e_{t-1}, v_{t-1}) for fraction c."""
    fresh, late = (c / workers, (1 - 1 / workers) * c) if eager else (c, 0.0)
    transition = np.array(
        [
            [1 - lr * fresh * (1 + mu), -lr * late * (1 + mu), -lr * mu * mu],
            [1.0, 0.0, 0.0],
            [fresh, late, mu],
        ]
    )
    return float(max(abs(np.linalg.eigvals(transition))))


def worst(workers: int, lr: float, mu: float, eager: bool) -> float:
    return max(radius(c, workers, lr, mu, eager) for c in np.linspace(0.005, 1.0, 200))


def main() -> None:
    lines = [
        "# The outer step linearised: spectral radius, worst over c in (0, 1]",
        "",
        "`python experiments/lm_shakespeare/eager_stability.py` (see its docstring for the model)."
        " Above 1: the outer iteration diverges along the directions where it is.",
        "",
        "| outer lr | momentum (Nesterov) | blocking DiLoCo | "
        + " | ".join(f"eager, M = {m}" for m in WORKERS)
        + " |",
        "|---:|---:|---:|" + "---:|" * len(WORKERS),
    ]
    for lr, mu in SETTINGS:
        cells = [f"{worst(m, lr, mu, eager=True):.3f}" for m in WORKERS]
        cells = [f"**{c}**" if float(c) > 1 else c for c in cells]
        lines.append(
            f"| {lr} | {mu} | {worst(4, lr, mu, eager=False):.3f} | " + " | ".join(cells) + " |"
        )
    text = "\n".join(lines) + "\n"
    (HERE / "eager_stability.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
