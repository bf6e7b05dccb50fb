"""HeLoCo's correction (`localsgd.averaging.asynchronous.heloco`), one block at a time, against
closed forms in two dimensions: the momentum along x, the pseudo-gradient at a chosen angle.
The replay across 3 processes (tests/test_async_rounds.py) checks it inside the syncer."""

from __future__ import annotations

import math

import pytest
import torch

from localsgd.averaging.asynchronous.heloco import HeLoCo

MU = 0.9  # the outer momentum's coefficient: its buffer (a sum) is 10x the average


def _corrected(d, m, **settings):
    heloco = HeLoCo(**settings)
    block = torch.tensor(d, dtype=torch.float64)
    heloco.correct_([(block, None if m is None else torch.tensor(m, dtype=torch.float64))], MU)
    return block, heloco.counts


def test_an_aligned_block_is_kept_as_it_is():
    block, counts = _corrected([1.0, 1.0], [10.0, 0.0])  # cos 0.71 >= keep 0.2
    assert block.tolist() == [1.0, 1.0] and counts["kept"] == 1


def test_an_anti_aligned_block_loses_part_of_its_component_against_the_momentum():
    block, counts = _corrected([-1.0, 1.0], [10.0, 0.0])  # cos -0.71; average momentum 1
    c, norm = -1 / math.sqrt(2), math.sqrt(2)
    conf = norm / (norm + 1.0)
    beta = min(-c * conf, 0.5)  # shrink 1, capped at 0.5
    assert beta < 0.5  # the uncapped branch
    assert block.tolist() == pytest.approx([-1.0 - beta * c * norm, 1.0], abs=1e-12)
    assert counts["shrunk"] == 1
    capped, _ = _corrected([-1.0, 1.0], [10.0, 0.0], shrink=10.0)
    assert capped.tolist() == pytest.approx([-0.5, 1.0], abs=1e-12)  # half of it, at most


def test_a_weakly_aligned_block_turns_toward_the_momentum_and_keeps_its_norm():
    d = [0.1, 1.0]
    block, counts = _corrected(d, [10.0, 0.0])
    norm = math.hypot(*d)
    c = 0.1 / norm
    conf = norm / (norm + 1.0)
    lam = min(0.5 * (1 - c) * conf, 1.0)
    u = [(1 - lam) * 0.1 / norm + lam, (1 - lam) * 1.0 / norm]
    scale = norm / math.hypot(*u)
    assert block.tolist() == pytest.approx([u[0] * scale, u[1] * scale], abs=1e-12)
    assert block.norm().item() == pytest.approx(norm, abs=1e-12)
    assert block[0] / block.norm() > c and counts["reoriented"] == 1


def test_a_branch_that_changes_nothing_counts_the_block_as_kept():
    for d, settings in (([-1.0, 1.0], {"shrink_cap": 0.0}), ([0.1, 1.0], {"reorient": 0.0})):
        block, counts = _corrected(d, [10.0, 0.0], **settings)
        assert block.tolist() == d and counts == {"kept": 1, "shrunk": 0, "reoriented": 0}


def test_no_momentum_yet_keeps_every_block():
    for m in (None, [0.0, 0.0]):
        block, counts = _corrected([-1.0, 1.0], m)
        assert block.tolist() == [-1.0, 1.0] and counts["kept"] == 1


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"keep": 1.5}, "sync.heloco.keep must be in [-1, 1], got 1.5"),
        ({"shrink_cap": -0.1}, "sync.heloco.shrink_cap must be in [0, 1], got -0.1"),
        ({"kappa": -1.0}, "sync.heloco.kappa must be >= 0, got -1.0"),
    ],
)
def test_out_of_range_settings_are_one_line(settings, message):
    with pytest.raises(ValueError) as info:
        HeLoCo(**settings)
    assert str(info.value) == message
