"""torchft's services for one replica group, each bound to one interface (127.0.0.1 unless told
otherwise): the lighthouse, the Manager's server and the HTTP server a healing replica fetches a
live peer's state from. torchft binds the last two to every interface by default and advertises
the machine's hostname; here both use `host`.

torchft is imported only by the functions here, never at module import.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def lighthouse_url(address: str) -> str:
    """`host:port` (as `torchft_lighthouse --bind` takes it) or `http://host:port`, as
    torchft's Manager wants it."""
    return address if "://" in address else f"http://{address}"


def start_lighthouse(
    min_replicas: int,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    join_timeout_ms: int = 60_000,
    quorum_tick_ms: int = 50,
    heartbeat_timeout_ms: int = 2_000,
) -> tuple[Any, str]:
    """Start torchft's Lighthouse in this process, bound to `host:port` (0: a free port).

    Returns `(server, address)`; `server.shutdown()` stops it. The address names `host`
    (torchft's own `address()` names the machine's hostname, which may resolve elsewhere).
    `min_replicas` is the size of every quorum at least, so with W it makes the first quorum
    wait for all W replicas: nobody trains alone at the start.
    """
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    bound_port = int(server.address().rsplit(":", 1)[1])
    return server, f"http://{host}:{bound_port}"


def _loopback_transport(host: str, timeout: timedelta):
    """torchft's HTTPTransport (the checkpoint server a healing replica fetches from), bound to
    `host` instead of every interface and advertising `host` instead of the hostname."""
    import socket
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as http_transport

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

        def __init__(self, server_address, handler):
            class QuietHandler(handler):
                def log_message(self, *args) -> None:  # no access log line per heal
                    pass

            super().__init__((host, server_address[1]), QuietHandler)

    class Transport(http_transport.HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            name = f"[{host}]" if ":" in host else host
            return f"http://{name}:{port}/checkpoint/"

    with _patched(http_transport, "_IPv6HTTPServer", Server):
        return Transport(timeout=timeout, num_chunks=0)


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _patched(module, name: str, value):
    with _PATCH_LOCK:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)


def _drop_flight_recorder(record) -> bool:
    return "flight recorder" not in record.getMessage()


def _quiet_flight_recorder() -> None:
    """torchft warns at every reconfiguration that NCCL's flight recorder cannot be reset, which
    concerns NCCL debugging traces only (and says so on every CPU quorum): drop that line. Its
    manager's INFO lines (one per commit) are off unless its logger's level was set."""
    import logging

    logger = logging.getLogger("torchft.manager")
    if _drop_flight_recorder not in logger.filters:
        logger.addFilter(_drop_flight_recorder)
    if logger.level == logging.NOTSET:  # a line per commit at INFO (torchrun logs INFO)
        logger.setLevel(logging.WARNING)


# What gloo says when a peer's process is gone mid-collective (pair.cc's read/write errors).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _drop_peer_gone(record) -> bool:
    """False for torchft's tracebacks of a collective that failed because a peer died: torchft
    reports the error to its Manager, the round fails and is retried without that peer, and the
    launcher says in one line which worker died. Any other error torchft caught (e.g. gloo's
    timeout waiting for a peer) still shows, as its one line: torchft handled it the same way,
    so a traceback would only make it look like a crash."""
    if not record.exc_info:
        return True
    if any(phrase in str(record.exc_info[1]) for phrase in _PEER_GONE):
        return False
    record.exc_info = record.exc_text = None
    return True


def _quiet_peer_loss() -> None:
    import logging

    for name in ("torchft.manager", "torchft.process_group"):
        logger = logging.getLogger(name)
        if _drop_peer_gone not in logger.filters:
            logger.addFilter(_drop_peer_gone)


class _QuorumRecorder:
    """torchft's ManagerClient, keeping each quorum on the manager (`manager.localsgd_quorum`:
    who heals in it) and rebuilding the process group after a failed round.

    gloo closes an op's connections when it times out (a round that ran out of its grace
    window), so the process group is dead after it; torchft rebuilds it only when the quorum's
    members change (a frozen peer dropped), not when they stay (a slow one). With the same
    members, the round before failed everywhere when the highest step did not move, and on some
    member when one is behind: every member sees the same two quorums, so all of them rebuild,
    each time under store keys of their own (`_fresh_store_prefix`)."""

    def __init__(self, manager):
        self._manager, self._client = manager, manager._client
        self._last: tuple[int, int] | None = None  # the last quorum's (id, highest step)
        self._rebuilds = 0  # forced rebuilds under the current quorum id

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        manager = self._manager
        manager.localsgd_quorum = quorum
        last, self._last = self._last, (quorum.quorum_id, quorum.max_step)
        if last is None or last[0] != quorum.quorum_id:
            self._rebuilds = 0  # torchft rebuilds on a new id, under keys of that id
            manager._pg.store_suffix = ""
        elif last[1] == quorum.max_step or quorum.max_world_size < quorum.replica_world_size:
            self._rebuilds += 1
            manager._pg.store_suffix = f"rebuild_{self._rebuilds}"
            manager._quorum_id = -1  # torchft reconfigures when the id differs from its own
        return quorum

    def __getattr__(self, name):
        return getattr(self._client, name)


def _fresh_store_prefix(pg_class):
    """`pg_class` whose rendezvous after a failed round uses keys of its own: the quorum id is
    unchanged, so torchft's prefix would hold the dead group's addresses."""

    class _FreshStorePrefix(pg_class):
        store_suffix = ""

        def configure(self, store_addr: str, *args, **kwargs) -> None:
            if self.store_suffix:
                store_addr = f"{store_addr}/{self.store_suffix}"
            super().configure(store_addr, *args, **kwargs)

    return _FreshStorePrefix


def make_manager(
    *,
    replica_id: str,
    lighthouse: str,
    min_replicas: int = 1,
    store_addr: str | None = None,
    store_port: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    host: str = "127.0.0.1",
    timeout_s: float = 30.0,
    quorum_timeout_s: float = 60.0,
    connect_timeout_s: float = 10.0,
    heartbeat_ms: int = 100,
    init_sync: bool = False,
    device_type: str = "cpu",
    **kwargs,
):
    """A torchft `Manager` for one rank of a replica group, every server bound to `host`.

    The Manager needs the replica group's TCPStore (`store_addr:store_port`); with none given
    a store is hosted here (enough for a single-process replica group) and kept on the manager
    as `manager._localsgd_store`. Rank 0 of the group runs the ManagerServer (torchft binds it
    to every interface; here to `host`), and every rank an HTTP checkpoint server (bound to `host`).

    `replica_id` should end in digits that order the replicas as the plain path orders ranks
    (`"replica_03"`): torchft sorts quorum members by id string and derives ranks from the
    trailing digits. `init_sync=False`: replicas start identical (seeded) and nobody heals at
    step 0. `device_type` "cuda": the replicas' tensors live on GPUs and average through
    torchft's NCCL process group (gloo otherwise). Extra `kwargs` go to `Manager`. The Manager
    is built with `use_async_quorum=False`. Its process group is rebuilt after every failed
    round (`_QuorumRecorder`), so that a round whose grace window ran out leaves no dead group.
    """
    import torchft.manager as ft_manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    _quiet_flight_recorder()
    _quiet_peer_loss()
    lighthouse = lighthouse_url(lighthouse)

    store = None
    if store_addr is None:
        store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        store_addr, store_port = host, store.port
    timeout = timedelta(seconds=timeout_s)
    real_server = ft_manager.ManagerServer

    def bound_server(**kw):
        kw["bind"] = f"{host}:{kw['bind'].rsplit(':', 1)[1]}"
        return real_server(**kw)

    transport = _loopback_transport(host, timeout)
    with _patched(ft_manager, "ManagerServer", bound_server):
        manager = ft_manager.Manager(
            # NCCL for tensors on a GPU (torchft's own group, reconfigured at every quorum)
            pg=_fresh_store_prefix(ProcessGroupNCCL)(timeout=timeout)
            if device_type == "cuda"
            else _fresh_store_prefix(ProcessGroupGloo)(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s),
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
            heartbeat_interval=timedelta(milliseconds=heartbeat_ms),
            checkpoint_transport=transport,
            init_sync=init_sync,
            **kwargs,
        )
    manager._localsgd_store = store
    manager.localsgd_quorum = None
    manager._client = _QuorumRecorder(manager)
    return manager
