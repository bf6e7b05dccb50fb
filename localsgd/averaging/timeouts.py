"""Collective timeouts for process groups made from the default one.

`dist.init_process_group(timeout=...)` (the launcher's `dist.timeout_s`) sets the default
group's timeout, but torch does not hand it down: `new_group`, `new_subgroups_by_enumeration`
and `init_device_mesh` give each new group its backend's default instead (30 minutes for gloo,
10 for NCCL). A peer that hangs inside a level's or a shard group's collective would then hold
the others for half an hour. `inherit_timeout` gives such a group the default group's timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def default_timeout() -> timedelta | None:
    """The default process group's collective timeout, or None when it cannot be read (no
    group, or a backend that keeps no options)."""
    if not dist.is_initialized():
        return None
    group = c10d._get_default_group()
    for device in group._device_types:
        options = getattr(group._get_backend(torch.device(device.type)), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def inherit_timeout(group: dist.ProcessGroup | None) -> None:
    """Give `group` (one this rank is in) the default group's collective timeout."""
    timeout = default_timeout()
    if group is None or timeout is None or c10d._rank_not_in_group(group):
        return
    c10d._set_pg_timeout(timeout, group)
