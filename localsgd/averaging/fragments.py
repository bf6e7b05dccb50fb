"""Streaming DiLoCo's fragments: how the model is split (`model_blocks`, `fragment_ids`) and
the per-fragment state and arithmetic (`Fragments`: anchors, outer optimizers, the values on the
wire, error-feedback residuals). `StreamingAverager` (`localsgd.averaging.streaming`, whose
docstring gives the semantics) schedules them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from itertools import chain

import torch
from torch import nn

from localsgd.averaging.comm import Communicator, PendingMean
from localsgd.averaging.compress import (
    MESSAGE_FORMATS,
    CommFormat,
    feed_back_,
    forget_nonfinite_,
    load_residuals,
    lossy_mean_,
    residual_buffers,
    wire_buffers,
)
from localsgd.averaging.flat import FlatBuffers, Relayout, averaged_tensors
from localsgd.averaging.offload import host_clone, host_empty_like
from localsgd.averaging.outer_step import outer_step
from localsgd.averaging.overlap import buckets, keep_progress_
from localsgd.averaging.reduce import Reducer

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


class Fragments(Reducer):
    """The per-fragment state and arithmetic of `StreamingAverager`: anchors, outer optimizers,
    the values on the wire. `regions[p]`: (buffer, start, start of its buffers, end) per flat
    buffer that holds part of fragment p. `host`: the anchors and outer momentum in host memory,
    each fragment's outer step run there (`localsgd.averaging.offload`)."""

    def __init__(
        self,
        flat: FlatBuffers,
        ids: list[int],
        is_param: list[bool],
        outer: dict | None,
        eager: bool,
        size: int,
        comm_dtype: CommFormat = torch.float32,
        error_feedback: bool = False,
        progress: bool = False,
        bucket_bytes: int | None = None,
        host: bool = False,
        feedback_decay: float = 1.0,
    ):
        self.feedback_decay = feedback_decay  # beta of `e <- beta e + d` (compress)
        self.anchored = outer is not None
        self.host = host and self.anchored
        # a delayed merge keeps this rank's progress since the launch (`merge_rule="progress"`)
        self.progress, self.bucket_bytes = progress, bucket_bytes
        fragments = max(ids, default=0) + 1
        self.eager, self.fragments = eager, fragments
        spans: dict[tuple[int, int], list[int]] = {}  # (fragment, buffer) -> [start, n, end]
        for i, (g, off, numel) in enumerate(flat.slots):
            span = spans.setdefault((ids[i], g), [off, off, off])
            span[1] += numel if is_param[i] else 0
            span[2] = off + numel
        self.regions = [
            [(g, s, n, e) for (q, g), (s, n, e) in sorted(spans.items()) if q == p]
            for p in range(fragments)
        ]
        keep = host_clone if self.host else (lambda b: b.detach().clone())
        self.anchors = [keep(b) for b in flat.buffers] if outer else []

        def new() -> list[Tensors]:
            return [[flat.buffers[g].new_empty(e - s) for g, s, _, e in rs] for rs in self.regions]

        self.sent = new()  # on the wire, in place: the values or pseudo-gradient, then its mean
        self.origins = new() if progress else []  # the local values at the launch
        # host: where a fragment's mean pseudo-gradient lands for its outer step
        self.staging = [[host_empty_like(t) for t in ts] for ts in self.sent] if self.host else []
        # per piece: None (sent as it is), a 16-bit copy or a `QuantizedWire`; error feedback's
        # residual (None where nothing is rounded)
        self.comm_dtype, self.error_feedback = comm_dtype, error_feedback
        self.quantized = isinstance(comm_dtype, MESSAGE_FORMATS)
        self.low = [wire_buffers(pieces, comm_dtype) for pieces in self.sent]
        self.residuals = [
            residual_buffers(pieces, low, error_feedback)
            for pieces, low in zip(self.sent, self.low, strict=True)
        ]
        self.flight: list[PendingMean | None] = [None] * fragments
        self.holding = [False] * fragments  # a launched mean not yet consumed
        self.pending_step = [-1] * fragments  # the step it was launched after
        self.pending_plain = [False] * fragments
        if eager:  # see the module docstring: received D, own previous d, scratch
            self.received, self.own, self.scratch = new(), new(), new()
            for own in self.own:
                for t in own:
                    t.zero_()
            # the M each own d was launched to (the live workers of that round, under torchft):
            # it is what removes this worker's share from the mean received for it
            self.own_size = [size] * fragments
        # the outer warmup (`outer.outer_step`), counted per fragment
        sgd = dict(outer or {})
        self.outer_warmup = sgd.pop("warmup_rounds", 0)
        self.optimizers: list[torch.optim.SGD | None] = []
        for rs in self.regions:
            params = [self.anchors[g][s:n] for g, s, n, _ in rs if n > s] if outer else []
            self.optimizers.append(torch.optim.SGD(params, **sgd) if params else None)

    # --- the wire ------------------------------------------------------------------------------

    def exchange(self, p: int, pieces: Tensors, comm: Communicator, blocking: bool):
        """The one place fragment p goes on the wire: each piece replaced in place by its mean
        over `comm`'s group; blocking, or launched (returns the handle to wait on). In fp32, a
        16-bit copy, or block-quantised (`Communicator.quantized_mean_`: the messages
        all-gathered, decoded and averaged in fp32 in rank order); blocking and launched give
        the same bits. With error feedback each piece's residual is added first and then holds
        what this rank failed to send."""
        lows, residuals = self.low[p], self.residuals[p]
        if blocking:
            for piece, low, residual in zip(pieces, lows, residuals, strict=True):
                lossy_mean_(piece, comm, low, residual, self.feedback_decay)
            return None
        for piece, residual in zip(pieces, residuals, strict=True):
            feed_back_(piece, residual, self.feedback_decay)
        if self.quantized:
            pending = comm.launch_quantized_mean_(pieces, lows, residuals)
        elif all(low is None for low in lows):
            return comm.launch_mean_(buckets(pieces, self.bucket_bytes))
        else:
            through = []
            for piece, low, residual in zip(pieces, lows, residuals, strict=True):
                if low is not None:
                    low.copy_(piece)
                    if residual is not None:
                        torch.sub(piece, low, out=residual)  # wanted - sent
                through.append(piece if low is None else low)
            pending = comm.launch_mean_(pieces, through=through)
        for residual in residuals:
            forget_nonfinite_(residual, comm)
        return pending

    def wait(self, p: int) -> None:
        if self.flight[p] is not None:
            self.flight[p].wait()
            self.flight[p] = None

    # --- the arithmetic ------------------------------------------------------------------------

    def _load(self, p: int, buffers: Tensors, out: Tensors, scale: float | None = None) -> None:
        """`anchor - local` (outer) or `local` (plain) of fragment p into `out`; times `scale`
        over the parameters, if given (a pseudo-gradient: outer only)."""
        for (g, s, n, e), o in zip(self.regions[p], out, strict=True):
            if self.host:  # the anchor staged through `out`: the same difference
                o.copy_(self.anchors[g][s:e]).sub_(buffers[g][s:e])
            elif self.anchored:
                torch.sub(self.anchors[g][s:e], buffers[g][s:e], out=o)
            else:
                o.copy_(buffers[g][s:e])
            if scale is not None:
                o[: n - s].mul_(scale)

    def _outer(self, p: int, grads: Tensors, plain: bool) -> Tensors | None:
        """Step fragment p's anchor by the (mean) pseudo-gradient `grads`; floating-point
        buffers (or everything, if `plain`) take it plainly. Host: `grads` are copied to the
        host for the step, then overwritten with the new anchor, which is returned: the global
        values on the buffers' device for the merge (None: the anchor itself is there)."""
        on_device = None
        if self.host:
            on_device, grads = grads, self.staging[p]
            for h, d in zip(grads, on_device, strict=True):
                h.copy_(d)
        for (g, s, n, e), d in zip(self.regions[p], grads, strict=True):
            start = 0 if plain else n - s
            self.anchors[g][s + start : e].sub_(d[start:])
        opt = self.optimizers[p]
        if opt is not None and not plain:
            views = [d[: n - s] for (_, s, n, _), d in zip(self.regions[p], grads, strict=True)]
            for param, d in zip(
                opt.param_groups[0]["params"], [v for v in views if v.numel()], strict=True
            ):
                param.grad = d
            outer_step(opt, self.outer_warmup)
        if on_device is not None:
            for (g, s, _, e), d in zip(self.regions[p], on_device, strict=True):
                d.copy_(self.anchors[g][s:e])
        return on_device

    def _merge(
        self,
        p: int,
        buffers: Tensors,
        alpha: float,
        delayed: bool = False,
        glob_on_device: Tensors | None = None,
    ) -> None:
        """local <- α·local + (1-α)·global (α=0: a copy), or, for a delayed merge under
        `progress`, local <- global + (local - local at the launch). The global values: the
        anchor, `glob_on_device` (a host anchor's copy, `_outer`), or the mean received."""
        for i, (g, s, _, e) in enumerate(self.regions[p]):
            if glob_on_device is not None:
                glob = glob_on_device[i]
            else:
                glob = self.anchors[g][s:e] if self.anchored else self.sent[p][i]
            local = buffers[g][s:e]
            if delayed and self.progress:
                keep_progress_(local, glob, self.origins[p][i])
            elif alpha == 0:
                local.copy_(glob)
            else:
                local.mul_(alpha).add_(glob, alpha=1 - alpha)

    # --- one round -----------------------------------------------------------------------------

    def blocking(
        self,
        p: int,
        buffers: Tensors,
        comm: Communicator,
        alpha: float,
        plain: bool,
        scale: float | None = None,
    ):
        """Fragment p's round, blocking; `scale` multiplies this rank's pseudo-gradient over
        the parameters first (a normalized weighted round: `StreamingAverager`)."""
        self._load(p, buffers, self.sent[p], scale)
        self.exchange(p, self.sent[p], comm, blocking=True)
        if self.eager:  # what every rank received, for common_tensors
            for r, d in zip(self.received[p], self.sent[p], strict=True):
                r.copy_(d)
        glob = self._outer(p, self.sent[p], plain) if self.anchored else None
        self._merge(p, buffers, alpha, glob_on_device=glob)

    def launch(
        self,
        p: int,
        buffers: Tensors,
        comm: Communicator,
        step: int,
        plain: bool,
        scale: float | None = None,
    ):
        """Fragment p's round, launched (merged by `finish`); `scale` as in `blocking`."""
        self._load(p, buffers, self.sent[p], scale)
        if self.progress:
            for (g, s, _, e), origin in zip(self.regions[p], self.origins[p], strict=True):
                origin.copy_(buffers[g][s:e])
        self.flight[p] = self.exchange(p, self.sent[p], comm, blocking=False)
        self.holding[p], self.pending_step[p], self.pending_plain[p] = True, step, plain

    def finish(self, p: int, buffers: Tensors, alpha: float) -> None:
        self.wait(p)
        glob = self._outer(p, self.sent[p], self.pending_plain[p]) if self.anchored else None
        self._merge(p, buffers, alpha, delayed=True, glob_on_device=glob)
        self.holding[p] = False

    def eager_round(self, p: int, buffers: Tensors, comm: Communicator, alpha: float, step: int):
        """One eager round of fragment p; returns whether a delayed mean was received."""
        self.wait(p)
        got = self.holding[p]
        if got:
            self.received[p], self.sent[p] = self.sent[p], self.received[p]
        else:
            for r, o in zip(self.received[p], self.own[p], strict=True):
                r.zero_()
                o.zero_()
        fresh, own = self.scratch[p], self.own[p]
        self._load(p, buffers, fresh)
        for wire, f in zip(self.sent[p], fresh, strict=True):
            wire.copy_(f)
        # M now, read from the communicator: under torchft the live workers of this round
        size, prev_size = comm.size, self.own_size[p]
        self.flight[p] = self.exchange(p, self.sent[p], comm, blocking=False)
        self.holding[p], self.pending_step[p] = True, step
        for o, r, f in zip(own, self.received[p], fresh, strict=True):
            o.div_(-prev_size).add_(r).add_(f, alpha=1 / size)  # D - d_prev/M' + d/M
        self.own_size[p] = size
        glob = self._outer(p, own, plain=False)
        self.own[p], self.scratch[p] = fresh, own  # the fresh d is the next round's d_prev
        self._merge(p, buffers, alpha, glob_on_device=glob)  # host: `own` holds the anchor
        return got

    def drop(self, p: int) -> None:
        """Forget fragment p's eager rounds (after a blocking average)."""
        self.wait(p)
        self.holding[p] = False

    # --- Reducer contract ------------------------------------------------------------------------

    def reset(self, buffers: Tensors) -> None:
        for flat, anchor in zip(buffers, self.anchors, strict=False):
            anchor.copy_(flat)
        for residual in chain.from_iterable(self.residuals):
            if residual is not None:
                residual.zero_()

    def relayout(self, convert: Relayout) -> None:
        raise ValueError(
            "a parameter changed dtype or device under streaming averaging: move the model "
            "(model.to(...)) before building the averager"
        )

    def state_dict(self) -> dict:
        for p in range(self.fragments):
            self.wait(p)
        state = {
            "anchors": [a.clone() for a in self.anchors],
            "optimizers": [o.state_dict() if o is not None else None for o in self.optimizers],
            "holding": list(self.holding),
            "pending_step": list(self.pending_step),
            "pending_plain": list(self.pending_plain),
            "sent": [
                [t.clone() if h else None for t in ts]
                for ts, h in zip(self.sent, self.holding, strict=True)
            ],
        }
        if self.eager:
            state["own"] = [[t.clone() for t in ts] for ts in self.own]
            state["own_size"] = list(self.own_size)
        if self.progress:
            state["origins"] = [
                [t.clone() if h else None for t in ts]
                for ts, h in zip(self.origins, self.holding, strict=True)
            ]
        if self.error_feedback:
            state["residuals"] = [
                [r.clone() if r is not None else None for r in rs] for rs in self.residuals
            ]
        return state

    def load_state_dict(self, state: dict) -> None:
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            if opt is not None:  # deep-copied: not sharing momentum with `state`
                opt.load_state_dict(copy.deepcopy(saved))
        self.flight = [None] * self.fragments
        self.holding = [bool(h) for h in state["holding"]]
        self.pending_step = [int(s) for s in state["pending_step"]]
        self.pending_plain = [bool(b) for b in state["pending_plain"]]
        for mine_all, saved_all in (
            (self.sent, state["sent"]),
            (self.origins, state.get("origins", [])),
        ):
            for ts, saved in zip(mine_all, saved_all, strict=True):
                for mine, value in zip(ts, saved, strict=True):
                    if value is not None:
                        mine.copy_(value)
        if self.eager:
            self.own_size = [int(m) for m in state.get("own_size", self.own_size)]
        for ts, saved in zip(getattr(self, "own", []), state.get("own", []), strict=True):
            for mine, value in zip(ts, saved, strict=True):
                mine.copy_(value)
        saved_residuals = state.get("residuals") or [None] * self.fragments
        for residuals, saved in zip(self.residuals, saved_residuals, strict=True):
            load_residuals(residuals, saved)
