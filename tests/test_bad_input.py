"""Bad input is refused before any worker starts (and before Hydra writes into the run
directory): exit code 2, one line naming the setting and what is allowed, no traceback, and no
file of an earlier run changed."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from localsgd.cli.overrides import check_experiment_optimizer, check_overrides
from tests.helpers import BASE, cli, refusal


def _snapshot(folder) -> dict[str, tuple[str, int]]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def corrupt_checkpoint(reference_run, tmp_path_factory):
    """A copy of the reference run's last checkpoint with one rank's file cut short."""
    folder = tmp_path_factory.mktemp("corrupt") / "step-24"
    shutil.copytree(reference_run / "checkpoints" / "step-24", folder)
    path = folder / "rank-1.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return folder


CASES = [
    ("sync.period=0", "sync.period"),
    ("optim.lr=abc", "optim.lr"),
    ("dist.world_size=0", "dist.world_size"),
    ("dist.timeout_s=0", "dist.timeout_s"),
    ("trainer.batch_size=241", "trainer.batch_size"),  # 480 train samples / 2 workers = 240
    ("data=imagenet", "data"),
    ("+experiment=nope", "experiment"),
    ("data=cifar10 data.root=/nonexistent/cifar", "data.root"),
    ("data=text data.path=/nonexistent/corpus.txt", "data.path"),
    (  # does not import
        "data._target_=localsgd.data.datasets.imagenet",
        "data._target_ must be an importable callable,",
    ),
    (
        "data._target_=tests.user_targets.no_num_classes",
        "data._target_ must return an object with train, test and",
    ),
    (  # logits of the wrong shape
        "model._target_=torch.nn.Identity",
        "model._target_ 'torch.nn.Identity' must return logits of shape (2, 10)",
    ),
    ("data.num_workers=-1", "data.num_workers"),
    ("data.alpha=abc", "data.alpha"),  # localsgd's own data keys keep their types
    ("data.classes_per_worker=1.5", "data.classes_per_worker"),
    ("trainer.max_epochs=2", "trainer.max_epochs"),  # and max_steps: which one?
    ("trainer.max_steps=null", "trainer.max_steps"),  # and no max_epochs: how long?
    ("trainer.resume=/nonexistent/checkpoints/step-5", "trainer.resume"),
    ("trainer.checkpoint_every=-1", "trainer.checkpoint_every"),
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints"),
    ("trainer.nan_policy=ignore", "trainer.nan_policy"),
    ("sync.outer_warmup_rounds=4", "sync.outer_warmup_rounds"),  # with no outer step
    ("sync=diloco sync.outer_warmup_rounds=-1", "sync.outer_warmup_rounds"),
    ("experiment=diloco", "experiment"),  # without the +: the line says to add it
    ("+experiment=diloco optim=sgd", "optim=sgd"),  # DiLoCo's AdamW lr would be kept for SGD
]


def _refused_in_one_line_leaving_untouched(args, run_dir, key, capsys) -> None:
    """`args`, aimed at an earlier run's directory as a mistyped command would be, are refused
    in one line naming `key`, and no file of that run changes."""
    before = _snapshot(run_dir)
    line = refusal(args + [f"hydra.run.dir={run_dir}"], capsys)
    assert line.startswith(f"error: {key} ")
    assert _snapshot(run_dir) == before


@pytest.fixture
def earlier_run(tmp_path):
    """A run directory with files in it, as an earlier run leaves it."""
    folder = tmp_path / "earlier"
    (folder / "checkpoints" / "step-5").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    (folder / "checkpoints" / "step-5" / "rank-0.pt").write_bytes(b"state")
    return folder


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override,key", CASES)
def test_bad_input_is_one_line_and_touches_no_earlier_run(override, key, earlier_run, capsys):
    args = BASE
    if override.startswith("data="):  # another dataset: the synthetic set's keys do not apply
        args = [a for a in BASE if not a.startswith("data")]
    _refused_in_one_line_leaving_untouched(args + override.split(), earlier_run, key, capsys)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plus", ["+", ""])
@pytest.mark.parametrize(
    "typo,meant", [("sync.peroid=4", "sync.period"), ("trainer.max_step=100", "trainer.max_steps")]
)
def test_a_mistyped_key_is_refused_naming_the_nearest_one(plus, typo, meant, capsys):
    """With `+` too: the typed nodes hold only their schema's fields, so an added key there
    would be dropped without a word and the run would go on with the default."""
    key = typo.split("=")[0]
    assert refusal(BASE + [plus + typo], capsys) == (
        f"error: {key} is not a setting; did you mean {meant}? "
        "(every key: docs/configuration.md#every-key)"
    )


@pytest.mark.timeout(10)
def test_plus_still_adds_keys_to_the_open_nodes():
    """A callable's own arguments are added with `+` (docs/configuration.md)."""
    check_overrides(
        ["+model.width=128", "+data.extra=1", "+optim.foo=0", "+lr_schedule.bar=1"]
        + ["+experiment=diloco", "++trainer.max_steps=5"]
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override",
    ["CORRUPT", "CHANGED model.hidden=[32]"],  # a checkpoint cut short; one of another model
)
def test_a_bad_resume_is_one_line_and_touches_no_earlier_run(
    override, reference_run, corrupt_checkpoint, capsys
):
    key = "trainer.resume"
    if override == "CORRUPT":
        override = f"trainer.resume={corrupt_checkpoint}"
    override = override.replace("CHANGED", f"trainer.resume={reference_run}")
    _refused_in_one_line_leaving_untouched(BASE + override.split(), reference_run, key, capsys)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_command_exits_with_code_2_and_one_line(reference_run):
    """The checks above run in-process; this one runs the command itself, for its exit code."""
    before = _snapshot(reference_run)
    proc, left = cli(BASE + ["sync.period=0", f"hydra.run.dir={reference_run}"], timeout=60)
    assert proc.returncode == 2 and not left
    assert proc.stderr.strip() == "error: sync.period must be an integer >= 1, got 0"
    assert "Traceback" not in proc.stdout and _snapshot(reference_run) == before


@pytest.mark.timeout(60)
def test_an_experiment_without_plus_and_another_optimizer_say_the_fix(capsys):
    assert refusal(BASE + ["experiment=diloco"], capsys) == (
        "error: experiment is added with a +: +experiment=diloco (it is not in the defaults "
        "list of conf/config.yaml)"
    )
    line = refusal(BASE + ["+experiment=diloco", "optim=sgd"], capsys)
    assert line == (
        "error: optim=sgd replaces the adamw of +experiment=diloco, whose optim.lr=0.003 was set "
        "for adamw and would be kept for sgd: give optim.lr=... for sgd too (the sgd preset's "
        "own: optim.lr=0.1), or leave optim=adamw"
    )
    check_experiment_optimizer(["+experiment=diloco", "optim=sgd", "optim.lr=0.05"])  # chosen
    check_experiment_optimizer(["+experiment=diloco", "optim=adamw"])  # the experiment's own
    check_experiment_optimizer(["+experiment=post_local_sgd", "optim=adamw"])  # sets no optim.*


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_run_dir_that_cannot_be_written_is_refused(key, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = BASE + [f"{key}={blocker}/run"] + (["-m"] if key == "hydra.sweep.dir" else [])
    line = refusal(args, capsys)
    assert line.startswith(
        f"error: {key} must be a directory this command can create and write to, got "
        f"{blocker}/run (not a directory at {blocker})"
    )


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there: the settings are valid")
@pytest.mark.parametrize(
    "override,fix",
    [("dist.backend=nccl", "use dist.backend=auto"), ("dist.device=cuda", "use dist.device=auto")],
)
def test_cuda_settings_without_cuda_are_refused_before_any_worker(override, fix, capsys):
    line = refusal(BASE + [override], capsys)
    assert line.startswith(f"error: {override} needs") and fix in line


@pytest.mark.timeout(60)
def test_every_job_of_a_sweep_is_checked_before_the_first_starts(capsys):
    line = refusal(BASE + ["-m", "sync.period=4,0", "seed=0,1"], capsys)
    assert line == (
        "error: sync.period must be an integer >= 1, got 0 (job 2 of the 4-job sweep: "
        "sync.period=0 seed=0; no job was started)"
    )
