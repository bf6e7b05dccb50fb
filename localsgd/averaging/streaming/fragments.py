"""Streaming DiLoCo's fragments: how the model is split (`model_blocks`, `fragment_ids`). Each
fragment is a part of the flat buffers (`rounds.part.fragments`) whose rounds `Rounds` runs;
`StreamingAverager` (`localsgd.averaging.streaming.averager`, whose docstring gives the semantics)
schedules them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import nn

from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.rounds.part import Part
from localsgd.averaging.rounds.part import fragments as parts_of

Tensors = list[torch.Tensor]


def model_blocks(module: nn.Module, path: str | None = None) -> list[nn.Module]:
    """The repeated blocks of `module`, as the module docstring defines them; with `path` (a
    dotted submodule name, e.g. "transformer.h"), that submodule's children that hold
    floating-point tensors, whatever the automatic rule would find. Raises ValueError when
    `path` names no submodule, or one with no such child."""

    def holds(m: nn.Module) -> bool:
        return any(torch.is_floating_point(t) for t in chain(m.parameters(), m.buffers()))

    if path is not None:
        try:
            parent = module.get_submodule(path)
        except AttributeError:
            names = [n for n, m in module.named_modules() if n and list(m.children())]
            raise ValueError(
                f"{path!r} names no submodule of {type(module).__name__} (its submodules with "
                f"children: {', '.join(names[:8]) or 'none'})"
            ) from None
        kids = [c for c in parent.children() if holds(c)]
        if not kids:
            raise ValueError(
                f"{path!r} ({type(parent).__name__}) has no child module holding parameters "
                "to make a block of"
            )
        return kids
    best: list[nn.Module] = []
    for m in module.modules():
        if isinstance(m, nn.ModuleList | nn.Sequential):
            kids = [c for c in m.children() if holds(c)]
            if len(kids) > len(best):
                best = kids
    return best or [c for c in module.children() if holds(c)]


def fragment_ids(
    module: nn.Module, fragments: int, blocks: Sequence[nn.Module] | None = None
) -> list[int]:
    """The fragment of each tensor of `averaged_tensors(module)`, in that order."""
    tensors = averaged_tensors(module)
    if fragments == 1:
        return [0] * len(tensors)
    found = model_blocks(module) if blocks is None else list(blocks)
    if len(found) < fragments:
        raise ValueError(
            f"fragments={fragments} needs at least {fragments} blocks, the model has {len(found)}"
        )
    where = {id(t): i for i, t in enumerate(tensors)}
    out = [-1] * len(tensors)
    for b, block in enumerate(found):
        for t in chain(block.parameters(), block.buffers()):
            i = where.get(id(t))
            if i is not None and out[i] < 0:
                out[i] = b % fragments
    sizes = [0] * fragments
    for t, f in zip(tensors, out, strict=True):
        if f >= 0:
            sizes[f] += t.numel()
    for i, t in enumerate(tensors):
        if out[i] < 0:
            out[i] = min(range(fragments), key=lambda q: (sizes[q], q))
            sizes[out[i]] += t.numel()
    return out


class FragmentOrder:
    """Binding in fragment order (a mixin before `Averager`): the averaged tensors are bound so
    that each fragment is contiguous in every flat buffer (its parameters, then its buffers),
    which `rounds.part.fragments` then cuts into one part per fragment. Call `_order_fragments`
    before `Averager.__init__` binds; `fragment_parts` is the `make_rounds` split."""

    _order: list[int] = []
    _param_ids: set[int] = set()

    def _order_fragments(
        self, module: nn.Module, fragments: int, blocks: Sequence[nn.Module] | None = None
    ) -> None:
        ids = fragment_ids(module, fragments, blocks)
        n_params = sum(1 for t in module.parameters() if torch.is_floating_point(t))
        self._order = sorted(range(len(ids)), key=lambda i: (ids[i], i >= n_params, i))
        self._fragment_of = [ids[i] for i in self._order]
        self._is_param = [i < n_params for i in self._order]
        self._param_ids = set()

    def fragment_parts(self, flat: FlatBuffers) -> list[Part]:
        """One part per fragment of `flat` (bound in this order)."""
        return parts_of(flat, self._fragment_of, self._is_param)

    def _bind(self, params: Tensors, tensors: Tensors) -> None:
        self._param_ids = {id(t) for t in params}
        super()._bind(params, [tensors[i] for i in self._order])

    def _module_tensors(self) -> Tensors:
        current = averaged_tensors(self.module)
        return [current[i] for i in self._order]

    def _follow_module(self) -> None:
        before = self._bound().tensors
        super()._follow_module()
        if self.flat.tensors is not before:
            self._param_ids = {id(t) for t in self.module.parameters()}

    def _check_params(self, given: Tensors) -> None:
        if {id(t) for t in given} != self._param_ids:
            raise ValueError(
                "average_parameters() got other parameters than the module's: build a new "
                "averager for other parameters"
            )
