"""How a worker and the syncer reach each other: messages (json) through a `Mailbox`, tensors
point-to-point through torch.distributed.

- `WorldLinks`: every worker in one torch.distributed world, the syncer on rank 0 of the
  workers' group (the plain launch and torchrun): one mailbox in the rendezvous store, one
  point-to-point group. With sharded replica groups each shard has its own: the ranks that hold
  it, one per replica group, its syncer on the first of them (ranks are the group's).
- `Sessions`: the syncer in a process that trains nothing (the launcher under `ft=torchft`),
  workers that die, restart and reconnect. The syncer hosts a TCPStore (bound to one interface);
  a worker *joins* by leaving its name there, and the two open a gloo group of their own (rank 0
  the syncer, rank 1 the worker) under a prefix no other session uses, with a mailbox beside
  it. A worker that died or was cut off leaves a session that fails; its next process, or the
  same one reconnecting, opens a new one. No protocol of our own beyond naming the session:
  torch.distributed's store and process groups do the rest.
- `WorkerLink`: the worker's end, of either kind (`world_link`, `join_session`).

Every operation has a deadline: a session's group its timeout, a mailbox its own. Under a
simulated slow link (`comm.simulate.bandwidth_gbps`, `latency_ms`: `Slowed`) every tensor
transfer lasts at least what the link allows, at each end.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from localsgd.averaging.asynchronous.mailbox import Mailbox
from localsgd.averaging.comm import SimulatedLink
from localsgd.averaging.stores import serving_store

SYNCER_ENV = "LOCALSGD_ASYNC_SYNCER"  # host:port of a hosted syncer's store (ft=torchft)
# what a failed session raises: gloo's errors, a store's, a deadline passed
LINK_ERRORS = (RuntimeError, TimeoutError, dist.DistError)
# the tags of a contribution to the syncer and of the global model back
TAG_PAYLOAD, TAG_VALUES = 71, 72
CLOSED = "closed"  # a session's key once the syncer dropped it


class Slowed:
    """A simulated slow link on point-to-point transfers (`simulated`, as `comm.simulate` slows
    the collectives): each tensor sent or received lasts at least the link's latency plus its
    bytes over the bandwidth, at each end. So one end's transfers queue one after another as on
    one network card: the syncer's, N - 1 contributions in and the global model out to each,
    where a synchronous round's all-reduce moves about twice the model per worker."""

    simulated: SimulatedLink | None = None
    timeout: timedelta

    def _move(self, op: str, group, peer: int, tensor: torch.Tensor, tag: int) -> None:
        """`group.send` or `group.recv` (`op`) of `tensor` with `peer` (a group rank; a
        virtual group's too: `virtual.VirtualGroup.send`), waited on with the link's timeout."""
        start = time.perf_counter()
        getattr(group, op)([tensor], peer, tag).wait(self.timeout)
        if self.simulated is not None:
            self.simulated.wait_out(start, tensor.numel() * tensor.element_size())


class WorkerLink(Slowed):
    """A worker's end: `mailbox` for messages, `send`/`recv` for tensors (host memory)."""

    def __init__(self, mailbox: Mailbox, group, peer: int, timeout_s: float, session: bool):
        self.mailbox, self.group, self.peer = mailbox, group, peer
        self.timeout = timedelta(seconds=timeout_s)
        self.session = session  # a group of two, opened by `join_session`

    def alive(self) -> None:
        """Raise where the syncer dropped this session (called while a message is awaited):
        a worker that was frozen or cut off past a transfer's deadline rejoins at once instead
        of waiting out its own deadline for an answer that never comes."""
        if self.session and self.mailbox.has(CLOSED):
            raise RuntimeError("asynchronous rounds: the syncer dropped this session")

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self._move("send", self.group, self.peer, tensor, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self._move("recv", self.group, self.peer, tensor, tag)

    def receive_model(self, work: list[torch.Tensor]) -> None:
        """The global model into `work` (through host memory: the groups are gloo's)."""
        for w in work:
            host = (
                w
                if w.device.type == "cpu" and w.is_contiguous()
                else torch.empty_like(w, device="cpu")
            )
            self.recv(host, TAG_VALUES)
            if host is not w:
                w.copy_(host)


def world_link(mailbox: Mailbox, group) -> WorkerLink:
    """A worker's end in one world: the syncer is `group`'s rank 0."""
    return WorkerLink(mailbox, group, 0, mailbox.timeout_s, session=False)


def join_session(address: str, worker: int, hello: dict, timeout_s: float) -> WorkerLink:
    """Open a session with the syncer at `address` (host:port of its store) as `worker`; `hello`
    (json) goes with the request. Raises where the syncer cannot be reached in `timeout_s`."""
    host, port = address.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    session = f"{worker}-{uuid.uuid4().hex[:12]}"
    index = store.add("joins", 1) - 1
    store.set(f"join/{index}", json.dumps({"worker": worker, "session": session, **hello}))
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{session}/", store), 1, 2, timeout)
    mailbox = Mailbox(store, f"s/{session}/", timeout_s)
    link = WorkerLink(mailbox, group, 0, timeout_s, session=True)
    link.store = store  # kept alive with the link
    return link


class WorldLinks(Slowed):
    """The syncer's ends in one world (it is rank 0): worker r is rank r of `group`."""

    sessions = False

    def __init__(self, mailbox: Mailbox, group, simulated: SimulatedLink | None = None):
        self.mailbox, self.group, self.simulated = mailbox, group, simulated
        self.timeout = timedelta(seconds=mailbox.timeout_s)

    def box(self, r: int) -> Mailbox:
        return self.mailbox

    def rung(self) -> int:
        return self.mailbox.rung()

    def send(self, r: int, tensor: torch.Tensor, tag: int) -> None:
        self._move("send", self.group, r, tensor, tag)

    def recv(self, r: int, tensor: torch.Tensor, tag: int) -> None:
        self._move("recv", self.group, r, tensor, tag)


class Sessions(Slowed):
    """The syncer's ends when it trains nothing and workers come and go (see the module doc):
    the store it hosts on `host` (an ephemeral port: `address`), each worker's current session.
    `timeout_s` bounds every transfer with a worker: one that stopped mid-transfer holds the
    syncer at most that long, and its session is dropped."""

    sessions = True

    def __init__(self, host: str, timeout_s: float, join_timeout_s: float = 60.0):
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        # bound to `host`: nobody elsewhere can join and take the model (`stores`)
        self.serving = serving_store(host, timedelta(seconds=600))
        self.store, port = self.serving.store, self.serving.port
        self.address = f"{host}:{port}"
        self.seen = 0  # join requests read so far
        self.open: dict[int, tuple[str, Mailbox, object]] = {}  # worker -> its session

    def joins(self) -> list[dict]:
        """The join requests left since the last call, oldest first."""
        count = self.store.add("joins", 0)
        out = []
        while self.seen < count:
            out.append(json.loads(self.store.get(f"join/{self.seen}")))
            self.store.delete_key(f"join/{self.seen}")
            self.seen += 1
        return out

    def accept(self, request: dict) -> None:
        """Open the session `request` names (its worker's earlier one is dropped)."""
        worker, session = request["worker"], request["session"]
        self.drop(worker)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"pg/{session}/", self.store), 0, 2,
            timedelta(seconds=self.join_timeout_s),
        )  # fmt: skip
        self.open[worker] = (session, Mailbox(self.store, f"s/{session}/", self.timeout_s), group)

    def drop(self, worker: int) -> None:
        """Worker's session is over: marked so (`WorkerLink.alive`), its group let go."""
        session = self.open.pop(worker, None)
        if session is not None:
            session[1].put(CLOSED, {})

    def connected(self, worker: int) -> bool:
        return worker in self.open

    def box(self, r: int) -> Mailbox:
        return self.open[r][1]

    def rung(self) -> int:
        """Any worker's doorbell, or a join: one store call each, summed."""
        return self.store.add("joins", 0) + sum(box.rung() for _, box, _ in self.open.values())

    def send(self, r: int, tensor: torch.Tensor, tag: int) -> None:
        self._move("send", self.open[r][2], 1, tensor, tag)  # the worker is the session's 1

    def recv(self, r: int, tensor: torch.Tensor, tag: int) -> None:
        self._move("recv", self.open[r][2], 1, tensor, tag)
