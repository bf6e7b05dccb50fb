"""Virtual workers: M workers as M threads of one process, joined in a process group of threads.

`dist.virtual_workers=M` runs each worker's whole training loop (the same `Trainer`, averagers,
round pipelines and codecs) in a thread of its own, with `torch.distributed` calls going to the
`VirtualGroup` below instead of gloo. Three things make the threads behave as M processes:

- **One thread runs at a time** (`Baton`): a worker runs until it calls a collective, then hands
  the baton to the next worker, in rank order, whose collective is complete (or that has not
  called one). Nothing two workers do between collectives can interleave, so the run is
  deterministic and needs one core. A worker that waits for a message another thread leaves
  (asynchronous rounds' syncer: `wait_outside`, `poke`) hands the baton on the same way; the
  syncer's thread is no worker and runs beside the one that holds it.
- **Each worker keeps its own random state**: at every hand-off the process's torch, Python and
  NumPy generators are saved for the worker that stops and restored for the one that resumes, so
  `torch.manual_seed` in one worker never moves another's draws.
- **The reductions add in gloo's order** (`gloo_ring_sum_`): gloo's ring all-reduce (gloo's
  `allreduce.cc`; what torch's gloo backend returned at every size measured) cuts the buffer into
  one chunk per rank and sums chunk c as rank c-1's values, plus rank c-2's, ..., plus rank c's;
  AVG divides that sum by the size. Reproducing the order gives gloo's bits where the order
  matters too, from 3 ranks on (tests/test_virtual.py checks 2 to 5 ranks against gloo).
  All-gathers and broadcasts copy bytes, and the gathered wires decode in rank order anyway.

The group is a Python `ProcessGroup`, registered as the `virtual` backend; each thread has its
own view of `torch.distributed`'s world (torch's `ThreadLocalWorld`, the one its DTensor tests
use), so `dist.get_rank()`, `new_subgroups_by_enumeration` and `all_gather_object` work per
worker unchanged. A collective launched with `async_op=True` completes at the launch (every
member has joined by the time its caller runs again), which no caller can tell from a fast one.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from localsgd.averaging.comm import VIRTUAL_BACKEND


class VirtualWorkerAborted(RuntimeError):
    """Another virtual worker failed: this one stops at its next collective."""


# gloo's ring all-reduce (gloo/allreduce.cc, `ring`): the buffer is cut into numSegments
# segments, numSegments the smallest multiple of the size >= max(2 * size, bytes /
# maxSegmentSize), rank c owning the c-th run of numSegments / size of them. torch's gloo
# backend runs it with segments of at most 1 MiB: of 256 KiB to 16 MiB, only 1 MiB gave gloo's
# bits at 3-5 ranks and 8M-20M fp32 values (measured 2026-12-05; tests/test_virtual.py).
MAX_SEGMENT_BYTES = 1 << 20


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def ring_chunks(numel: int, element_size: int, size: int) -> list[tuple[int, int]]:
    """The element ranges [start, stop) of chunk 0..size-1 of gloo's ring all-reduce."""
    total = numel * element_size
    max_segment = element_size * max(1, MAX_SEGMENT_BYTES // element_size)
    segments = _ceil_div(max(_ceil_div(total, max_segment), 2 * size), size) * size
    segment_bytes = _ceil_div(total, segments)
    segment_bytes = _ceil_div(segment_bytes, element_size) * element_size  # whole values
    per_chunk = (segments // size) * segment_bytes // element_size
    return [(min(c * per_chunk, numel), min((c + 1) * per_chunk, numel)) for c in range(size)]


@torch.no_grad()
def gloo_ring_sum_(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of `tensors` (one per rank, in rank order) with gloo's bits: chunk c of the
    ring is rank c-1's values, plus rank c-2's, ..., plus rank c's (floating-point addition
    is commutative, so only the sequence of partial sums matters). Returns a new tensor."""
    size = len(tensors)
    flats = [t.reshape(-1) for t in tensors]
    out = flats[0].clone()
    if size == 1:
        return out.view_as(tensors[0])
    for c, (start, stop) in enumerate(ring_chunks(out.numel(), out.element_size(), size)):
        if start == stop:
            continue
        acc = out[start:stop]
        acc.copy_(flats[(c - 1) % size][start:stop])
        for k in range(2, size + 1):
            acc.add_(flats[(c - k) % size][start:stop])
    return out.view_as(tensors[0])


class _Done(dist.Work):
    """A point-to-point transfer done when it returns (waited on with or without a timeout)."""

    def wait(self, timeout=None) -> bool:
        return True


def _work(result: Any = None):
    fut: Future = Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class _Collective:
    """One collective of one group, filled in as its members join."""

    def __init__(self, size: int, run: Callable[[list], None]):
        self.data: list = [None] * size
        self.joined = 0
        self.run = run
        self.done = False


class _Outside:
    """A worker waiting for something no collective brings: a message another thread leaves
    (asynchronous rounds' syncer); runnable once `ready()`."""

    def __init__(self, ready: Callable[[], bool]):
        self.ready = ready

    @property
    def done(self) -> bool:
        return self.ready()


_batons: set[Baton] = set()  # the jobs running, for `poke`


class Baton:
    """The virtual workers of one job: who runs, who waits in which collective, and each
    one's random state. Every method is called with `cond` held, except `enter`/`leave`."""

    def __init__(self, size: int, timeout_s: float):
        self.size, self.timeout_s = size, timeout_s
        self.cond = threading.Condition()
        self.turn = 0
        self.waiting: list[_Collective | None] = [None] * size
        self.finished = [False] * size
        self.failure: tuple[int, BaseException] | None = None
        self.pending: dict[str, _Collective] = {}
        state = _random_state()
        self.random_states = [state] * size

    def _runnable(self, rank: int) -> bool:
        waiting = self.waiting[rank]
        return not self.finished[rank] and (waiting is None or waiting.done)

    def _hand_on(self, rank: int) -> None:
        """Give the baton to the next runnable worker after `rank` (itself last)."""
        self.random_states[rank] = _random_state()
        for k in range(1, self.size + 1):
            nxt = (rank + k) % self.size
            if self._runnable(nxt):
                self.turn = nxt
                self.cond.notify_all()
                return
        self.turn = -1
        outside = any(isinstance(w, _Outside) for w in self.waiting)
        if not all(self.finished) and self.failure is None and not outside:
            stuck = [r for r in range(self.size) if not self.finished[r]]
            self.failure = (rank, RuntimeError(f"virtual workers {stuck} wait on each other"))
        self.cond.notify_all()

    def _wait_turn(self, rank: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.failure is None and not (self.turn == rank and self._runnable(rank)):
            if self.turn == -1 and self._claim():  # nobody held it: the first one ready
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                self.failure = (rank, TimeoutError(
                    f"virtual worker {rank}: a collective waited longer than {self.timeout_s} s"
                ))  # fmt: skip
                self.cond.notify_all()
                break
            # a worker waiting outside the collectives is woken by `poke`; polled as well
            self.cond.wait(min(left, 0.05))
        if self.failure is not None:
            failed, error = self.failure
            if failed == rank:
                raise error
            raise VirtualWorkerAborted(f"virtual worker {failed} failed: {error}")
        _set_random_state(self.random_states[rank])

    def _claim(self) -> bool:
        ready = [r for r in range(self.size) if self._runnable(r)]
        if ready:
            self.turn = ready[0]
            self.cond.notify_all()
        return bool(ready)

    def wait_outside(self, rank: int, ready: Callable[[], bool]) -> None:
        """Worker `rank` waits for `ready()`, something another thread brings: the others run
        meanwhile; it runs again once ready and its turn has come."""
        with self.cond:
            if ready():
                return
            self.waiting[rank] = _Outside(ready)
            self._hand_on(rank)
            self._wait_turn(rank)
            self.waiting[rank] = None

    def enter(self, rank: int) -> None:
        """A worker's thread starts: wait for the baton."""
        with self.cond:
            self._wait_turn(rank)

    def leave(self, rank: int, error: BaseException | None) -> None:
        """A worker's thread ends (returned, or raised `error`): hand the baton on."""
        with self.cond:
            self.finished[rank] = True
            if error is not None and self.failure is None:
                self.failure = (rank, error)
            self._hand_on(rank)

    def join(self, rank: int, key: str, index: int, size: int, data, run) -> None:
        """Worker `rank`, member `index` of a group of `size` named `key`, joins its collective
        with `data`; the last to join runs `run(data of every member)`. Returns when it is done
        and this worker's turn has come again."""
        with self.cond:
            coll = self.pending.get(key)
            if coll is None:
                coll = self.pending[key] = _Collective(size, run)
            coll.data[index] = data
            coll.joined += 1
            self.waiting[rank] = coll
            if coll.joined == size:
                del self.pending[key]
                coll.run(coll.data)
                coll.done = True
            self._hand_on(rank)
            self._wait_turn(rank)
            self.waiting[rank] = None


def _random_state() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_random_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


_thread = threading.local()  # the running worker's (baton, rank)


def bind_thread(baton: Baton, rank: int) -> None:
    """Make this thread virtual worker `rank` of `baton`'s job (before it joins the group)."""
    _thread.baton, _thread.rank = baton, rank


def wait_outside(ready: Callable[[], bool]) -> bool:
    """On a virtual worker's thread: hand the baton on until `ready()` (a message another
    thread leaves), then take it back, and return True; elsewhere False (the caller polls)."""
    baton = getattr(_thread, "baton", None)
    if baton is None:
        return False
    baton.wait_outside(_thread.rank, ready)
    return True


def poke() -> None:
    """Something a worker may wait for outside the collectives arrived (`wait_outside`)."""
    for baton in list(_batons):
        with baton.cond:
            baton.cond.notify_all()


def _reduce(op, tensors: list[torch.Tensor]) -> torch.Tensor:
    if op == dist.ReduceOp.SUM:
        return gloo_ring_sum_(tensors)
    if op == dist.ReduceOp.AVG:  # gloo: the ring sum, divided by the size
        return gloo_ring_sum_(tensors).div_(len(tensors))
    if op == dist.ReduceOp.MAX:
        return torch.stack(tensors).amax(0)
    if op == dist.ReduceOp.MIN:
        return torch.stack(tensors).amin(0)
    raise NotImplementedError(f"virtual workers: all_reduce with {op} is not supported")


class VirtualGroup(dist.ProcessGroup):
    """A process group of virtual workers (threads of this process), with gloo's reduction
    order. Supports what localsgd calls: all_reduce (SUM, AVG, MAX, MIN), all_gather (list and
    single tensor), broadcast, barrier, and send/recv."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.baton: Baton = _thread.baton
        self._ctx = torch.autograd.set_multithreading_enabled(False)

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return VIRTUAL_BACKEND

    def _join(self, data, run):
        key = dist.distributed_c10d._world.pg_names[self]
        self.baton.join(_thread.rank, key, self._rank, self._size, data, run)
        return _work(data)

    def allreduce(self, tensor_list, opts=None):
        op = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp

        @torch.no_grad()
        def run(data):
            for i in range(len(data[0])):
                result = _reduce(op, [member[i] for member in data])
                for member in data:
                    member[i].detach().copy_(result)

        return self._join(tensor_list, run)

    allreduce_coalesced = allreduce

    def allgather(self, output_tensors, input_tensor, opts=None):
        @torch.no_grad()
        def run(data):
            for src, (_, inputs) in enumerate(data):
                for outputs, _ in data:
                    outputs[0][src].detach().copy_(inputs[0])

        return self._join((output_tensors, input_tensor), run)

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        return self.allgather([list(output_tensor.chunk(self._size))], [input_tensor], opts)

    _allgather_base = all_gather_single

    def broadcast(self, tensor_list, opts=None):
        root = opts.rootRank

        @torch.no_grad()
        def run(data):
            for member in data:
                if member is not data[root]:
                    for out, src in zip(member, data[root], strict=True):
                        out.detach().copy_(src)

        return self._join(tensor_list, run)

    def barrier(self, opts=None):
        return self._join(None, lambda data: None)

    # point-to-point (asynchronous rounds' syncer and workers): a queue in the group's store
    # per sender, receiver and tag, the bytes copied; a receive on a worker's thread hands the
    # baton on while it waits, one on another thread (the syncer's) polls

    def send(self, tensors, dst: int, tag: int):
        for t in tensors:
            data = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
            self._store.queue_push(f"p2p/{self._rank}/{dst}/{tag}", data)
        poke()
        return _Done()

    def recv(self, tensors, src: int, tag: int):
        key = f"p2p/{src}/{self._rank}/{tag}"
        for t in tensors:
            if not wait_outside(lambda: self._store.queue_len(key) > 0):
                deadline = time.monotonic() + self.baton.timeout_s
                while self._store.queue_len(key) == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"virtual workers: nothing from {src} on tag {tag}")
                    time.sleep(1e-4)
            data = bytearray(self._store.queue_pop(key, False))
            t.detach().view(torch.uint8).view(-1).copy_(torch.frombuffer(data, dtype=torch.uint8))
        return _Done()

    def __repr__(self) -> str:
        return f"VirtualGroup(rank={self._rank}, size={self._size})"


def _create_group(store, rank: int, size: int, timeout) -> VirtualGroup:
    group = VirtualGroup(rank, size)
    group._store = store  # the group's own prefix of the job's store (its point-to-point)
    return group


_registered = False


@contextlib.contextmanager
def thread_worlds():
    """While inside: the `virtual` backend is registered and each thread has its own view of
    torch.distributed's world (groups, ranks, group names); the process's own view is restored
    on the way out, so that gloo groups made afterwards in this process are unaffected."""
    global _registered
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    if not _registered:
        dist.Backend.register_backend(VIRTUAL_BACKEND, _create_group, devices=["cpu"])
        _registered = True
    c10d = dist.distributed_c10d
    previous = c10d._world
    c10d._world = ThreadLocalWorld()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # group names per thread
    try:
        yield
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        c10d._world = previous


def run_virtual(fn: Callable[..., Any], size: int, timeout_s: float, args: tuple = ()) -> list[Any]:
    """`fn(rank, baton, *args)` in `size` threads that take turns (`Baton`); returns what each
    returned, in rank order. Raises the first failing worker's error, with its rank in
    `error.virtual_rank`; the others stop at their next collective."""
    baton = Baton(size, timeout_s)
    _batons.add(baton)
    results: list[Any] = [None] * size

    def body(rank: int) -> None:
        bind_thread(baton, rank)
        error = None
        try:
            baton.enter(rank)
            results[rank] = fn(rank, baton, *args)
        except BaseException as e:  # noqa: BLE001  (handed to the launcher, which raises it)
            error = e
        finally:
            baton.leave(rank, error)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"virtual-worker-{r}", daemon=True)
        for r in range(size)
    ]
    with thread_worlds():
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            _batons.discard(baton)
    if baton.failure is not None:
        rank, error = baton.failure
        error.virtual_rank = rank  # type: ignore[attr-defined]
        raise error
    return results
