"""Virtual workers (`dist.virtual_workers=M`, localsgd/averaging/virtual.py): M workers as
threads of one process with gloo's bits. The reduction order against real gloo (groups of
threads in this process, so no process starts), each worker's own random state, a failed
worker, the refusals, and whole runs against M worker processes: `model.pt`, the summary and
the metrics identical. Each test fails without the feature it names."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging.virtual import gloo_ring_sum_, run_virtual
from localsgd.cli.launch import WorkerFailed
from localsgd.cli.virtual import spawn_virtual
from tests.helpers import TIMING_KEYS, cli, refusal, same_model, train_records

pytestmark = pytest.mark.timeout(120)


def _values(size: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Values over a wide range of magnitudes, so that the order of the additions shows."""
    g = torch.Generator().manual_seed(n)
    return [
        (
            torch.randn(n, generator=g, dtype=torch.float64)
            * torch.exp(3 * torch.randn(n, generator=g, dtype=torch.float64))
        ).to(dtype)
        for _ in range(size)
    ]


def _gloo(values: list[torch.Tensor], op) -> list[torch.Tensor]:
    """What gloo's all-reduce returns on each rank: real gloo groups, one per thread."""
    store, out = dist.HashStore(), [None] * len(values)

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, len(values), datetime.timedelta(seconds=30))
        x = values[r].clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([x], opts).wait()
        out[r] = x

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ring_sum_has_gloos_bits(dtype):
    """SUM and AVG give gloo's bits at 2..5 ranks and sizes from 1 to 100003 values, where the
    plain sum in rank order does not (at 3 ranks and more: the ring starts each chunk at
    another rank)."""
    differs = False
    for size in (2, 3, 4, 5):
        for n in (1, 7, 1000, 100003) if dtype == torch.float32 else (7, 1000):
            values = _values(size, n, dtype)
            total, mean = _gloo(values, dist.ReduceOp.SUM), _gloo(values, dist.ReduceOp.AVG)
            ours = gloo_ring_sum_(values)
            assert all(torch.equal(t, ours) for t in total), (size, n)
            assert all(torch.equal(m, ours / size) for m in mean), (size, n)
            in_order = values[0].clone()
            for v in values[1:]:
                in_order += v
            differs |= not torch.equal(in_order, ours)
    assert differs


@pytest.mark.long  # make test-long: the ring's bits below the segment size stay
def test_ring_sum_has_gloos_bits_past_the_segment_size():
    """8M fp32 values (32 MB) over 3 ranks: gloo cuts the ring into segments of at most 1 MiB,
    which moves the chunks' boundaries; the virtual sum follows them."""
    values = _values(3, 8_000_000, torch.float32)
    assert all(torch.equal(t, gloo_ring_sum_(values)) for t in _gloo(values, dist.ReduceOp.SUM))


def _draws(rank: int, baton) -> list[float]:
    dist.init_process_group("virtual", store=_STORE, rank=rank, world_size=3)
    try:
        torch.manual_seed(rank)
        first = torch.rand(2)
        dist.barrier()  # the others run, and seed, in between
        second = torch.rand(2)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        return [*first.tolist(), *second.tolist(), total.item()]
    finally:
        dist.destroy_process_group()


_STORE = dist.HashStore()


def test_each_worker_keeps_its_random_state():
    """A worker's draws after a collective continue its own generator, as in a process of its
    own, though the others seeded theirs meanwhile."""
    results = run_virtual(_draws, 3, timeout_s=30)
    for rank, drawn in enumerate(results):
        alone = torch.Generator().manual_seed(rank)
        assert drawn[:4] == torch.rand(4, generator=alone).tolist()
        assert drawn[4] == 3.0


def _fails_at_one(info, store):
    dist.init_process_group("virtual", store=store, rank=info.rank, world_size=info.world_size)
    try:
        if info.rank == 1:
            raise ValueError("boom")
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 1 never joins: the others stop here
    finally:
        dist.destroy_process_group()


def test_a_failed_worker_stops_the_others():
    """One worker's error ends the job at once, naming its rank; the others do not wait for
    `dist.timeout_s` in their collective."""
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 1 failed: ValueError: boom"):
        spawn_virtual(_fails_at_one, 4, timeout_s=60)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "args, key",
    [
        (["dist.virtual_workers=0"], "dist.virtual_workers must be an integer >= 1"),
        (["dist.virtual_workers=4", "dist.world_size=2"], "dist.world_size must be null or 4"),
        (["dist.virtual_workers=4", "ft=torchft"], "dist.virtual_workers with ft=torchft"),
        (["dist.virtual_workers=4", "dist.shard_size=2"], "dist.virtual_workers with dist.shard_"),
        (["dist.virtual_workers=4", "dist.device=cuda"], "dist.device must be auto or cpu"),
        (
            ["dist.virtual_workers=4", "sync.inner_time_s=1"],
            "dist.virtual_workers with sync.inner_time_s and no comm.simulate.worker_speed",
        ),
        (
            ["dist.virtual_workers=4", "sync.outer=diloco", "sync.mode=async"],
            "sync.mode=async with dist.virtual_workers and no comm.simulate.worker_speed",
        ),
        (
            ["dist.virtual_workers=4", "comm.simulate.latency_ms=5"],
            "dist.virtual_workers with comm.simulate.bandwidth_gbps or comm.simulate.latency_ms",
        ),
    ],
)
def test_refusals(args, key, capsys):
    """What virtual workers cannot serve is refused in one line naming the key."""
    line = refusal(args, capsys)
    assert key in line and "dist.virtual_workers" in line, line


SMALL = [
    "trainer.max_steps=48",
    "trainer.eval_every=24",
    "trainer.log_every=8",
    "data.num_samples=2000",
    "trainer.checkpoint_every=0",
    "logger.wandb.mode=disabled",
    "logger.plots=false",
    "trainer.progress=false",
]


def _same_run(args: list[str], workers: int, tmp_path) -> dict:
    """`args` run as `workers` processes and as as many virtual workers: the same model bits,
    the same summary and the same metrics, timings aside. The summary."""
    runs = {}
    for how in ("processes", "virtual"):
        run_dir = tmp_path / how
        launch = f"dist.world_size={workers}" if how == "processes" else (
            f"dist.virtual_workers={workers}"
        )  # fmt: skip
        proc, left = cli([*SMALL, *args, launch, f"hydra.run.dir={run_dir}"], timeout=150)
        assert proc.returncode == 0 and not left, proc.stderr[-3000:]
        runs[how] = run_dir
    real, virtual = runs["processes"], runs["virtual"]
    assert same_model(real / "model.pt", virtual / "model.pt")
    summaries = [json.loads((d / "summary.json").read_text()) for d in (real, virtual)]
    for summary in summaries:
        for key in (*TIMING_KEYS, "eval_seconds", "async_wait_s"):
            summary.pop(key, None)
    assert summaries[0] == summaries[1]
    assert train_records(real) == train_records(virtual)
    return summaries[1]


@pytest.mark.slow
def test_virtual_workers_are_bit_identical_to_processes(tmp_path):
    """DiLoCo at 3 workers, where the order of an all-reduce's additions matters (AVG over 3
    ranks): the virtual run is the real one, bit for bit."""
    _same_run(["+experiment=diloco", "sync.period=8"], 3, tmp_path)


@pytest.mark.slow
def test_virtual_workers_run_asynchronous_rounds_as_processes_do(tmp_path):
    """Asynchronous rounds on the modelled clock (workers 2x and 3x slower, 2 fragments on the
    int8 wire, a quorum of 2): the syncer's thread beside 4 virtual workers, its messages
    through the store and the tensors through the group's point-to-point queues
    (`VirtualGroup.send`), each waiting worker handing the baton on: the processes' run, bit
    for bit, stale contributions included."""
    summary = _same_run(
        ["+experiment=diloco", "sync.period=8", "sync.mode=async", "sync.fragments=2",
         "sync.comm_dtype=int8", "sync.error_feedback=true", "sync.min_quorum=2",
         "comm.simulate.worker_speed=[1,1,2,3]", "comm.simulate.step_s=0.001"],
        4, tmp_path,
    )  # fmt: skip
    assert summary["async_max_staleness"] >= 1 and summary["async_exchanges"]["p2p"] > 0


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "args, workers",
    [
        (["sync.period=8"], 2),  # local SGD
        (["+experiment=local_sgd", "sync.period=4"], 4),
        (["+experiment=sync_sgd"], 3),  # a gradient all-reduce every step
        (["+experiment=diloco", "sync.period=8", "sync.comm_dtype=int4"], 4),
        (
            [
                "+experiment=diloco",
                "sync.period=8",
                "sync.compress=topk",
                "sync.error_feedback=true",
                "sync.topk_chunk=256",
            ],
            4,
        ),
        (["+experiment=hierarchical"], 4),  # subgroups
        (["+experiment=diloco_muon", "sync.period=8"], 3),
        # the median with scoring, a sign flip excluded: the gathers of the contributions and
        # of the held-out losses split by samples (localsgd/averaging/trust/held_out.py)
        (
            [
                "+experiment=untrusted",
                "sync.period=8",
                "trainer.callbacks=[{_target_:localsgd.loop.attacks.Attack,kind:sign_flip,rank:1}]",
            ],
            4,
        ),
    ],
)
def test_virtual_workers_match_processes_long(args, workers, tmp_path):
    """More of the strategies, codecs and world sizes: bit-identical to processes."""
    _same_run(args, workers, tmp_path)


ASYNC_CLOCKS = ["sync.mode=async", "comm.simulate.worker_speed=[1,1,2,3]",
                "comm.simulate.step_s=0.001"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("extra", [[], ASYNC_CLOCKS], ids=["sync", "async"])
def test_virtual_workers_resume_bit_identically(tmp_path, extra):
    """DiLoCo at 4 virtual workers trained 48 steps, then continued from its final checkpoint
    to 72: the model of 72 steps without a stop (each worker's optimizer, outer state and random
    state came back from the checkpoint; asynchronous: the meeting's, with the syncer's)."""
    args = [*SMALL, "+experiment=diloco", "sync.period=8", "dist.virtual_workers=4", *extra]
    args = [a for a in args if not a.startswith(("trainer.max_steps", "trainer.checkpoint_every"))]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for run_dir, steps in ((straight, 72), (stopped, 48), (stopped, 72)):
        proc, left = cli(
            [*args, f"trainer.max_steps={steps}", "trainer.checkpoint_every=24",
             f"hydra.run.dir={run_dir}"],
            timeout=150,
        )  # fmt: skip
        assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert same_model(straight / "model.pt", stopped / "model.pt")
