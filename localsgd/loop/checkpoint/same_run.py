"""Which settings a resume may change: a checkpoint continues the same run, or is refused.

The settings listed in `RESUME_MAY_CHANGE` do not touch the trajectory (a run extended, how it is
logged, checkpointed, timed out or shown, a simulated network). Every other setting shapes the
trajectory, so a resume with it changed is refused (`localsgd.cli.preflight`): new settings are
safe by default.
"""

from __future__ import annotations

from typing import Any

RESUME_MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.eval_every",
    "trainer.eval_batch_size",
    "trainer.eval_samples",
    "trainer.sample_chars",
    "trainer.callbacks",  # observers by contract; one that changes the run is the user's call
    "trainer.log_every",
    "trainer.progress",
    "trainer.track_drift",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.keep_best",  # which weights are also kept, not how the run trains
    "dist.timeout_s",
    "dist.world_size",  # from a checkpoint taken at a sync (localsgd.loop.checkpoint.reshard)
    "data.num_workers",  # batches are seeded per batch: the same for any number of loaders
    "data.loader",  # memory or stream: the same batches
    "sync.check_replicas",
    "sync.outer_state",  # where the outer state lives: the same bits (tests/test_outer_state.py)
    "comm.simulate",
    "logger",
    "optimized_metric",  # what a sweep reads of the summary, not how the run trains
    "ft",  # with no fault, averaging through torchft is bit-identical (tests/test_ft_cli.py)
)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE)


# keys added after checkpoints were first written: the value a checkpoint without the key ran
# with, so that a run interrupted before the key existed still resumes
ADDED_KEYS = {"dist.shard_size": 1, "data.val_fraction": 0.0}  # no validation split before


def config_mismatch(marker: dict, config: dict) -> str | None:
    """The first setting outside `RESUME_MAY_CHANGE` that differs between a checkpoint and
    `config` (plain dicts), as "key: checkpoint value, this run's value", or None."""
    saved = marker.get("config")
    if saved is None:
        return None
    old_flat, new_flat = _flatten(saved), _flatten(config)
    for k in sorted(set(old_flat) | set(new_flat)):
        old = old_flat.get(k, ADDED_KEYS.get(k))
        if not _may_change(k) and old != new_flat.get(k):
            return f"{k}: {old!r} in the checkpoint, {new_flat.get(k)!r} now"
    return None
