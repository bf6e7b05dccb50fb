"""`optim=muon`: torch's Muon on the weight matrices, AdamW on the rest (MuLoCo's inner
optimizer), one optimizer to the loop, checkpointed and resumed whole."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import CommStats, OptimizerStateSync
from localsgd.loop.checkpoint.state import moved_optimizer_state as _average_optimizer
from localsgd.loop.muon import MuonAdamW
from localsgd.loop.optim import build_optimizer, set_lr
from localsgd.models.transformer import GPT
from tests.helpers import compose_config

pytestmark = pytest.mark.timeout(60)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=11, max_len=8, d_model=16, n_layers=2, n_heads=2)


def _step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (4, 9), generator=gen)
    opt.zero_grad()
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 11), x[:, 1:].reshape(-1)).backward()
    opt.step()


def test_the_muon_preset_puts_weight_matrices_under_muon_and_the_rest_under_adamw():
    cfg = compose_config(["optim=muon", "optim.lr=0.01"])
    model = _gpt()
    opt = build_optimizer(model.parameters(), cfg.optim, module=model)
    assert isinstance(opt, MuonAdamW)
    under_muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    under_adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    matrices = {
        id(m.weight)
        for block in model.blocks
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert under_muon == matrices  # every block's Linear weight, nothing else
    assert under_adamw == {id(p) for p in model.parameters()} - matrices
    for p in (model.tok.weight, model.pos.weight, model.head.weight, model.head.bias):
        assert id(p) in under_adamw  # embeddings, the head and biases/norms: AdamW
    assert [g["inner"] for g in opt.param_groups] == ["muon", "adamw"]
    assert all(g["lr"] == g["initial_lr"] == 0.01 for g in opt.param_groups)
    _step(model, opt, 1)
    for p in model.parameters():
        keys = set(opt.state[p])
        assert keys == ({"momentum_buffer"} if id(p) in matrices else
                        {"step", "exp_avg", "exp_avg_sq"}), keys  # fmt: skip
    set_lr(opt, lambda step, peak: peak / 2, 0)  # the schedule reaches both optimizers
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[0]["lr"] == 0.005


def test_a_checkpoint_holds_both_optimizers_and_resumes_bit_identically():
    cfg = compose_config(["optim=muon"])
    model = _gpt()
    opt = build_optimizer(model.parameters(), cfg.optim, module=model)
    for seed in range(3):
        _step(model, opt, seed)
    state = copy.deepcopy(opt.state_dict())
    assert {"momentum_buffer", "exp_avg"} <= {k for s in state["state"].values() for k in s}
    twin = _gpt()
    twin.load_state_dict(model.state_dict())
    twin_opt = build_optimizer(twin.parameters(), cfg.optim, module=twin)
    twin_opt.load_state_dict(state)
    assert twin_opt.muon.state is twin_opt.state and twin_opt.adamw.state is twin_opt.state
    for seed in range(3, 6):
        _step(model, opt, seed)
        _step(twin, twin_opt, seed)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    # resharding averages the old workers' states element-wise: it reads this state_dict
    merged = _average_optimizer([state, state])
    twin_opt.load_state_dict(merged)


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_averaging_the_optimizer_state_reaches_both_optimizers(lone_group):
    model = _gpt()
    opt = build_optimizer(model.parameters(), compose_config(["optim=muon"]).optim, module=model)
    _step(model, opt, 0)
    stats = CommStats()
    from localsgd.averaging.comm import Communicator

    OptimizerStateSync(opt, "average")(Communicator(None, stats))
    state_bytes = sum(
        v.numel() * 4 for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    assert stats.bytes == state_bytes  # Muon's momentum and Adam's moments, all of them


def test_muon_on_sharded_replicas_is_accepted():
    from localsgd.cli.checks import validate

    validate(compose_config(["optim=muon", "dist.shard_size=2", "dist.world_size=4"]))


def _sharded_muon_worker(rank: int, world: int) -> dict:
    """2 ranks as one replica group sharding an MLP (FSDP2), MuonAdamW over its DTensors, next
    to the same MLP whole with torch's Muon: the same batch on both ranks (FSDP's mean of two
    equal gradients is the gradient), 4 steps."""
    from localsgd.loop.fsdp import Sharding
    from localsgd.loop.muon import MuonAdamW, ShardedMuon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12),
                                torch.nn.Tanh(), torch.nn.Linear(12, 3))  # fmt: skip
    sharded = copy.deepcopy(whole)
    sharded = Sharding(2, world, torch.device("cpu")).shard(sharded)
    opts = [MuonAdamW(m.parameters(), m, lr=0.02) for m in (whole, sharded)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        for model, opt in zip((whole, sharded), opts, strict=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    return {
        "sharded_muon": isinstance(opts[1].muon, ShardedMuon),
        "diff": max((full[n] - p).abs().max().item() for n, p in whole.named_parameters()),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sharded_muon_takes_the_unsharded_step():
    from localsgd.cli.launch import run_on_workers

    for got in run_on_workers(_sharded_muon_worker, 2):
        assert got["sharded_muon"]
        assert got["diff"] <= 1e-6, got["diff"]


def test_muon_on_a_model_without_matrices_is_refused_in_one_line(tmp_path, capsys):
    from tests.helpers import refusal

    line = refusal(["optim=muon", "model=cnn", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert "optim=muon needs 2-D weight matrices" in line and "model=mlp" in line, line
