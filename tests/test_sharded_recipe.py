"""The recipe under sharded replica groups (`dist.shard_size` > 1, localsgd/loop/fsdp.py):
the synchronous warmup (HSDP's gradient average), gradient clipping and accumulation, and mixed
precision against the replicated run on the union of each group's batches, as
tests/test_sharded.py's parity; compile and activation checkpointing against eager runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from localsgd.averaging import GradientAverager, PeriodicAverager
from localsgd.averaging.trust.robust import Aggregate
from localsgd.loop.fsdp import Sharding
from localsgd.loop.recipe import Recipe, checkpoint_activations
from tests.helpers import FAST, cli, run_distributed
from tests.test_sharded import _batch, _model

CPU = torch.device("cpu")
# name: (steps, warmup steps, trainer keys of the Recipe, tolerance against replicated)
EXACT = (1e-5, 1e-6)
CASES = {
    # every step synchronous: plain mini-batch SGD over the 4 ranks
    "warmup": (4, 4, {}, EXACT),
    # clip at 0.05: every step's norm is larger (asserted), so every step is clipped; two
    # micro-batches a step; local SGD with k=3 after a 2-step warmup
    "clip_accumulate": (
        5,
        2,
        {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
        EXACT,
    ),
    # FSDP's MixedPrecisionPolicy against autocast: both compute the linears in the low dtype
    # from fp32 masters, but bf16 gradients are summed in another order (the group's two
    # halves in fp32 after the cast; one low-dtype matmul over the whole batch): apart by
    # their rounding (measured after 4 steps: 2.6e-4 bf16, 3.1e-5 fp16; with the policy off
    # the sharded run computes in fp32, and the dtype test below fails)
    "bf16": (4, 2, {"precision": "bf16-mixed"}, (0, 1e-3)),
    "fp16": (4, 2, {"precision": "16-mixed"}, (0, 1e-4)),
    # untrusted workers' warmup: each step's gradients gathered and clipped to the median norm
    # over the whole gradient (sharded: summed across the group's shards; apart, the shards
    # would be clipped each by its own norm and the models part)
    "warmup_clip": (4, 4, {}, EXACT),
}
ROBUST_WARMUP = {"warmup_clip": Aggregate("clip", clip_multiple=1.0)}


def _train(rank: int, world: int, shard_size: int) -> dict:
    """Every case on this rank: the whole model after each step, and each step's clipped
    gradient norm (the norm over the whole model, read before the clip)."""
    torch.set_num_threads(1)
    sharding = Sharding(shard_size, world, CPU)
    group, part = rank // shard_size, rank % shard_size
    out = {}
    clip = torch.nn.utils.clip_grad_norm_
    for name, (steps, warmup, keys, _) in CASES.items():
        model = sharding.shard(_model(), keys.get("precision", "32-true"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        recipe = Recipe(model, CPU, **keys, sharded=sharding.sharded)
        computed = set()  # the dtypes the first linear computes with
        model[0].register_forward_pre_hook(lambda m, _, c=computed: c.add(m.weight.dtype))
        averager = PeriodicAverager(3, warmup, process_group=sharding.replicate_group, module=model)
        grads = GradientAverager(
            model, sharding.replicate_group, init_sync=False, aggregate=ROBUST_WARMUP.get(name)
        )
        norms, models = [], []

        def recorded(params, max_norm, _norms=norms, **kw):
            norm = clip(params, max_norm, **kw)
            _norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            return norm

        torch.nn.utils.clip_grad_norm_ = recorded
        for step in range(steps):
            opt.zero_grad(set_to_none=step >= warmup)
            k = recipe.accumulate
            for micro in range(k):
                x, y = _batch(group, 10 * step + micro, part, shard_size)
                with recipe.autocast():
                    logits = recipe.forward(x)
                recipe.backward(nn.functional.cross_entropy(logits.float(), y) / k)
            if step < warmup:
                grads.all_reduce()
            recipe.step(opt)
            averager.maybe_average()
            full = sharding.full_state(model) or model.state_dict()
            models.append({k: v.detach().clone() for k, v in full.items()})
        torch.nn.utils.clip_grad_norm_ = clip
        out[name] = {
            "models": models,
            "norms": norms,
            "rounds": grads.stats.rounds,
            "held": sum(b.untyped_storage().nbytes() for b in grads.buffers),  # between steps
            "numel": sum(b.numel() for b in grads.buffers),
            "computed": computed,
            "masters": {type(p).__name__ + str(p.dtype) for p in model.parameters()},
            "scale": recipe.scaler.get_scale() if recipe.scaler else None,
        }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train, 4, 2, timeout_s=60), run_distributed(_train, 2, 1, timeout_s=60)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_the_sharded_recipe_steps_as_the_replicated_one_on_the_union_of_the_batches(runs, case):
    sharded, replicated = runs
    steps, warmup, keys, (rtol, atol) = CASES[case]
    for rank, result in enumerate(sharded):
        ref = replicated[rank // 2][case]
        for step in range(steps):
            for k, v in ref["models"][step].items():
                got = result[case]["models"][step][k]
                torch.testing.assert_close(got, v, rtol=rtol, atol=atol, msg=f"{case} {step} {k}")
        # the norm clipped is the whole model's, not this rank's shard's
        torch.testing.assert_close(result[case]["norms"], ref["norms"], rtol=1e-5, atol=0)
        assert result[case]["rounds"] == warmup
        # sharded, the warmup's mirror of the gradient shards is released between steps;
        # unsharded, its buffers are the gradients' own storage
        assert result[case]["held"] == 0 and result[case]["numel"] > 0
    assert replicated[0][case]["held"] == 4 * replicated[0][case]["numel"]
    if "gradient_clip_val" in keys:
        assert len(sharded[0][case]["norms"]) == steps
        assert min(sharded[0][case]["norms"]) > keys["gradient_clip_val"]  # every step clipped
    # the warmup keeps every rank's model the same: the groups' shards agree bit for bit
    for step in range(warmup):
        for result in sharded[1:]:
            for k, v in sharded[0][case]["models"][step].items():
                assert torch.equal(result[case]["models"][step][k], v), (case, step, k)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_cli_runs_post_local_sgd_sharded_in_16_mixed_with_checkpointing(tmp_path):
    run_dir = tmp_path / "run"
    args = FAST + [
        "+experiment=post_local_sgd",
        "sync.warmup_steps=6",  # then local SGD, k=16
        "sync.check_replicas=true",  # each shard bit-identical across the groups at each sync
        "dist.world_size=4",
        "dist.shard_size=2",
        "trainer.max_steps=20",
        "trainer.precision=16-mixed",  # FSDP's policy, and the GradScaler on sharded gradients
        "trainer.activation_checkpointing=true",  # the MLP's layers, each recomputed
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc, left = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["shard_size"] == 2 and summary["warmup_steps"] == 6
    # 6 gradient averages, the model average after step 6 (the warmup's end; the next, 22, is
    # past the end), then the final one
    assert summary["replica_checks"] == 8 and summary["comm_rounds"] == 8


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_sharded_mixed_precision_computes_in_the_low_dtype_from_fp32_shards(runs, case, dtype):
    sharded, replicated = runs
    for result in sharded:
        assert result[case]["computed"] == {dtype}  # FSDP gathered the unit in `dtype`
        assert result[case]["masters"] == {"DTensortorch.float32"}  # the shards stay fp32
        # the GradScaler's found-inf is reduced inside a group: its ranks scale alike
        assert result[case]["scale"] == sharded[0][case]["scale"]
    assert replicated[0][case]["computed"] == {torch.float32}  # autocast casts per op instead
    if case == "fp16":
        assert sharded[0][case]["scale"] == replicated[0][case]["scale"] == 65536.0


def _gpt(sharding: Sharding, rank: int, mode: str) -> dict:
    """A tiny GPT (dropout on) trained 3 steps in `mode`: eager, compiled (trainer.compile) or
    checkpointed (trainer.activation_checkpointing); its final state, and how many times its
    blocks' attention ran (a checkpointed block runs it again in the backward)."""
    from localsgd.models.transformer import GPT

    torch.manual_seed(0)
    model = GPT(16, 8, d_model=16, n_layers=2, n_heads=2, dropout=0.1)
    runs = [0]
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    if mode == "checkpointed":
        checkpoint_activations(model)
    model = sharding.shard(model, compile=mode == "compiled")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    recipe = Recipe(model, CPU, compile=mode == "compiled", sharded=sharding.sharded)
    torch.manual_seed(1 + rank)  # dropout's masks
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = (
            torch.randint(0, 16, (2, 8), generator=gen),
            torch.randint(0, 16, (2, 8), generator=gen),
        )
        loss = nn.functional.cross_entropy(recipe.forward(x).flatten(0, 1), y.flatten())
        recipe.backward(loss)
        recipe.step(opt)
        opt.zero_grad()
    state = sharding.full_state(model) or model.state_dict()
    return {"model": {k: v.detach().clone() for k, v in state.items()}, "runs": runs[0]}


MODES = ("eager", "compiled", "checkpointed")


def _recipe_gpt(rank: int, world: int, shard_size: int) -> dict:
    """`_gpt` in every mode, sharded over `shard_size` ranks; compiled through a counting
    backend that runs the captured graph as is (so compiled equals eager bit for bit, and the
    test costs no inductor compile; the real backend: see docs/strategies.md)."""
    torch.set_num_threads(1)
    graphs: list[int] = []

    def backend(gm, _inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    compile_ = nn.Module.compile
    nn.Module.compile = lambda self: compile_(self, backend=backend)
    sharding = Sharding(shard_size, world, CPU)
    out = {}
    for mode in MODES:
        out[mode] = _gpt(sharding, rank, mode)
        out[mode]["graphs"] = len(graphs)
    nn.Module.compile = compile_
    return out


@pytest.fixture(scope="module")
def gpt_runs():
    return run_distributed(_recipe_gpt, 2, 2, timeout_s=60)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_compile_compiles_each_block_before_sharding_and_trains_the_same_model(gpt_runs):
    for result in gpt_runs:
        eager, compiled = result["eager"], result["compiled"]
        # the blocks share one graph (same code, parameters as inputs); none without compile
        assert eager["graphs"] == 0 and compiled["graphs"] >= 1
        assert compiled["model"].keys() == eager["model"].keys()  # no `_orig_mod.` prefix
        for k, v in eager["model"].items():
            assert torch.equal(compiled["model"][k], v), k


def _same_training_recomputed(eager: dict, checkpointed: dict) -> None:
    # 3 steps x 2 blocks: one forward each, and one recomputation each with checkpointing
    assert eager["runs"] == 6 and checkpointed["runs"] == 12
    assert checkpointed["model"].keys() == eager["model"].keys()  # no wrapper's prefix
    for k, v in eager["model"].items():
        assert torch.equal(checkpointed["model"][k], v), k  # dropout's masks replayed


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_activation_checkpointing_recomputes_each_sharded_block_and_trains_the_same(gpt_runs):
    for result in gpt_runs:
        _same_training_recomputed(result["eager"], result["checkpointed"])


@pytest.mark.timeout(30)
def test_activation_checkpointing_recomputes_each_block_and_trains_the_same_unsharded():
    sharding = Sharding(1, 1, CPU)  # no mesh: the process group is never touched
    _same_training_recomputed(_gpt(sharding, 0, "eager"), _gpt(sharding, 0, "checkpointed"))
