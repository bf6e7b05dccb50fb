"""Streaming DiLoCo (Douillard et al. 2025) and eager outer steps (Kale et al. 2025).

**Fragments.** The averaged tensors are split into `fragments=P` fragments, strided by block:
the *blocks* are the children holding floating-point tensors of the `nn.ModuleList` or
`nn.Sequential` with the most such children anywhere in the module (ties: the outermost, i.e.
the first in `module.modules()` order), else the module's own such children; `blocks=` names
them explicitly. Fragment p takes blocks p, p+P, p+2P, ... (a tensor shared by blocks goes with
the first). Each tensor outside every block (embeddings, final norm, head), in the order of
`averaged_tensors`, goes to the fragment with the fewest elements so far (ties: the lowest
index). P=1 needs no blocks. In the flat buffers each fragment is one contiguous region per
buffer (its parameters, then its floating-point buffers), so a sync sends that region only.

**Schedule** (H = `period`, H % P == 0, τ = `delay_steps` < H/P). Fragment p is *launched*
after step s (from 0, torch's counter) when `s >= warmup_steps and (s - warmup_steps) % H ==
p*H/P`, and *merged* after step s + τ. P=1, τ=0 is `OuterAverager`'s rule. With τ=0 the
all-reduce blocks; with τ>0 it runs asynchronously while τ steps train (a simulated link's time
is waited out at the merge, only for what is left). τ < H/P: at most one fragment in flight.

    steps:       0 1 2 3 4 5 6 7 8 9 ...     H=8, P=4, warmup=0, τ=1: L launch, M merge
    fragment 0:  L M . . . . . . L M          (blocks 0, 4, 8, ...)
    fragment 1:  . . L M . . . . . . L M      (blocks 1, 5, 9, ...)
    fragment 2:  . . . . L M . . . . . .
    fragment 3:  . . . . . . L M . . . .

**What is merged** (per fragment, its own anchor and outer `torch.optim.SGD`, DiLoCo's lr 0.7,
momentum 0.9, Nesterov): at the launch the pseudo-gradient `anchor - local` goes on the wire; at
the merge its mean updates the anchor by the outer step (parameters; floating-point buffers take
the mean plainly; the fragment's first sync after a warmup is a plain average, as in
`OuterAverager`), and the local values become `α·local + (1-α)·anchor` with α = `merge_alpha`
and `local` the values at the merge (α=0: DiLoCo's replacement). `outer=False` is plain
averaging by fragment: the global value is the mean of the values launched.

**Eager** (`eager=True`, Kale et al. 2025, "eager updates"): the whole outer step overlaps the
next H steps. At fragment p's round t each worker m computes its fresh pseudo-gradient
`d_t = anchor_m - local`, launches its mean, receives the mean `D_{t-1}` launched at round
t-1 (zeros at the first round), and steps its outer optimizer at once with
`d_t/M + D_{t-1} - d_{t-1}/M`: its own fresh contribution plus the others' one-round-delayed
ones (M = world size). Anchors and outer states are then per worker; what every rank receives,
`D_{t-1}`, is identical. The first round after a warmup is a blocking plain average.

Replicas share bit for bit, after each merge, what `common_tensors()` returns: every anchor (not
eager), the merged fragment's values when α=0, or the mean received (plain, eager).

**Below fp32** (`comm_dtype`, outer steps only: the pseudo-gradient is what is rounded). Every
fragment goes on the wire through `Fragments.exchange`, one message per piece (the fragment's
region of one flat buffer). bfloat16/float16: the piece is cast to a 16-bit copy and all-reduced,
as `LowPrecisionMean` does. int8/float8_e4m3fn/int4/float4_e2m1 (`localsgd.averaging.quantize`,
one fp32 scale per `quant_block_size` values, blocks starting at the piece's start): each rank
encodes its piece, the messages are all-gathered (asynchronously when τ>0 and for eager rounds),
and every rank decodes them all and averages in fp32 in rank order, so all ranks get the same
bits, blocking or launched. A sync counts what this rank sends: payload plus scales (4 bits at
the default block: 0.133x fp32). `error_feedback` keeps one residual per piece (what this rank
wanted to send minus what its message decodes to), adds it to that fragment's next
pseudo-gradient before encoding, and checkpoints it. The final blocking `average()` of plain or
eager runs sends the whole model in fp32.

Memory beyond the model: the anchors and outer momentum, one fragment-sized wire buffer per
fragment (all fragments together: one model), three more with `eager`; below fp32, per piece the
wire's buffers (`QuantizedWire`: about two fp32 copies of the piece for float4_e2m1 and the
gathered messages) or a 16-bit copy, and a residual with `error_feedback`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging.averager import Averager
from localsgd.averaging.comm import CommStats, Communicator, PendingMean, SimulatedLink
from localsgd.averaging.compress import (
    CommFormat,
    comm_dtype_of,
    load_residuals,
    lossy_mean_,
    residual_buffers,
    wire_buffers,
)
from localsgd.averaging.flat import FlatBuffers, Relayout, averaged_tensors
from localsgd.averaging.quantize import DEFAULT_BLOCK_SIZE, BlockCodec
from localsgd.averaging.reduce import Reducer

Tensors = list[torch.Tensor]


def model_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `module`, as the module docstring defines them."""

    def holds(m: nn.Module) -> bool:
        return any(torch.is_floating_point(t) for t in chain(m.parameters(), m.buffers()))

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
    buffer that holds part of fragment p."""

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
    ):
        self.anchored = outer is not None
        fragments = max(ids, default=0) + 1
        self.eager, self.size, self.fragments = eager, size, fragments
        spans: dict[tuple[int, int], list[int]] = {}  # (fragment, buffer) -> [start, n, end]
        for i, (g, off, numel) in enumerate(flat.slots):
            span = spans.setdefault((ids[i], g), [off, off, off])
            span[1] += numel if is_param[i] else 0
            span[2] = off + numel
        self.regions = [
            [(g, s, n, e) for (q, g), (s, n, e) in sorted(spans.items()) if q == p]
            for p in range(fragments)
        ]
        self.anchors = [b.detach().clone() for b in flat.buffers] if outer else []

        def new() -> list[Tensors]:
            return [[flat.buffers[g].new_empty(e - s) for g, s, _, e in rs] for rs in self.regions]

        self.sent = new()  # on the wire, in place: the values or pseudo-gradient, then its mean
        # per piece: None (sent as it is), a 16-bit copy or a `QuantizedWire`; error feedback's
        # residual (None where nothing is rounded)
        self.comm_dtype, self.error_feedback = comm_dtype, error_feedback
        self.quantized = isinstance(comm_dtype, BlockCodec)
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
        self.optimizers: list[torch.optim.SGD | None] = []
        for rs in self.regions:
            params = [self.anchors[g][s:n] for g, s, n, _ in rs if n > s] if outer else []
            self.optimizers.append(torch.optim.SGD(params, **outer) if params else None)

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
                lossy_mean_(piece, comm, low, residual)
            return None
        for piece, residual in zip(pieces, residuals, strict=True):
            if residual is not None:
                piece.add_(residual)
        if self.quantized:
            return comm.launch_quantized_mean_(pieces, lows, residuals)
        if all(low is None for low in lows):
            return comm.launch_mean_(pieces)
        through = []
        for piece, low, residual in zip(pieces, lows, residuals, strict=True):
            if low is not None:
                low.copy_(piece)
                if residual is not None:
                    torch.sub(piece, low, out=residual)  # wanted - sent
            through.append(piece if low is None else low)
        return comm.launch_mean_(pieces, through=through)

    def wait(self, p: int) -> None:
        if self.flight[p] is not None:
            self.flight[p].wait()
            self.flight[p] = None

    # --- the arithmetic ------------------------------------------------------------------------

    def _load(self, p: int, buffers: Tensors, out: Tensors) -> None:
        """`anchor - local` (outer) or `local` (plain) of fragment p into `out`."""
        for (g, s, _, e), o in zip(self.regions[p], out, strict=True):
            if self.anchored:
                torch.sub(self.anchors[g][s:e], buffers[g][s:e], out=o)
            else:
                o.copy_(buffers[g][s:e])

    def _outer(self, p: int, grads: Tensors, plain: bool) -> None:
        """Step fragment p's anchor by the (mean) pseudo-gradient `grads`; floating-point
        buffers (or everything, if `plain`) take it plainly."""
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
            opt.step()

    def _merge(self, p: int, buffers: Tensors, alpha: float) -> None:
        """local <- α·local + (1-α)·global (α=0: a copy)."""
        for i, (g, s, _, e) in enumerate(self.regions[p]):
            glob = self.anchors[g][s:e] if self.anchored else self.sent[p][i]
            local = buffers[g][s:e]
            if alpha == 0:
                local.copy_(glob)
            else:
                local.mul_(alpha).add_(glob, alpha=1 - alpha)

    # --- one round -----------------------------------------------------------------------------

    def blocking(self, p: int, buffers: Tensors, comm: Communicator, alpha: float, plain: bool):
        self._load(p, buffers, self.sent[p])
        self.exchange(p, self.sent[p], comm, blocking=True)
        if self.eager:  # what every rank received, for common_tensors
            for r, d in zip(self.received[p], self.sent[p], strict=True):
                r.copy_(d)
        if self.anchored:
            self._outer(p, self.sent[p], plain)
        self._merge(p, buffers, alpha)

    def launch(self, p: int, buffers: Tensors, comm: Communicator, step: int, plain: bool):
        self._load(p, buffers, self.sent[p])
        self.flight[p] = self.exchange(p, self.sent[p], comm, blocking=False)
        self.holding[p], self.pending_step[p], self.pending_plain[p] = True, step, plain

    def finish(self, p: int, buffers: Tensors, alpha: float) -> None:
        self.wait(p)
        if self.anchored:
            self._outer(p, self.sent[p], self.pending_plain[p])
        self._merge(p, buffers, alpha)
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
        self.flight[p] = self.exchange(p, self.sent[p], comm, blocking=False)
        self.holding[p], self.pending_step[p] = True, step
        for o, r, f in zip(own, self.received[p], fresh, strict=True):
            o.div_(-self.size).add_(r).add_(f, alpha=1 / self.size)  # D - d_prev/M + d/M
        self._outer(p, own, plain=False)
        self.own[p], self.scratch[p] = fresh, own  # the fresh d is the next round's d_prev
        self._merge(p, buffers, alpha)
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
        for p, saved in enumerate(state["sent"]):
            for mine, value in zip(self.sent[p], saved, strict=True):
                if value is not None:
                    mine.copy_(value)
        for ts, saved in zip(getattr(self, "own", []), state.get("own", []), strict=True):
            for mine, value in zip(ts, saved, strict=True):
                mine.copy_(value)
        saved_residuals = state.get("residuals") or [None] * self.fragments
        for residuals, saved in zip(self.residuals, saved_residuals, strict=True):
            load_residuals(residuals, saved)


class StreamingAverager(Averager):
    """Streaming DiLoCo: `fragments` fragments synced in turn, each `delay_steps` late, merged
    with `merge_alpha`; `eager` overlaps the whole outer step; `outer=False` streams plain
    averages. Called once after every optimizer step, like every averager here. See the module
    docstring for the split, the schedule and the arithmetic; P=1, τ=0, α=0 is `OuterAverager`
    bit for bit. `module` is required (the blocks come from it)."""

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: nn.Module,
        fragments: int = 1,
        delay_steps: int = 0,
        merge_alpha: float = 0.0,
        eager: bool = False,
        outer: bool = True,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        blocks: Sequence[nn.Module] | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
        init_sync: bool | None = None,
        comm_dtype: str | torch.dtype | BlockCodec = torch.float32,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback: bool = False,
    ):
        if period < 1 or warmup_steps < 0 or fragments < 1:
            raise ValueError("period and fragments must be >= 1, warmup_steps >= 0")
        if period % fragments:
            raise ValueError(f"period={period} must be a multiple of fragments={fragments}")
        if not 0 <= delay_steps < period // fragments:
            raise ValueError(f"delay_steps must be in [0, period/fragments), got {delay_steps}")
        if not 0 <= merge_alpha < 1:
            raise ValueError(f"merge_alpha must be in [0, 1), got {merge_alpha!r}")
        if eager and (delay_steps or not outer):
            raise ValueError(
                "eager overlaps the whole outer step: it needs outer and delay_steps=0"
            )
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        if dtype != torch.float32 and not outer:
            raise ValueError(
                "comm_dtype below float32 needs outer=True under streaming: the pseudo-gradient "
                "is what is rounded (plain streaming sends the values themselves)"
            )
        if error_feedback and dtype == torch.float32:
            raise ValueError("error_feedback needs a comm_dtype below float32 (nothing is rounded)")
        self.comm_dtype = dtype  # what goes on the wire
        self.period, self.fragments, self.delay = period, fragments, delay_steps
        self.alpha, self.eager, self.outer = float(merge_alpha), eager, outer
        self.offset = period // fragments
        ids = fragment_ids(module, fragments, blocks)
        n_params = sum(1 for t in module.parameters() if torch.is_floating_point(t))
        self._order = sorted(range(len(ids)), key=lambda i: (ids[i], i >= n_params, i))
        self._param_ids: set[int] = set()
        self.last_fragment: int | None = None  # merged (or eagerly stepped) by the last step
        sgd = {"lr": outer_lr, "momentum": outer_momentum, "nesterov": outer_nesterov}

        def make(flat: FlatBuffers) -> Fragments:
            return Fragments(
                flat,
                [ids[i] for i in self._order],
                [i < n_params for i in self._order],
                sgd if outer else None,
                eager,
                comm.size,
                dtype,
                error_feedback,
            )

        comm = Communicator(process_group, stats, link)
        super().__init__(
            [comm],
            process_group,
            module=module,
            reducer=make,
            warmup_steps=warmup_steps,
            init_sync=init_sync,
        )

    @property
    def frags(self) -> Fragments:
        return self.reducer  # type: ignore[return-value]

    # --- binding in fragment order -------------------------------------------------------------

    def _bind(self, params: Tensors, tensors: Tensors) -> None:
        self._param_ids = {id(t) for t in params}
        super()._bind(params, [tensors[i] for i in self._order])

    def _follow_module(self) -> None:
        current = averaged_tensors(self.module)
        held = self._bound().tensors
        current = [current[i] for i in self._order]
        if len(current) != len(held) or any(a is not b for a, b in zip(current, held, strict=True)):
            self.flat.replace(current)
            self._param_ids = {id(t) for t in self.module.parameters()}

    def _check_params(self, given: Tensors) -> None:
        if {id(t) for t in given} != self._param_ids:
            raise ValueError(
                "average_parameters() got other parameters than the module's: build a new "
                "averager for other parameters"
            )

    # --- the schedule --------------------------------------------------------------------------

    def launching(self, step: int) -> int | None:
        """The fragment launched after step `step`, or None."""
        if step < self.warmup_steps:
            return None
        r = (step - self.warmup_steps) % self.period
        return None if r % self.offset else r // self.offset

    def merging(self, step: int) -> int | None:
        """The fragment merged (eager: stepped) after step `step`, or None."""
        return self.launching(step - self.delay)

    def level_at(self, step: int) -> int | None:
        return 0 if self.launching(step) is not None else None

    def period_of(self, level: int) -> int:
        return self.period

    def next_sync(self, step: int) -> int | None:
        s = max(step, self.warmup_steps + self.delay)
        while self.merging(s) is None:
            s += 1
        return s

    def averages_all(self, step: int) -> bool:
        return self.merging(step) is not None and self.fragments == 1 and not self.alpha

    # --- the rounds ----------------------------------------------------------------------------

    def maybe_average(self) -> bool:
        frags = self.frags
        self._bound()
        self.ensure_bound()
        self.merged, self.last_fragment, step = False, None, self.step
        buffers = self.flat.buffers
        q = self.merging(step) if self.delay else None
        if q is not None and frags.holding[q] and frags.pending_step[q] == step - self.delay:
            self._global_hooks("before")
            frags.finish(q, buffers, self.alpha)
            self._merged(q)
        p = self.launching(step)
        if p is not None:
            before = self.stats.bytes
            # fragment p's first sync after a warmup is a plain average
            plain = self.warmup_steps > 0 and step == self.warmup_steps + p * self.offset
            if self.delay:
                frags.launch(p, buffers, self.comm, step, plain)
            else:
                self._global_hooks("before")
                if self.eager and not plain:
                    got = frags.eager_round(p, buffers, self.comm, self.alpha, step)
                else:
                    frags.blocking(p, buffers, self.comm, self.alpha, plain)
                    got = True
                if got:
                    self._merged(p)
                else:
                    self._global_hooks("after")
            self.stats.rounds += 1
            self.level_stats[0].rounds += 1
            self.level_stats[0].bytes += self.stats.bytes - before
        self.all_in_sync = self.merged and self.fragments == 1 and not self.alpha and not self.eager
        self.step += 1
        return p is not None

    def _merged(self, p: int) -> None:
        self._run_hooks(self.comm)
        self._global_hooks("after")
        self.merged, self.last_fragment = True, p

    def average(self) -> None:
        """Blocking, outside the schedule (e.g. before the final evaluation): a fragment in
        flight is merged first; then every fragment takes one blocking outer step (plain if
        it has not synced since the warmup; `OuterAverager.average` for P=1), or, plain or
        eager, every rank takes the plain mean of the whole model (eager: the rounds in flight
        are waited for and dropped; the mean of the workers holds their contributions)."""
        frags = self.frags
        self.ensure_bound()
        buffers, before = self.flat.buffers, self.stats.bytes
        for p in range(self.fragments):
            if self.eager:
                frags.drop(p)
            elif frags.holding[p]:
                frags.finish(p, buffers, self.alpha)
        if self.outer and not self.eager:
            for p in range(self.fragments):
                plain = self.warmup_steps > 0 and self.step <= self.warmup_steps + p * self.offset
                frags.blocking(p, buffers, self.comm, 0.0, plain)
        else:
            for flat in buffers:
                self.comm.mean_(flat)
            frags.reset(buffers)
        self._run_hooks(self.comm)
        self.stats.rounds += 1
        self.level_stats[0].rounds += 1
        self.level_stats[0].bytes += self.stats.bytes - before
        self.all_in_sync = True

    def common_tensors(self) -> Tensors:
        """What every rank holds identically now (see the module docstring)."""
        if self.all_in_sync or not self.merged:
            return self._bound().buffers
        frags = self.frags
        p = self.last_fragment
        if self.eager:
            return list(frags.received[p])
        out = list(frags.anchors) if self.outer else list(frags.sent[p])
        if not self.alpha:
            out += [self.flat.buffers[g][s:e] for g, s, _, e in frags.regions[p]]
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fragments": self.fragments}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("fragments", self.fragments)) != self.fragments:
            raise ValueError(
                f"the checkpoint has fragments={state['fragments']}, this run {self.fragments}"
            )
        super().load_state_dict(state)
