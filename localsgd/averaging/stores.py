"""A TCPStore that serves on one interface (`serving_store`).

`dist.TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says; a
store that hands out what a run serves (the hosted syncer's sessions, a replica group's Manager
address, the plain launcher's rendezvous) listens here on a socket bound to `host` (127.0.0.1
unless the user names another), so that nothing reaches it from elsewhere.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class ServingStore:
    """The store (`store`) and its port."""

    def __init__(self, host: str, timeout: timedelta):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self.store = dist.TCPStore(
            host, self.port, is_master=True, wait_for_workers=False, timeout=timeout,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
        # The store owns the descriptor now and closes it when it goes. The socket object must
        # not close it again: by then the number may be another connection's (a replica's
        # store, in another thread), which would break with EPIPE.
        listener.detach()


def serving_store(host: str, timeout: timedelta = timedelta(seconds=300)) -> ServingStore:
    return ServingStore(host, timeout)
