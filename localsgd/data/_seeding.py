"""Derived seeds, so the dataset, the partition and each sampler draw from unrelated streams."""

from __future__ import annotations

import numpy as np


def derive_seed(seed: int, *tags: int) -> int:
    """A 63-bit seed mixed from `seed` and `tags` (stable across processes and platforms).

    Seeding every consumer with the raw run seed would correlate them (e.g. the synthetic data's
    draws and the iid permutation would come from the same torch stream); SeedSequence hashes the
    tuple so nearby (seed, rank, epoch) values give independent streams.
    """
    entropy = [int(seed) & 0xFFFFFFFFFFFFFFFF, *(int(t) for t in tags)]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])
