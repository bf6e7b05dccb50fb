"""The straggler study's paired bootstrap (`experiments/stragglers/paired.py`): the ratio of two
models' mean test losses and its 95% interval over resampled test samples. In-process."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(30)

PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "experiments", "stragglers", "paired.py",
)  # fmt: skip


def _paired():
    spec = importlib.util.spec_from_file_location("paired", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_interval_is_paired_and_narrows_with_the_test_set():
    paired = _paired()
    rng = np.random.default_rng(1)
    base = rng.exponential(1.3, 2000)  # heavy-tailed per-sample losses, as an overfit model's
    # the same samples 5% worse each: paired, the interval is the ratio itself
    ratio, lo, hi = paired.ratio_interval(base, base * 1.05)
    assert ratio == pytest.approx(0.05) and lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    # a model no better nor worse on average, sample by sample different: the interval holds 0,
    # and a test set 16x larger makes it about 4x narrower
    widths = []
    for n in (500, 8000):
        a = rng.exponential(1.3, n)
        b = a * rng.uniform(0.5, 1.5, n)
        ratio, lo, hi = paired.ratio_interval(a, b)
        assert lo < 0 < hi and lo < ratio < hi
        widths.append(hi - lo)
    assert 3 < widths[0] / widths[1] < 5
