"""Top-k with the senders' mean (`sync.topk_mean=senders`) in asynchronous rounds: each
contribution carries where its message held an index (`messages.sent_marks`), and the syncer
divides each index of a merge by the samples of the contributions that sent it
(`Syncer._weighted_mean`), as a synchronous round's senders' mean divides by its senders.

- a decoded message's marks are the positions its encoder chose;
- a merge of two contributions: an index one of them sent moves by that one's whole value;
- from the CLI: every worker equally fast with a quorum of all and the synchronous outer step
  gives the synchronous run's model bit for bit; a slow worker's merges go point-to-point and
  the senders' mean changes the model.
"""

from __future__ import annotations

import pytest
import torch

from localsgd.averaging.asynchronous.messages import Decoders, sent_marks
from localsgd.averaging.asynchronous.syncer import Arrival, Syncer
from localsgd.averaging.rounds.part import Slice
from localsgd.averaging.wire.sparse import SparseWire, TopKCodec
from tests.helpers import cli, same_model
from tests.test_async_rounds import SAME, same_as_synchronous

pytestmark = pytest.mark.timeout(120)

SENDERS = TopKCodec(density=0.25, chunk=8, mean="senders")  # 2 of every 8 values


def test_a_decoded_message_carries_the_positions_its_encoder_chose():
    x = torch.tensor([0.1, -5.0, 0.2, 0.0, 3.0, 0.1, -0.1, 0.2, 0.0, 9.0, 0.0, -8.0])
    wire = SparseWire(SENDERS, x.numel(), "cpu")
    wire.encode_(x)
    chosen = sent_marks(wire, x.numel())
    marks: list = []
    values = Decoders([torch.zeros(12)], SENDERS).decode([wire.send.clone()], marks)
    (got,) = marks
    assert torch.equal(got, chosen) and got.nonzero().flatten().tolist() == [1, 4, 9, 11]
    assert torch.equal(values[0] != 0, got)
    # the mean over everyone sends no marks
    everyone: list = []
    Decoders([torch.zeros(12)], TopKCodec(0.25, 8)).decode([wire.send.clone()], everyone)
    assert everyone == [None]


def _merged(senders: bool) -> torch.Tensor:
    """Two contributions (6 and 2 samples) to a 4-value model at zero, plain outer step (lr 1):
    worker 0 sent indices 0 and 1, worker 1 indices 1 and 2."""
    plain = {"lr": 1.0, "momentum": 0.0, "nesterov": False, "warmup_rounds": 0}
    syncer = Syncer([torch.zeros(4)], [[Slice(0, 0, 4, 4)]], plain)
    rows = [
        (0, 6.0, [1.0, 2.0, 0.0, 0.0], [1, 1, 0, 0]),
        (1, 2.0, [0.0, 4.0, 8.0, 0.0], [0, 1, 1, 0]),
    ]
    for worker, samples, values, sent in rows:
        marks = [torch.tensor(sent, dtype=torch.bool)] if senders else None
        syncer.add(Arrival(worker, 0.0, samples, 0, [torch.tensor(values)], sent=marks))
    syncer.merge()
    return -syncer.values[0]  # the merged pseudo-gradient


def test_a_merge_divides_each_index_by_the_samples_of_its_senders():
    # index 0: only worker 0 (6 samples) sent it, so its whole value; index 1: both, weighed
    # 6:2; index 2: only worker 1's; index 3: nobody's
    assert torch.allclose(_merged(True), torch.tensor([1.0, 2.5, 8.0, 0.0]))
    # the mean over everyone divides by all 8 samples
    assert torch.allclose(_merged(False), torch.tensor([0.75, 2.5, 2.0, 0.0]))


TOPK = ["sync.compress=topk", "sync.error_feedback=true", "sync.topk_mean=senders"]


@pytest.mark.slow
def test_equal_clocks_with_the_senders_mean_are_synchronous_diloco_bit_for_bit(tmp_path):
    summary = same_as_synchronous(tmp_path, SAME + TOPK)
    assert summary["async_exchanges"]["p2p"] == 0


@pytest.mark.slow
def test_a_slow_workers_merges_take_the_senders_mean(tmp_path):
    args = SAME + TOPK + ["sync.mode=async", "comm.simulate.worker_speed=[1,1,1,3]",
                          "comm.simulate.step_s=0.001"]  # fmt: skip
    for mean in ("senders", "all"):
        proc, _ = cli(args + [f"sync.topk_mean={mean}", f"hydra.run.dir={tmp_path / mean}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert not same_model(tmp_path / "senders" / "model.pt", tmp_path / "all" / "model.pt")
