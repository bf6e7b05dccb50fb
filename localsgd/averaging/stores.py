"""A TCPStore that serves on one interface (`serving_store`).

`dist.TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says; a
store that hands out what a run serves (the hosted syncer's sessions) listens here on a socket
bound to `host` (127.0.0.1 unless the user names another), so that nothing reaches it from
elsewhere.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class ServingStore:
    """The store (`store`), its port, and the socket it serves on (kept open with it)."""

    def __init__(self, host: str, timeout: timedelta):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.store = dist.TCPStore(
            host, self.port, is_master=True, wait_for_workers=False, timeout=timeout,
            master_listen_fd=self.listener.fileno(),
        )  # fmt: skip


def serving_store(host: str, timeout: timedelta = timedelta(seconds=300)) -> ServingStore:
    return ServingStore(host, timeout)
