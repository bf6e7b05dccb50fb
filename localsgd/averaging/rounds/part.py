"""What a round runs on: a *part* of the flat buffers, the whole model or one of Streaming
DiLoCo's fragments, as one slice per flat buffer that holds some of it.

A slice `(g, start, lead, end)` is `buffers[g][start:end]`, whose first `lead - start` values
are parameters and the rest floating-point buffers (BatchNorm statistics): an outer step moves
the parameters by momentum and takes the buffers plainly. `averaged_tensors` lists parameters
first, so in the whole model each buffer's parameters lead it; a fragment's slice holds its
parameters, then its buffers (`StreamingAverager` binds the tensors in that order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from localsgd.averaging.flat import FlatBuffers, param_lead

Tensors = list[torch.Tensor]


class Slice(NamedTuple):
    g: int  # the flat buffer
    start: int
    lead: int  # where its parameters end
    end: int


Part = list[Slice]


def whole(flat: FlatBuffers) -> Part:
    """The whole model: one slice per flat buffer."""
    lead = param_lead(flat)
    return [Slice(g, 0, lead[g], b.numel()) for g, b in enumerate(flat.buffers)]


def fragments(flat: FlatBuffers, ids: list[int], is_param: list[bool]) -> list[Part]:
    """One part per fragment: `ids[i]` is the fragment of `flat.tensors[i]`, `is_param[i]`
    whether it is a parameter; each fragment's tensors are contiguous in each buffer."""
    spans: dict[tuple[int, int], list[int]] = {}  # (fragment, buffer) -> [start, lead, end]
    for i, (g, off, numel) in enumerate(flat.slots):
        span = spans.setdefault((ids[i], g), [off, off, off])
        span[1] += numel if is_param[i] else 0
        span[2] = off + numel
    count = max(ids, default=0) + 1
    return [
        [Slice(g, s, n, e) for (q, g), (s, n, e) in sorted(spans.items()) if q == p]
        for p in range(count)
    ]


def views(tensors: Tensors, part: Part) -> Tensors:
    """`tensors` (laid out as the flat buffers) cut to `part`, one view per slice."""
    return [tensors[g][s:e] for g, s, _, e in part]


def new_like(tensors: Tensors, part: Part) -> Tensors:
    """Uninitialised tensors shaped as `part`'s slices, on their buffers' devices."""
    return [tensors[g].new_empty(e - s) for g, s, _, e in part]


def is_whole(part: Part, tensors: Tensors) -> bool:
    """Whether `part` covers every buffer whole (its views are the buffers' whole length)."""
    return len(part) == len(tensors) and all(
        sl.g == g and sl.start == 0 and sl.end == t.numel()
        for g, (sl, t) in enumerate(zip(part, tensors, strict=True))
    )
