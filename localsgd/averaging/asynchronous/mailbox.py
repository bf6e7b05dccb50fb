"""How the workers and the syncer talk: small messages (json) as keys of the rendezvous store,
tensors by torch.distributed point-to-point on a process group of their own.

A gloo receive cannot be polled (its work reports completion only once waited on), and a
blocking one would time out while a slow worker trains through a long phase; a store key can
be checked without blocking, so the syncer looks for each worker's next message in the store
and moves tensors only once both ends are known to be ready. Every wait has a deadline.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from localsgd.averaging.virtual import poke, wait_outside


class Mailbox:
    """Messages under `prefix` of `store`; every blocking wait gives up after `timeout_s`."""

    def __init__(self, store: dist.Store, prefix: str, timeout_s: float):
        self.store = dist.PrefixStore(prefix, store)
        self.timeout_s = timeout_s

    def put(self, key: str, message: dict[str, Any], ring: bool = False) -> None:
        """Leave `message` at `key`; `ring`: and count it on the doorbell (`rung`)."""
        self.store.set(key, json.dumps(message))
        if ring:
            self.store.add("bell", 1)
        poke()  # a virtual worker waiting for it runs again

    def rung(self) -> int:
        """How many messages were left with `ring` so far: one store call, so that the syncer
        looks for its workers' messages only when there are new ones."""
        return self.store.add("bell", 0)

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def take(self, key: str, alive=None) -> dict[str, Any]:
        """The message at `key` (waited for; deleted once read). `alive()`, called while
        waiting, raises where the other end failed (the syncer thread, on rank 0). Polled: a
        store wait that times out logs a warning in c10d each time."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not self.store.check([key]):
            if alive is not None:
                alive()
            # a virtual worker lets the others run meanwhile (`virtual.wait_outside`)
            if wait_outside(lambda: self.store.check([key])):
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"asynchronous rounds: no answer for {key!r} within {self.timeout_s:g} s "
                    "(dist.timeout_s)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        message = json.loads(self.store.get(key))
        self.store.delete_key(key)
        return message
