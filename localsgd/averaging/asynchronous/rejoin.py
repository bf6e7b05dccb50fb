"""A worker's sessions with a hosted syncer (`hosted`, `links.Sessions`): the first one, which
may bring the syncer its global model, and a new one after a session failed.

- `join`: the worker's first session in this process. The request carries the model's layout
  (`spec`: the flat buffers, the averaged part, the parameter blocks) and the outer step's
  settings, as json; the first worker of the run also sends its model, which is every worker's
  (replicas start identical), and the syncer is built from it (and from the syncer's state
  its checkpoint holds, when the run resumed from one). Any later worker, a restarted
  one included, takes the global model back and, after a restart, the state its last
  contribution was sent from (`welcome["resume"]`: `localsgd.loop.async_sessions` loads it).
- `rejoin`: a session failed (the syncer's deadline passed mid-transfer, or the link broke): a
  new session, and the global model into the buffers as this worker's model and anchor. The
  phase's training is lost unless its contribution had arrived in full (then it is merged:
  never twice, since the worker starts again from the global model). Tried until the run's
  timeout passes, then raised: the launcher restarts the process.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields

from localsgd.averaging.asynchronous.links import (
    LINK_ERRORS,
    TAG_VALUES,
    WorkerLink,
    join_session,
)
from localsgd.averaging.trees import tree_as_json
from localsgd.averaging.wire.quantize import BlockCodec
from localsgd.averaging.wire.sparse import TopKCodec


def spec(averager) -> dict:
    """What the syncer is built from, as json (`hosted.build_syncer` reads it)."""
    sgd = {k: v for k, v in averager.syncer_sgd.items() if k != "optimizer"}
    fmt = averager.comm_dtype
    if isinstance(fmt, BlockCodec):
        wire = {"block": fmt.name, "block_size": fmt.block_size}
    elif isinstance(fmt, TopKCodec):
        wire = {"topk": fmt.density, "chunk": fmt.chunk, "mean": fmt.mean}
    else:
        wire = {"dtype": str(fmt).removeprefix("torch.")}
    correction, buffers = averager.correction, averager.flat.buffers
    return {
        "buffers": [[b.numel(), str(b.dtype).removeprefix("torch.")] for b in buffers],
        "parts": [[list(s) for s in part] for part in averager.rounds.parts],
        "blocks": [list(b) for b in averager._param_blocks()],
        "sgd": sgd,
        "plain_first": averager.warmup_steps > 0,
        "wire": wire,
        "aggregate": None if averager.aggregate is None else asdict(averager.aggregate),
        "correction": None if correction is None else _settings(correction),
        "normalized": averager.normalized_merges,
        "max_staleness": averager.max_staleness,
        "period": averager._period_settings(),
    }


def _settings(correction) -> dict:
    return {f.name: getattr(correction, f.name) for f in fields(correction) if f.name != "counts"}


def join(averager, address: str) -> WorkerLink:
    """The first session of this process (see the module doc); `averager.welcome` keeps the
    syncer's welcome (its `resume` is this worker's state after a restart)."""
    request = spec(averager)
    saved = averager._saved_syncer  # resumed: the checkpoint's syncer
    request["state"], state = tree_as_json(saved) if saved is not None else (None, [])
    link = join_session(address, averager.rank, {"spec": request}, averager.timeout_s)
    link.simulated = averager.comm.link
    welcome = link.mailbox.take("welcome")
    if welcome.get("init"):  # the first worker: its model is the global one
        for b in averager.rounds.anchors.first:
            link.send(b.detach().cpu().contiguous(), TAG_VALUES)
        for t in state:
            link.send(t, TAG_VALUES)
        welcome = link.mailbox.take("welcome")
    averager.welcome = welcome
    _welcomed(averager, link, welcome)
    return link


def rejoin(averager) -> None:
    """A new session after one failed (see the module doc)."""
    deadline = time.monotonic() + averager.timeout_s
    pause = 0.1
    while True:
        try:
            link = join_session(averager.syncer_address, averager.rank, {}, averager.timeout_s)
            link.simulated = averager.comm.link
            _welcomed(averager, link, link.mailbox.take("welcome"))
            break
        except LINK_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 2.0)
    averager.link, averager.seq = link, 0
    averager.rejoins += 1
    averager.phase_samples = 0.0  # what it trained since its last answer is not merged
    averager.unsynced = [0.0] * len(averager.unsynced)


def _welcomed(averager, link: WorkerLink, welcome: dict) -> None:
    """The global model (when the welcome brings one) as this worker's model and anchor; or,
    back after the run ended, nothing left to do."""
    if welcome.get("stop"):
        averager.stopped = True
        return
    rounds, buffers = averager.rounds, averager.flat.buffers
    if welcome["values"]:
        link.receive_model(list(buffers))
    rounds.anchors.reset(buffers)
    averager.versions = list(welcome["versions"])
    averager._take_period(welcome)  # an adaptive period: the fleet's, not the run's start
