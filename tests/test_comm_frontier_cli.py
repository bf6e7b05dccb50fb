"""The communication frontier from the command line: Streaming DiLoCo's fragments with a delayed,
mixed merge, 4-bit pseudo-gradients with error feedback, and SparseLoCo's top-k with Muon inner
steps and DES-LOC, each killed and resumed exactly."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BASE, cli, killed_and_resumed

pytestmark = pytest.mark.slow

# 4 linear layers = 4 blocks; fragments are strided over them
STREAMING = BASE + [
    "model.hidden=[16,16,16]",
    "sync.outer=diloco",
    "sync.warmup_steps=5",
    "sync.period=8",
    "sync.fragments=2",
    "sync.delay_steps=1",
    "sync.merge_alpha=0.5",
    "sync.check_replicas=true",  # what every rank received is compared after each merge
]


@pytest.mark.timeout(240)
def test_streaming_diloco_resumes_bit_identical_with_a_fragment_in_flight(tmp_path):
    # fragment 0 is launched after step indices 5, 13, 21 and fragment 1 after 9 and 17, each
    # merged one step later: the step-10 checkpoint holds fragment 1 in flight
    reference, run_dir = killed_and_resumed(STREAMING, tmp_path)
    ours = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert ours["comm_levels"] == ref["comm_levels"]
    # warmup rounds + 5 fragment launches (+ the final blocking average of both fragments)
    rounds = ours["comm_levels"][0]["rounds"]
    assert ours["comm_rounds"] == 5 + rounds and rounds >= 5


@pytest.mark.timeout(240)
def test_4bit_diloco_with_error_feedback_resumes_bit_identical(tmp_path):
    args = BASE + [
        "sync.outer=diloco",
        "sync.comm_dtype=float4_e2m1",
        "sync.error_feedback=true",  # the residual is part of the checkpoint
        "sync.check_replicas=true",
    ]
    reference, run_dir = killed_and_resumed(args, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    fp32 = summary["params"] * 4  # what one fp32 pseudo-gradient would send
    per_sync = summary["comm_levels"][0]["bytes"] / summary["comm_levels"][0]["rounds"]
    assert per_sync <= 0.14 * fp32  # 4-bit payload plus one fp32 scale per block


@pytest.mark.timeout(120)
def test_streaming_diloco_over_hierarchical_levels_from_the_cli(tmp_path):
    # 4 workers: pairs average the whole model after steps 6, 9, ..., 21; the widest level is
    # Streaming DiLoCo's (fragments launched after 5, 9, 13, 17, 21), each merge checked
    levels = "sync.levels=[{group_size:2,period:3},{group_size:world,period:8}]"
    args = [a for a in STREAMING if not a.startswith("sync.period")]
    args += [levels, "dist.world_size=4", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"]
    proc, left = cli(args)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    inner, widest = summary["comm_levels"]
    assert (inner["group_size"], inner["period"], inner["rounds"]) == (2, 3, 6)
    assert inner["bytes"] == 6 * 4 * summary["params"]  # the whole model each time, in fp32
    # 5 launches of one fragment each, then the final blocking step of both fragments
    assert (widest["group_size"], widest["period"], widest["rounds"]) == (4, 8, 6)
    assert summary["comm_rounds"] == 5 + inner["rounds"] + widest["rounds"]


@pytest.mark.long  # ~15 s on 2 cores: `make test-long`
@pytest.mark.timeout(240)
def test_sparseloco_with_muon_and_desloc_resumes_bit_identical(tmp_path):
    """Top-k residuals, both optimizers' states (Muon's momentum, AdamW's moments) and DES-LOC's
    clock all go through the checkpoint: a SIGKILL after step 13 and a resume from the step-10
    checkpoint (between syncs) end on the uninterrupted run's model, bit for bit."""
    args = BASE + [
        "sync=sparseloco",
        "sync.period=5",
        "sync.topk_chunk=64",
        "sync.optimizer_state=desloc",
        "sync.moment_periods=[1,2]",
        "optim=muon",
        "optim.lr=0.003",
        "sync.check_replicas=true",
    ]
    _, run_dir = killed_and_resumed(args, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["comm_bytes_exp_avg"] > summary["comm_bytes_exp_avg_sq"] > 0
    assert summary["comm_bytes_momentum_buffer"] > 0
