"""`ft=torchft` on one machine: its checks, and the supervisor that runs the replica groups.

Every worker is a replica group of one process. The launching process starts torchft's
lighthouse (bound to `ft.host`, 127.0.0.1 unless told otherwise) unless `ft.lighthouse` names a
running one, then forks the W workers. A worker that dies is restarted, up to `ft.max_restarts`
times; the new process heals from a live peer at the next sync (`localsgd.loop.fault_tolerance`).
A worker out of restarts is lost for good: the others finish without it, as long as a quorum of
`ft.min_replicas` remains.

torchft is imported only when a run asks for it (`start_lighthouse`, inside the workers).
"""

from __future__ import annotations

import http.client
import importlib.util
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from localsgd.averaging.torchft.services import lighthouse_url
from localsgd.config import FT_BACKENDS, ConfigError
from localsgd.loop.metrics import notice
from localsgd.loop.plan import SyncPlan
from localsgd.loop.worker import WorkerInfo


def check_reachable(address: str, timeout_s: float) -> None:
    """One line, and exit 2 through ConfigError, unless a torchft lighthouse answers at
    `address`. A TCP connection alone is not enough: with something else listening there, every
    worker would wait ft.quorum_timeout_s and then say only `no quorum`. The lighthouse serves
    its dashboard over HTTP on the port of its gRPC service; `GET /` names it."""
    url = urlparse(lighthouse_url(address))
    try:
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ConfigError(
            f"ft.lighthouse must be HOST:PORT of a torchft lighthouse, got {address!r}"
        )
    start_one = (
        f"start one there (torchft_lighthouse --min_replicas N --bind {host}:{port}) or leave "
        f"ft.lighthouse empty to start one here"
    )
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        try:
            conn.connect()
        except OSError as e:
            raise ConfigError(
                f"ft.lighthouse: no torchft lighthouse answers at {host}:{port} "
                f"({e.strerror or e}); {start_one}"
            ) from None
        try:
            conn.request("GET", "/")
            response = conn.getresponse()
            body = response.read(1 << 16).decode("utf-8", "replace")
        except TimeoutError:
            what = f"something accepts connections but sent no answer in {timeout_s:g} s"
        except (OSError, http.client.HTTPException) as e:
            what = f"something that does not speak HTTP answered ({type(e).__name__}: {e})"
        else:
            if response.status == 200 and all(w in body.lower() for w in ("lighthouse", "torchft")):
                return
            title = re.search(r"<title>\s*(.*?)\s*</title>", body, re.I | re.S)
            server = response.getheader("Server")
            what = (
                f"an HTTP server answered GET / with {response.status} {response.reason}"
                + (f", {server}" if server else "")
                + (f", titled {title.group(1)[:60]!r}" if title else "")
            )
        raise ConfigError(
            f"ft.lighthouse: {host}:{port} is not a torchft lighthouse: {what}; {start_one}"
        )
    finally:
        conn.close()


def validate_ft(cfg: Any, get: Callable[[Any, str], Any], world_size: int | None) -> None:
    """The `ft` keys: their values and the layout of replica groups they describe (what else
    torchft does not combine with is a row of `localsgd.cli.refusals`)."""
    backend = get(cfg, "ft.backend")
    if backend not in FT_BACKENDS:
        raise ConfigError(f"ft.backend must be one of {', '.join(FT_BACKENDS)}, got {backend!r}")
    if backend == "none":
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "ft=torchft needs torchft: pip install torchft==0.2.0 (make install does), or drop ft="
        )
    from localsgd.cli.forkserver import under_torchrun

    replica_id, groups = get(cfg, "ft.replica_id"), get(cfg, "ft.replica_groups")
    if under_torchrun():
        if not get(cfg, "ft.lighthouse"):
            raise ConfigError(
                "ft.lighthouse must be HOST:PORT of the torchft_lighthouse every machine joins "
                "under torchrun, got ''"
            )
        if not isinstance(groups, int) or groups < 1:
            raise ConfigError(
                f"ft.replica_groups must be the number of replica groups (machines), an integer "
                f">= 1, under torchrun, got {groups!r}"
            )
        index = replica_index(replica_id)
        if index is None or index >= groups:
            raise ConfigError(
                f"ft.replica_id must name this machine's replica group, ending in its index "
                f"0..{groups - 1} (e.g. group_0), under torchrun, got {replica_id!r}"
            )
        world_size = groups
    else:
        for key, value in (("ft.replica_id", replica_id), ("ft.replica_groups", groups)):
            if value is not None:
                raise ConfigError(
                    f"{key} must be null on one machine (each worker is a replica group, "
                    f"replica_000 ...; torchrun runs one group per machine), got {value!r}"
                )
    for key, low, allowed in (
        ("ft.min_replicas", 1, "an integer >= 1"),
        ("ft.max_restarts", 0, "an integer >= 0"),
    ):
        value = get(cfg, key)
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{key} must be {allowed}, got {value!r}")
    if world_size is not None and get(cfg, "ft.min_replicas") > world_size:
        what = "ft.replica_groups" if under_torchrun() else "dist.world_size"
        raise ConfigError(
            f"ft.min_replicas must be <= {what} ({world_size}), got {get(cfg, 'ft.min_replicas')!r}"
        )
    for key in ("ft.timeout_s", "ft.quorum_timeout_s"):
        value = get(cfg, key)
        if not value > 0:
            raise ConfigError(f"{key} must be > 0 seconds, got {value!r}")
    grace = get(cfg, "ft.grace_s")
    if grace is not None and not 0 < grace <= get(cfg, "ft.timeout_s"):
        raise ConfigError(
            f"ft.grace_s must be null (adaptive) or > 0 and <= ft.timeout_s "
            f"({get(cfg, 'ft.timeout_s'):g}) seconds, got {grace!r}"
        )
    if not get(cfg, "ft.grace_factor") >= 1:
        raise ConfigError(f"ft.grace_factor must be >= 1, got {get(cfg, 'ft.grace_factor')!r}")
    if not get(cfg, "ft.grace_min_s") > 0:
        raise ConfigError(f"ft.grace_min_s must be > 0 seconds, got {get(cfg, 'ft.grace_min_s')!r}")
    for key in ("ft.heartbeat_timeout_s", "ft.join_timeout_s", "ft.stall_s"):
        if not _positive(get(cfg, key)):
            raise ConfigError(f"{key} must be > 0 seconds, got {get(cfg, key)!r}")
    heartbeat = get(cfg, "ft.heartbeat_timeout_s")
    # (asynchronous rounds run no quorum: the window bounds one transfer with a worker)
    rounds = get(cfg, "sync.mode") != "async"
    if rounds and grace is None and get(cfg, "ft.grace_min_s") < heartbeat:
        raise ConfigError(
            f"ft.grace_min_s must be >= ft.heartbeat_timeout_s ({heartbeat:g}) with an adaptive "
            f"window: a round that fails on a frozen worker sooner finds it still in the next "
            f"quorum and fails again; got {get(cfg, 'ft.grace_min_s')!r}"
        )
    if not get(cfg, "ft.host"):
        raise ConfigError("ft.host must name the interface to bind (e.g. 127.0.0.1), got ''")
    levels = list(get(cfg, "sync.levels") or [])
    if levels and get(cfg, f"sync.levels.{len(levels) - 1}.group_size") != "world":
        raise ConfigError(
            "sync.levels: the last level's group_size must be world with ft=torchft (it spans "
            f"every replica group, through torchft), got {levels[-1]!r}"
        )
    plan = SyncPlan.of(get(cfg, "sync"))
    delay, spacing = plan.delay, plan.spacing
    if delay and not delay < spacing:
        raise ConfigError(
            f"sync.delay_steps must be < {plan.period_key}/sync.fragments ({spacing}) with "
            f"ft=torchft (a round must close before the next fragment's opens), got {delay!r}"
        )


def check_lighthouse(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """A lighthouse named by `ft.lighthouse` answers (the last check: it asks the network)."""
    lighthouse = get(cfg, "ft.backend") == "torchft" and get(cfg, "ft.lighthouse")
    if lighthouse:
        check_reachable(lighthouse, min(float(get(cfg, "ft.timeout_s")), 10.0))


def replica_index(replica_id: str | None) -> int | None:
    """The index a replica group's name ends in (`group_1` -> 1), or None."""
    match = re.search(r"(\d+)$", replica_id or "")
    return int(match.group(1)) if match else None


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def replica_group_processes() -> int:
    """The processes of this machine's replica group under torchrun with ft=torchft (1 with
    local workers: each is a replica group of its own)."""
    from localsgd.cli.forkserver import under_torchrun

    return int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1


def replica_group_info(ft: Any, group: WorkerInfo) -> WorkerInfo:
    """Under torchrun, one machine's ranks are one replica group: a worker's place among all
    workers (its data shard, whether it writes the results) is its group's index times the
    group's size plus its rank in the group."""
    index = replica_index(ft.replica_id)
    return WorkerInfo(
        rank=index * group.world_size + group.rank,
        world_size=ft.replica_groups * group.world_size,
        local_rank=group.local_rank,
        local_world_size=group.world_size,
        attempt=group.attempt,
    )


# --- the supervisor ---------------------------------------------------------------------------


class ReplicasFailed(RuntimeError):
    """Too few replica groups finished; the message says which were lost and why."""


class ReplicasStopped(RuntimeError):
    """A SIGTERM or Ctrl-C stopped every worker at an agreed round, with a checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


EXIT_STOPPED = 3  # a worker that found no quorum and wrote the stop checkpoint
EXIT_NO_PEER = 4  # a restarted worker that found no live peer to heal from


def _replica_main(
    info: WorkerInfo, environ: dict[str, str], fn: Callable, args: tuple, stops: Any
) -> None:
    from localsgd.cli.launch import _die_with_launcher

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides what Ctrl-C means
    _die_with_launcher()
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(1)
    from localsgd.averaging.torchft import QuorumLost
    from localsgd.loop.fault_tolerance import NoLivePeer

    try:
        fn(info, None, *args)
    except QuorumLost as e:  # not restarted: the supervisor reports it once
        stops.put(str(e))
        os._exit(EXIT_STOPPED)
    except NoLivePeer as e:
        notice(f"ft: {e}")
        os._exit(EXIT_NO_PEER)
    except BaseException as e:  # one line; the supervisor restarts the worker or gives up
        last = (str(e).strip().splitlines() or [""])[-1]
        notice(f"ft: worker {info.rank} failed: {type(e).__name__}: {last}")
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as launch._spawned: no native-thread teardown that could abort a finished run


def _hosted_syncer(cfg: Any):
    """Asynchronous rounds' syncer, in this process (`localsgd.averaging.asynchronous.hosted`):
    a transfer with one worker may take one grace window before its session is dropped."""
    from localsgd.averaging.asynchronous.hosted import HostedSyncer
    from localsgd.averaging.asynchronous.links import SYNCER_ENV
    from localsgd.averaging.comm import SimulatedLink

    ft, sync, sim = cfg.ft, cfg.sync, cfg.comm.simulate
    slow = sim.bandwidth_gbps is not None or sim.latency_ms > 0
    hosted = HostedSyncer(
        cfg.dist.world_size, min_quorum=sync.min_quorum, grace_s=sync.grace_s, host=ft.host,
        transfer_timeout_s=ft.grace_s if ft.grace_s is not None else ft.grace_min_s,
        timeout_s=cfg.dist.timeout_s,
        simulated=SimulatedLink(sim.bandwidth_gbps, sim.latency_ms) if slow else None,
    )  # fmt: skip
    hosted.start()
    os.environ[SYNCER_ENV] = hosted.address
    return hosted


def run_replicas(fn: Callable, cfg: Any, args: tuple, poll_s: float = 0.05) -> dict[str, Any]:
    """Run `fn(info, None, *args)` as `dist.world_size` replica groups of one process each,
    restarting a dead one up to `ft.max_restarts` times. Returns what happened: `restarts`
    (per worker) and `lost` (workers out of restarts; the first live worker writes the
    results). Raises ReplicasFailed when every worker failed, or when the survivors, fewer
    than `ft.min_replicas`, found no quorum and stopped with a checkpoint."""
    from localsgd.averaging.torchft import start_lighthouse
    from localsgd.cli.forkserver import fork_from_here, start_method

    fork_from_here()  # before the lighthouse's threads start
    # torchft's servers log every quorum at INFO: our own lines say what happened
    os.environ.setdefault("RUST_LOG", "warn")
    ft, world_size = cfg.ft, cfg.dist.world_size
    server = None
    hosted = _hosted_syncer(cfg) if cfg.sync.mode == "async" else None
    if hosted is None and not ft.lighthouse:
        # the lighthouse's minimum is the steady-state one; the first quorum waits for all W
        # (`FaultTolerantRounds.start(wait_for=W)`), so nobody trains alone at the start
        server, ft.lighthouse = start_lighthouse(
            ft.min_replicas,
            host=ft.host,
            heartbeat_timeout_ms=round(1000 * ft.heartbeat_timeout_s),
            join_timeout_ms=round(1000 * ft.join_timeout_s),
            quorum_tick_ms=20,
        )
    if hosted is None:
        ft.lighthouse = lighthouse_url(ft.lighthouse)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ft.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too
    context = multiprocessing.get_context(start_method())
    procs: dict[int, Any] = {}
    restarts = dict.fromkeys(range(world_size), 0)
    finished: set[int] = set()
    lost: dict[int, str] = {}
    stopped: set[int] = set()  # found no quorum, wrote the stop checkpoint
    stops = context.SimpleQueue()  # their one line each (the same checkpoint)

    def start(rank: int) -> None:
        info = WorkerInfo(rank, world_size, rank, world_size, attempt=restarts[rank])
        proc = context.Process(
            target=_replica_main, args=(info, dict(os.environ), fn, args, stops), daemon=False
        )
        proc.start()
        procs[rank] = proc

    def stop_all(signum=None, frame=None) -> None:
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        if signum is not None:
            notice(
                "stopped: every worker killed; the same command resumes from the newest "
                "checkpoint (trainer.checkpoint_every), if one was written"
            )
            os._exit(130 if signum == signal.SIGINT else 143)

    stopping: list[int] = []  # the signal that asked for a stop

    def stop(signum, frame) -> None:
        """The first SIGTERM or Ctrl-C: every worker stops after the next round, which carries
        the request to all replica groups, with a shared checkpoint; the second aborts."""
        if stopping:
            stop_all(signum)
        stopping.append(signum)
        why = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        when = (
            "the next meeting (a trainer.checkpoint_every step, or the last)"
            if hosted is not None
            else "the next sync"
        )
        notice(
            f"{why}: stopping after {when} with a checkpoint (run the same command again to "
            "resume; Ctrl-C again to abort without one)"
        )
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for rank in range(world_size):
            start(rank)
        while len(finished) + len(lost) + len(stopped) < world_size:
            time.sleep(poll_s)
            if hosted is not None and hosted.service.error is not None:
                raise ReplicasFailed(f"ft: the syncer failed: {hosted.service.error}")
            for rank, proc in list(procs.items()):
                if rank in finished or rank in lost or rank in stopped or proc.is_alive():
                    continue
                proc.join()
                code = proc.exitcode
                if code == 0:
                    finished.add(rank)
                    continue
                if code == EXIT_STOPPED:
                    stopped.add(rank)
                    continue
                if code == EXIT_NO_PEER:  # another restart would find no peer either
                    lost[rank] = "restarted with no live peer"
                    if not finished:
                        raise ReplicasFailed(
                            f"ft: worker {rank} restarted but found no live peer to heal from "
                            "(every worker had failed: see the lines above); stopped"
                        )
                    continue
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                others_done = len(finished) == world_size - 1  # nobody left to heal from
                if restarts[rank] < ft.max_restarts and not stopping and not others_done:
                    restarts[rank] += 1
                    notice(
                        f"ft: worker {rank} died ({how}); restart {restarts[rank]} of "
                        f"{ft.max_restarts}, "
                        + (
                            "it catches up from the syncer"
                            if hosted is not None
                            else "it heals from a live peer at the next sync"
                        )
                    )
                    start(rank)
                else:
                    lost[rank] = how
                    why = (
                        "while the job stops" if stopping
                        else "after the others finished" if others_done
                        else "with no restart left"
                    )  # fmt: skip
                    notice(f"ft: worker {rank} died ({how}) {why}; lost for good")
                    if hosted is not None:
                        hosted.lose(rank)
                    if world_size - len(lost) < ft.min_replicas:
                        notice(
                            f"ft: {world_size - len(lost)} of {world_size} workers left, fewer "
                            f"than ft.min_replicas={ft.min_replicas}: they stop with a "
                            f"checkpoint within ft.quorum_timeout_s={ft.quorum_timeout_s:g}"
                        )
        if hosted is not None and not stopping:
            hosted.close(cfg.dist.timeout_s)
        if stopped:
            raise ReplicasFailed(f"ft: {stops.get()}")
        if stopping:  # every worker stopped at the agreed round, with its checkpoint
            raise ReplicasStopped(stopping[0])
        return {"restarts": restarts, "lost": sorted(lost)}
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        if server is not None:
            server.shutdown()
