"""Defects of the house issue, each pinned by a test that failed before its fix: the eager
step's M read live, launched and blocking 16-bit averages across replica groups alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import StreamingAverager

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_eager_step_reads_m_from_the_round_it_launches_in(lone_group):
    """The eager update is d_t/M_t + D_{t-1} - d_{t-1}/M_{t-1}: the M each mean is taken over.
    Under torchft M is the live workers of the round, so it may change between rounds; a frozen
    M (as when torchft's round driver attached) removes the wrong share of this worker's own
    contribution. Here M goes 1 -> 2 (the mean of round 1 divides by 2, as if a second worker
    sent zeros): the outer step must move the anchor by d_1/2, not d_1."""
    model = torch.nn.Linear(3, 1, bias=False)
    w0 = model.weight.detach().clone()
    av = StreamingAverager(
        1, module=model, eager=True, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False
    )
    with torch.no_grad():
        model.weight.sub_(1.0)  # d_0 = anchor - local = 1
    av.maybe_average()  # round 0: M = 1, anchor -= d_0
    assert torch.equal(model.weight, w0 - 1.0)
    av.comm.use_avg, av.comm.size = False, 2  # round 1 averages over 2 workers
    with torch.no_grad():
        model.weight.sub_(1.0)  # d_1 = 1
    av.maybe_average()  # update d_1/2 + D_0 - d_0/1 = 0.5
    assert torch.allclose(model.weight, w0 - 1.5)


class _GroupOfTwo:
    """A replica group's own communicator as seen by one member: the other member holds 0.1
    everywhere; the mean is taken in the wire's dtype, as `Communicator.mean_` does."""

    size, use_avg = 2, True

    def mean_(self, flat, through=None):
        wire = flat if through is None else through.copy_(flat)
        wire.add_(0.1).div_(2)
        if through is not None:
            flat.copy_(wire)


class _OneReplicaManager:
    """torchft's Manager for a quorum of one replica group: every all-reduce is the identity."""

    class _Done:
        def wait(self):
            return None

    def start_quorum(self):
        pass

    def allreduce(self, tensor, reduce_op=None):
        return self._Done()

    def errored(self):
        return None

    def num_participants(self):
        return 1

    def should_commit(self):
        return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_launched_and_blocking_16_bit_averages_agree_across_replica_groups(dtype):
    """Under torchrun a replica group has several processes: the group's own mean runs first.
    The blocking path ran it in 16 bits and the launched path in fp32, so the two differed in
    bits. Both now average inside the group in the wire's precision."""
    from localsgd.averaging.torchft.comm import TorchftCommunicator

    comm = TorchftCommunicator(_OneReplicaManager(), local=_GroupOfTwo())
    values = torch.linspace(-1, 1, 101) / 3
    blocking, launched = values.clone(), values.clone()
    comm.begin()
    comm.mean_(blocking, through=torch.empty(101, dtype=dtype))
    comm.launch_mean_([launched], through=[torch.empty(101, dtype=dtype)]).wait()
    comm.commit()
    assert torch.equal(blocking, launched)
    assert not torch.equal(blocking, (values + 0.1) / 2)  # the 16-bit rounding did happen


class _Held:
    """A checkpoint component that keeps what it is given."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _shared_checkpoint_with_own_residuals(run_dir, residuals: list[float]) -> str:
    """A shared checkpoint written by worker 0 of len(residuals) workers, each worker's own
    residual saved beside it, as `ft=torchft` writes them."""
    from localsgd.loop import checkpoint

    writer = torch.tensor([residuals[0]])
    components = {
        "averager": _Held({"step": 8, "rounds": {"residuals": [writer]}}),
        "optimizer": _Held({"param_groups": [], "state": {}}),
        "loop": _Held({"in_sync": True}),
        "rng": _Held({}),
    }
    folder = checkpoint.save_shared(str(run_dir), 8, len(residuals), components, keep=2)
    for rank, value in enumerate(residuals):
        checkpoint.save_own(str(run_dir), 8, rank, {"residuals": [torch.tensor([value])]})
    return folder


@pytest.mark.parametrize(
    "world_size, rank, want",
    [(3, 1, 2.0), (3, 2, 4.0), (2, 0, 7.0 / 3), (4, 3, 7.0 / 3)],
)
def test_a_shared_checkpoint_gives_each_worker_its_own_residual(tmp_path, world_size, rank, want):
    """Error feedback's residual is what a worker failed to send. A shared checkpoint (ft)
    held only the writer's, which every worker then took: counted W times. Now each worker
    takes its own at the same world size, and at another every worker takes the old residuals'
    sum over the old world size, so the next average adds what the old one would have."""
    from localsgd.loop.checkpoint import AveragerState
    from localsgd.loop.checkpoint.reshard import load_resharded

    folder = _shared_checkpoint_with_own_residuals(tmp_path, [1.0, 2.0, 4.0])
    averager = _Held(None)
    components = {  # the averager moves its own state (`AveragerState.resharded_state`)
        "averager": AveragerState(averager),
        "optimizer": _Held(None),
        "loop": _Held(None),
    }
    load_resharded(folder, rank, torch.device("cpu"), components, world_size=world_size)
    got = averager.state["rounds"]["residuals"][0]
    assert torch.allclose(got, torch.tensor([want])), got


def test_a_healer_takes_no_residual_of_its_peers(lone_group):
    """A healing worker loads its peer's averager state, but not the peer's residual: that is
    the peer's own unsent error (it would be counted twice); the healer's own died with it."""
    from localsgd.averaging import OuterAverager
    from localsgd.averaging.torchft import FaultTolerantRounds, TorchftCommunicator

    class Manager(_OneReplicaManager):
        def register_state_dict_fn(self, key, load, save):
            self.fns = (load, save)

        def participating_rank(self):
            return 0

    model = torch.nn.Linear(64, 4)
    peer = OuterAverager(4, module=model, comm_dtype="int4", error_feedback=True)
    for r in peer.rounds.residuals[0]:
        r.fill_(0.25)  # the peer's unsent error
    state = {
        "phase": "sync",
        "averager": peer.state_dict(),
        "buffers": [b.clone() for b in peer.flat.buffers],
        "committed": {"buffers": [], "rounds": peer.rounds.state_dict()},
        "failed_syncs": 0,
        "participants_min": 2,
        "heals_seen": 0,
        "checkpoint_mark": 0,
    }
    healer = OuterAverager(4, module=torch.nn.Linear(64, 4), comm_dtype="int4", error_feedback=True)
    rounds = FaultTolerantRounds(healer, TorchftCommunicator(Manager()))
    rounds._load_ft_state(state)
    assert all(torch.count_nonzero(r) == 0 for r in healer.rounds.residuals[0])
    # the rest is taken
    assert torch.equal(healer.rounds.anchors.first[0], peer.rounds.anchors.first[0])
    assert all(r is None for r in rounds.committed["rounds"]["residuals"] or [None])
