"""The tensors an averager averages, as views of persistent flat buffers.

They are built from `module=` at construction or from the parameters of the first
`average_parameters(params)` call. Before each average every tensor is checked to still live in
its buffer and is put back if it left (torch averages whatever the parameters are now, so must
we).

Sharded parameters (DTensors: FSDP2's, `dist.shard_size`) are *mirrored* instead
(`FlatBuffers(mirror=True)`): the buffers hold copies of this rank's local shards, pulled in
before a step that acts (an average at any level, a launch, a merge; `acts_at`) and pushed back
after it, and nothing at the other steps, so the local phase stays free of collectives and
copies. Between those steps the buffers' storage is released, so a rank holds no second copy
of its shards. The rounds' state (anchors, outer momentum, residuals) is laid out like the
buffers, so it is sharded too. `mirrored` is the one place that happens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from localsgd.averaging.flat import FlatBuffers, averaged_tensors, holds_dtensor
from localsgd.averaging.trees import distinct_nbytes

__all__ = ["FlatBinding", "mirrored", "parameters_of"]


def parameters_of(params: Iterable) -> list[torch.Tensor]:
    """The floating-point tensors in `params`: parameters, or an optimizer's param groups
    (dicts), as torch's averagers accept. An integer parameter cannot be averaged; like an
    integer buffer it stays local."""
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            out.extend(item["params"])
        elif isinstance(item, torch.Tensor):
            out.append(item)
        else:
            raise TypeError(
                f"average_parameters() takes parameters or param groups (dicts), got {type(item)}"
            )
    return [t for t in out if torch.is_floating_point(t)]


def mirrored(when_acting: bool = False):
    """Decorates an averager method that may act on the flat buffers: in mirror mode the
    tensors are pulled into the buffers before it and pushed back after it (`when_acting`:
    only when `acts_at(step)` says this step touches them). Without mirroring it is the method
    itself."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            flat = self._bound()
            if not flat.mirror or flat.pulled or (when_acting and not self.acts_at(self.step)):
                return method(self, *args, **kwargs)  # the unsharded path: nothing added
            flat.pull()
            try:
                return method(self, *args, **kwargs)
            finally:
                flat.push()

        return run

    return wrap


class FlatBinding:
    """The binding half of `Averager` (a mixin: it reads the averager's `module`, `mirror`,
    `init_sync`, `make_rounds`, `part_samples` and `comm`)."""

    def _bind(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        self.param_count = len(params)
        device = tensors[0].device if tensors else torch.device("cpu")
        extra = self.extra_tensors(device)
        mirror = holds_dtensor(tensors) if self.mirror is None else self.mirror
        self.extra_count = len(extra)
        self.flat = FlatBuffers(tensors + extra, mirror=mirror)
        self.rounds = self.make_rounds(self.flat)
        self.part_samples.progress = self.rounds.progress
        # each part's parameters (the ids a hook reads), where a round covers only part of them
        self.part_params = [
            frozenset(
                id(t)
                for t, (g, off, _) in zip(self.flat.tensors, self.flat.slots, strict=True)
                if any(sl.g == g and sl.start <= off < sl.end for sl in part)
            )
            for part in self.rounds.parts
        ]
        # An anchor (DiLoCo, SlowMo, compressed changes) taken from differing replicas would keep
        # them apart for good, so those start from rank 0's tensors, as DDP does when built.
        if self.rounds.anchored if self.init_sync is None else self.init_sync:
            self.broadcast_(src=0)
        self.flat.release()  # mirror: held only while a step acts (the rounds took their copies)

    def _bound(self) -> FlatBuffers:
        if self.flat is None:
            raise ValueError(
                "the averager holds no parameters yet: pass them to average_parameters(params) "
                "or build it with module=..."
            )
        return self.flat

    def _follow_module(self) -> None:
        """`load_state_dict(assign=True)` swaps new Parameter objects into the module."""
        if self.module is None:
            return
        held = self._bound().tensors
        current = self._module_tensors() + self.extra_tensors(held[0].device)
        if len(current) != len(held) or any(a is not b for a, b in zip(current, held, strict=True)):
            self.flat.replace(current)

    def _module_tensors(self) -> list[torch.Tensor]:
        return averaged_tensors(self.module)

    def ensure_bound(self) -> None:
        """Put back every tensor that left its buffer (cheap: one pointer compare per tensor)."""
        self._follow_module()
        convert = self._bound().rebind()
        if convert is not None:
            self.rounds.relayout(self.flat, convert)

    def _check_params(self, given: list[torch.Tensor]) -> None:
        held = self._bound().tensors[: self.param_count]
        held_ids = {id(t) for t in held}
        foreign = sum(id(t) not in held_ids for t in given)
        if foreign or len({id(t) for t in given}) != len(held_ids):
            raise ValueError(
                f"average_parameters() got {len(given)} parameters ({foreign} not held), the "
                f"averager holds {len(held)}: it averages the tensors it was built with; build a "
                "new averager for other parameters"
            )

    @torch.no_grad()
    def _extras_into_buffers(self) -> None:
        """Mirror mode: the buffers hold copies, taken before the schedule's `before_sync` /
        `after_sync` changed its loss slot; refresh them, so the reduction averages what the
        schedule prepared and the push after the step writes back what it left."""
        if self.flat.mirror and self.extra_count:
            n = len(self.flat.tensors) - self.extra_count
            for t, v in zip(self.flat.tensors[n:], self.flat.views[n:], strict=True):
                v.copy_(t)

    @torch.no_grad()
    def _extras_from_buffers(self) -> None:
        """Mirror mode: hand the reduced loss slot to the schedule before it reads it."""
        if self.flat.mirror and self.extra_count:
            n = len(self.flat.tensors) - self.extra_count
            for t, v in zip(self.flat.tensors[n:], self.flat.views[n:], strict=True):
                t.copy_(v)

    @mirrored()
    def broadcast_(self, src: int = 0) -> None:
        """Give every rank rank `src`'s tensors (`src`: a rank of the averager's group; setup:
        not counted as training communication)."""
        for flat in self._bound().buffers:
            self.comm.broadcast_(flat, src)
        self.rounds.reset(self.flat.buffers)

    def held_bytes(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """The bytes the averager holds of its own between steps, on the accelerator: the
        mirrored copy of the parameters (0 between steps where it is released; unsharded the
        flat buffers *are* the parameters' storage), anchors, outer momentum, error-feedback
        residuals, and `other` (wire buffers, fragments' in-flight copies); and, with
        `sync.outer_state=cpu`, what it holds in host memory instead (anchors, outer momentum
        and the outer step's staging buffer), else None."""
        held = self.rounds.held_tensors()
        outer = {
            "anchors": distinct_nbytes(held["anchors"]),
            "outer_momentum": distinct_nbytes(held["outer_momentum"]),
        }
        on_host = self.rounds.host  # sync.outer_state=cpu
        own = {
            "mirror": self.flat.held_bytes if self.flat is not None and self.flat.mirror else 0,
            **({"anchors": 0, "outer_momentum": 0} if on_host else outer),
            "residuals": distinct_nbytes(held["residuals"]),
            "other": distinct_nbytes(held["other"]),
        }
        host = {**outer, "staging": distinct_nbytes(held["staging"])} if on_host else None
        return own, host
