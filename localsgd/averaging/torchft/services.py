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

from localsgd.averaging.stores import serving_store
from localsgd.averaging.torchft.heartbeat_gate import MANAGER_HEARTBEAT, gate_heartbeats


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
    """torchft's ManagerClient, keeping each quorum on the manager (`manager.localsgd_quorum`):
    whether a replica heals in this round (`TorchftCommunicator` waits for a heal with the
    process group's whole timeout, not the grace window). No rebuild of the process group is
    needed here after a round whose window ran out (gloo closes a timed-out op's connections):
    the lighthouse gives a new quorum id after any failed commit, and torchft reconfigures the
    group on a new id."""

    def __init__(self, manager):
        self._manager, self._client = manager, manager._client

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self._manager.localsgd_quorum = quorum
        return quorum

    def __getattr__(self, name):
        return getattr(self._client, name)


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
    gate=None,
    on_gate_change=None,
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
    is built with `use_async_quorum=False`; it keeps each quorum (`_QuorumRecorder`).

    `gate` (a `heartbeat_gate.HeartbeatGate`): the ManagerServer heartbeats once, and this rank's
    `GatedHeartbeats` thread (`manager.localsgd_heartbeats`, stopped by `manager.shutdown()`)
    heartbeats every `heartbeat_ms` while the gate is open (`on_gate_change(open, why)` when it
    closes or reopens); None: the ManagerServer's own heartbeats.
    """
    import torchft.manager as ft_manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    _quiet_flight_recorder()
    _quiet_peer_loss()
    lighthouse = lighthouse_url(lighthouse)

    store = None
    if store_addr is None:
        store = serving_store(host, timedelta(seconds=timeout_s))  # bound to `host` only
        store_addr, store_port = host, store.port
    timeout = timedelta(seconds=timeout_s)
    real_server = ft_manager.ManagerServer

    def bound_server(**kw):
        kw["bind"] = f"{host}:{kw['bind'].rsplit(':', 1)[1]}"
        return real_server(**kw)

    transport = _loopback_transport(host, timeout)
    # under a gate the ManagerServer heartbeats once; our thread heartbeats while it is open
    heartbeat = MANAGER_HEARTBEAT if gate is not None else timedelta(milliseconds=heartbeat_ms)
    with _patched(ft_manager, "ManagerServer", bound_server):
        manager = ft_manager.Manager(
            # NCCL for tensors on a GPU (torchft's own group, reconfigured at every quorum)
            pg=ProcessGroupNCCL(timeout=timeout)
            if device_type == "cuda"
            else ProcessGroupGloo(timeout=timeout),  # fmt: skip
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
            heartbeat_interval=heartbeat,
            checkpoint_transport=transport,
            init_sync=init_sync,
            **kwargs,
        )
    manager._localsgd_store = store
    manager.localsgd_quorum = None
    manager._client = _QuorumRecorder(manager)
    if gate is not None:
        group = (store_addr, store_port, rank, world_size) if world_size > 1 else None
        interval_s = heartbeat_ms / 1000
        gate_heartbeats(manager, gate, lighthouse, interval_s, timeout_s, group, on_gate_change)
    return manager
