"""Persistent flat buffers: tensors rebound as views into one contiguous buffer per device/dtype.

Averaging then costs one in-place collective per buffer and allocates nothing, where torch's
`average_parameters` concatenates a fresh model-sized tensor and rebinds every `p.data` per call.
A tensor can leave its buffer behind our back (`p.data = x`, `module.double()`,
`vector_to_parameters`, `load_state_dict(assign=True)`); `rebind()` finds and repairs that.

`mirror=True` rebinds nothing: the buffers hold copies of the tensors, taken in by `pull()` and
written back by `push()`. That is the mode for tensors whose storage belongs to someone else:
FSDP2's sharded parameters are DTensors whose `.to_local()` is a view of FSDP's own sharded
storage, and rebinding their `.data` would cut FSDP off from the values it all-gathers. A
DTensor is mirrored through its local shard, so every buffer holds this rank's shards only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


# Converts a list of flat tensors laid out like the old buffers into the new layout.
Relayout = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class FlatBuffers:
    """Rebinds each tensor's `.data` to a slice of a flat buffer; the tensor objects stay the same.

    Optimizers, modules and user references keep working because a Parameter's identity does not
    change, only its storage. Tensors are grouped per (device, dtype) in the order given.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], mirror: bool = False):
        self.tensors = _unique(tensors)
        if not mirror and holds_dtensor(self.tensors):
            raise ValueError(
                "DTensor parameters (FSDP2's shards) cannot be rebound into flat buffers: "
                "mirror them (FlatBuffers(..., mirror=True); the averagers do so by default)"
            )
        self.mirror = mirror
        self.pulled = False  # mirror: between `pull()` and `push()`
        self._build()

    def _build(self) -> None:
        locals_ = [local_tensor(t) for t in self.tensors]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(locals_):
            groups.setdefault((t.device, t.dtype), []).append(i)
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [None] * len(self.tensors)  # type: ignore[list-item]
        self.slots: list[tuple[int, int, int]] = [None] * len(self.tensors)  # type: ignore[list-item]
        for g, ((device, dtype), members) in enumerate(groups.items()):
            flat = torch.empty(sum(locals_[i].numel() for i in members), device=device, dtype=dtype)
            offset = 0
            for i in members:
                t = locals_[i]
                view = flat[offset : offset + t.numel()].view(t.shape)
                view.copy_(t.detach())
                if not self.mirror:
                    t.data = view
                self.views[i], self.slots[i] = view, (g, offset, t.numel())
                offset += t.numel()
            self.buffers.append(flat)

    # --- mirror mode -----------------------------------------------------------------------------

    @torch.no_grad()  # in-place on a parameter's local shard is refused with grad on
    def pull(self) -> None:
        """Mirror: (re)allocate the buffers and copy every tensor's current value (a DTensor's
        local shard) into its slot."""
        self._allocate()
        for t, v in zip(self.tensors, self.views, strict=True):
            v.copy_(local_tensor(t))
        self.pulled = True

    @torch.no_grad()
    def push(self) -> None:
        """Mirror: write every slot back into its tensor (a DTensor's local shard), then release
        the buffers' storage until the next `pull()`."""
        for t, v in zip(self.tensors, self.views, strict=True):
            local_tensor(t).copy_(v)
        self.pulled = False
        self.release()

    @torch.no_grad()
    def show(self) -> None:
        """Mirror: write every slot into its tensor and keep the buffers, so that the model
        computes with what they hold (a judge evaluating a candidate, `TrustedRound`)."""
        for t, v in zip(self.tensors, self.views, strict=True):
            local_tensor(t).copy_(v)

    def shard_group(self):
        """`shard_group_of` the tensors here."""
        return shard_group_of(self.tensors)

    def release(self) -> None:
        """Mirror: free the buffers' storage (the tensors hold the values); views and layout stay.
        A no-op in the rebinding mode, where the buffers are the tensors' storage."""
        if self.mirror:
            for b in self.buffers:
                b.untyped_storage().resize_(0)

    def _allocate(self) -> None:
        for b in self.buffers:
            size = b.numel() * b.element_size()
            if b.untyped_storage().nbytes() < size:
                b.untyped_storage().resize_(size)

    @property
    def released(self) -> bool:
        return self.mirror and any(
            b.untyped_storage().nbytes() < b.numel() * b.element_size() for b in self.buffers
        )

    @property
    def held_bytes(self) -> int:
        """Bytes the buffers hold now: `nbytes`, or 0 in mirror mode between steps."""
        return sum(
            min(b.untyped_storage().nbytes(), b.numel() * b.element_size()) for b in self.buffers
        )

    def current(self) -> list[torch.Tensor]:
        """The tensors' values laid out as the buffers: the buffers themselves unless they are
        released (mirror mode between steps), then a fresh copy that nothing keeps."""
        if not self.released:
            return self.buffers
        out = [torch.empty_like(b) for b in self.buffers]
        with torch.no_grad():
            for t, (g, offset, n) in zip(self.tensors, self.slots, strict=True):
                out[g][offset : offset + n].copy_(local_tensor(t).reshape(-1))
        return out

    @torch.no_grad()
    def assign(self, values: list[torch.Tensor]) -> None:
        """Set the tensors' values from `values`, laid out as the buffers (what `current()`
        gave): into the buffers, or, released (mirror mode between steps), into each tensor."""
        if not self.released:
            for b, v in zip(self.buffers, values, strict=True):
                b.copy_(v)
            return
        for t, (g, offset, n) in zip(self.tensors, self.slots, strict=True):
            local = local_tensor(t)
            local.copy_(values[g][offset : offset + n].view(local.shape))

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def is_bound(self) -> bool:
        """True while every tensor still lives in its buffer (`p.data = x` would unbind one);
        always in mirror mode, where no tensor lives in a buffer."""
        return self.mirror or all(
            t.data_ptr() == v.data_ptr() for t, v in zip(self.tensors, self.views, strict=True)
        )

    def replace(self, current: list[torch.Tensor]) -> None:
        """Follow tensor objects that were swapped out (`load_state_dict(assign=True)` puts new
        Parameters into the module): `current` lists the tensors in the original order."""
        current = _unique(current)
        if len(current) != len(self.tensors):
            raise ValueError(
                f"the module now has {len(current)} averaged tensors, the averager was built for "
                f"{len(self.tensors)}: build a new averager after adding or removing parameters"
            )
        self.tensors = current

    def rebind(self) -> Relayout | None:
        """Put every tensor that left its slot back: copy its current value into the slot, then
        make it a view again (one `data_ptr` compare per tensor). A tensor whose dtype, device or
        shape changed (`module.double()`) makes the buffers be rebuilt around the new layout;
        then the returned function converts state kept in the old layout (anchors), else None.
        Mirror mode rebinds nothing (`pull()` reads whatever the tensors hold)."""
        if self.mirror:
            return None
        relayout = False
        for t, v in zip(self.tensors, self.views, strict=True):
            if t.data_ptr() == v.data_ptr():
                continue
            if t.dtype == v.dtype and t.device == v.device and t.shape == v.shape:
                v.copy_(t.detach())
                t.data = v
            else:
                relayout = True
        if not relayout:
            return None
        old_slots = self.slots
        self._build()
        new_slots, new_buffers = self.slots, self.buffers

        def convert(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [torch.empty_like(b) for b in new_buffers]
            for (g0, o0, n0), (g1, o1, n1) in zip(old_slots, new_slots, strict=True):
                if n0 != n1:
                    raise ValueError("a tensor changed its number of elements: state is lost")
                new[g1][o1 : o1 + n1].copy_(old[g0][o0 : o0 + n0])
            return new

        return convert


def param_lead(flat: FlatBuffers) -> list[int]:
    """How many leading elements of each buffer are parameters: `averaged_tensors` lists the
    parameters first, so they lead every buffer; counted from the slots, which hold what this
    rank has of each (a sharded parameter's local shard)."""
    lead = [0] * len(flat.buffers)
    for t, (g, _, numel) in zip(flat.tensors, flat.slots, strict=True):
        lead[g] += numel if isinstance(t, torch.nn.Parameter) else 0
    return lead


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (e.g. an FSDP2 shard). Read from `sys.modules`: no DTensor
    exists before its module is imported, and importing it costs ~0.6 s a process here, which
    unsharded runs need not pay."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (a view of its storage), else `t`."""
    return t.to_local() if is_dtensor(t) else t


def shard_group_of(tensors: Iterable[torch.Tensor]):
    """The process group across which the DTensors among `tensors` are sharded (FSDP2's
    one-dimension mesh), or None when none is a DTensor. A whole tensor is the concatenation of
    its shards across this group, so a norm or a verdict over it needs that group."""
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if is_dtensor(t)}
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes.values())).ndim != 1:
        raise ValueError(
            "tensors sharded over more than one device mesh, or a mesh of more than one "
            "dimension (HSDP): a round over whole contributions is built for FSDP2's "
            "one-dimension shard mesh"
        )
    return next(iter(meshes.values())).get_group()


def holds_dtensor(tensors: Iterable[torch.Tensor]) -> bool:
    return any(is_dtensor(t) for t in tensors)


def averaged_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a model average covers: every floating-point parameter and buffer (BatchNorm's
    running statistics); integer tensors such as `num_batches_tracked` are left local."""
    params = [p for p in module.parameters() if torch.is_floating_point(p)]
    buffers = [b for b in module.buffers() if torch.is_floating_point(b)]
    return params + buffers
