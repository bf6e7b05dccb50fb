"""`sync.outer_state=cpu` (localsgd/averaging/offload.py): the anchors and outer momentum in host
memory, the outer step run there, the same bits as `device`; and the peak memory on CUDA
(`PeakMemory`). In-process, on a one-rank gloo group: the mean is the identity there, but every
outer step, merge, warmup and staging copy runs. Several ranks, sharded and not:
tests/test_sharded.py (`OFFLOADED`); the CLI: tests/test_sharded.py's sharded DiLoCo run;
checkpoints through a kill: tests/test_sharded_checkpoint.py (long)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging import OuterAverager, StreamingAverager
from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from localsgd.loop.fsdp import state_bytes
from localsgd.loop.metrics import PeakMemory
from tests.helpers import compose_config

CASES = {  # every path through the outer step: warmups, low bits, each merge rule, eager
    "diloco_warmup": lambda m, s: OuterAverager(3, 2, module=m, outer_state=s,
                                                outer_warmup_rounds=2),
    "diloco_int8_feedback": lambda m, s: OuterAverager(
        3, module=m, outer_state=s, comm_dtype="int8", error_feedback=True),
    "slowmo": lambda m, s: OuterAverager(4, module=m, outer_state=s, outer_lr=1.0,
                                         outer_momentum=0.5, outer_nesterov=False),
    "streaming_mix": lambda m, s: StreamingAverager(
        8, 1, module=m, fragments=2, delay_steps=1, merge_alpha=0.5, outer_state=s),
    "streaming_tau_h_over_p": lambda m, s: StreamingAverager(
        8, module=m, fragments=2, delay_steps=4, outer_state=s),
    "streaming_progress": lambda m, s: StreamingAverager(
        8, module=m, fragments=2, delay_steps=2, merge_rule="progress", outer_state=s),
    "streaming_eager": lambda m, s: StreamingAverager(
        8, 2, module=m, fragments=2, eager=True, merge_alpha=0.25, outer_state=s),
    "streaming_int4_feedback": lambda m, s: StreamingAverager(
        8, module=m, fragments=2, comm_dtype="int4", error_feedback=True, outer_state=s),
}  # fmt: skip


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model, opt, averager, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        averager.maybe_average()


def _run(case: str, outer_state: str, steps: int = 20, resume_from: dict | None = None):
    """`steps` steps and the final average; `resume_from`: the state after 10 steps (model,
    optimizer, averager) of another run, loaded before steps 10..`steps`."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    averager = CASES[case](model, outer_state)
    start = 0
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        opt.load_state_dict(resume_from["opt"])
        averager.load_state_dict(resume_from["averager"])
        start = 10
    _train(model, opt, averager, range(start, steps))
    averager.average()
    return model, opt, averager


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))  # fmt: skip


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CASES))
def test_the_outer_state_on_the_host_gives_the_device_bits(lone_group, case):
    on_device, opt_d, av_d = _run(case, "device")
    on_host, opt_h, av_h = _run(case, "cpu")
    assert not torch.equal(on_device[0].weight, _model()[0].weight)  # it trained
    assert _same(on_device, on_host)
    # the averager's state too: anchors, outer momentum (and its warmup count), residuals
    saved_d, saved_h = av_d.state_dict(), av_h.state_dict()
    torch.testing.assert_close(saved_h, saved_d, rtol=0, atol=0)
    # held apart: the anchors and momentum in their own host copies, counted as host memory
    rounds = av_h.rounds
    assert rounds.host and rounds.outer.staging
    held, ref = state_bytes(on_host, opt_h, av_h), state_bytes(on_device, opt_d, av_d)
    outer = ref["averager_parts"]["anchors"] + ref["averager_parts"]["outer_momentum"]
    assert held["host"]["anchors"] + held["host"]["outer_momentum"] == outer > 0
    assert held["total"] == ref["total"] - outer and "host" not in ref


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["diloco_warmup", "streaming_mix"])
def test_a_device_checkpoint_continues_with_the_state_on_the_host_bit_identically(lone_group, case):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    averager = CASES[case](model, "device")
    _train(model, opt, averager, range(10))  # streaming: fragment 1 in flight after step 9
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "averager":
             averager.state_dict()}  # fmt: skip
    whole, _, _ = _run(case, "device")
    resumed, _, av = _run(case, "cpu", resume_from=state)
    assert _same(whole, resumed)
    assert all(a.device.type == "cpu" for a in av.rounds.anchors.first)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["sync.outer_state=gpu"], "sync.outer_state must be one of device, cpu, got 'gpu'"),
        ([], "sync.outer_state=cpu with sync.outer=none: there is no anchor or outer momentum"),
        (["sync.outer=diloco", "comm.disabled=true"],
         "comm.disabled=true with sync.outer_state=cpu: nothing syncs"),
    ],
)  # fmt: skip
def test_outer_state_cpu_is_refused_in_one_line_where_there_is_nothing_to_move(overrides, named):
    cfg = compose_config(["sync.outer_state=cpu", *overrides])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    validate(compose_config(["sync.outer_state=cpu", "sync.outer=diloco"]))  # where it holds
    validate(compose_config(["sync.outer_state=cpu", "sync=streaming_diloco"]))
    # torchft rolls the host state back with a failed round; a robust rule judges on the host
    validate(compose_config(["sync.outer_state=cpu", "sync.outer=diloco", "ft=torchft"]))
    validate(compose_config(["sync.outer_state=cpu", "sync.outer=diloco",
                             "sync.aggregate=median"]))  # fmt: skip


@pytest.mark.timeout(10)
def test_the_peak_allocated_is_read_and_reset_on_cuda_and_absent_elsewhere(monkeypatch):
    assert PeakMemory(torch.device("cpu")).interval() == {}
    assert PeakMemory(torch.device("cpu")).run() == {}
    allocator = {"peak": 0, "resets": 0}

    def reset(device=None):
        allocator["resets"] += 1
        allocator["peak"] = 0

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    peak = PeakMemory(torch.device("cuda", 0))
    assert allocator["resets"] == 1  # the setup's peak is not the training's
    allocator["peak"] = 500
    assert peak.interval() == {"peak_allocated_bytes": 500}
    allocator["peak"] = 300  # a lower peak in the next interval: the run keeps the highest
    assert peak.interval() == {"peak_allocated_bytes": 300}
    allocator["peak"] = 200
    assert peak.run() == {"peak_allocated_bytes": 500}


@pytest.mark.timeout(30)
def test_the_trainer_reports_the_peak_in_each_metrics_line_and_the_summary(
    lone_group, monkeypatch, tmp_path
):
    """The trainer's wiring, on CPU as if it were CUDA: torch.cuda's counter replaced by one
    that grows by 100 bytes a read, so each line shows its own interval's peak."""
    import json

    from localsgd.loop import trainer as trainer_module
    from localsgd.loop.trainer import Trainer
    from localsgd.loop.worker import WorkerInfo
    from tests.helpers import SMALL

    reads = {"n": 0}

    def max_memory_allocated(device=None):
        reads["n"] += 1
        return 100 * reads["n"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    monkeypatch.setattr(
        trainer_module, "PeakMemory", lambda device: PeakMemory(torch.device("cuda", 0))
    )
    cfg = compose_config(
        SMALL + ["trainer.max_steps=8", "trainer.log_every=4", "trainer.checkpoint_every=0",
                 "logger.wandb.mode=disabled", "logger.plots=false", "trainer.sample_chars=0"]
    )  # fmt: skip
    summary = Trainer(cfg, WorkerInfo(0, 1, 0, 1), torch.device("cpu"), str(tmp_path)).train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    peaks = [x["peak_allocated_bytes"] for x in lines if "loss" in x]
    assert peaks == [100, 200]  # steps 4 and 8, each its own interval's
    assert summary["peak_allocated_bytes"] == 300  # the run's: the last read, after the end
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["peak_allocated_bytes"] == 300
