"""`make gpu-check`: the CUDA paths, checked on a machine with a GPU in under five minutes.

One line per check (PASS / FAIL / SKIP, the check's name, what it saw); exit 1 if any failed.
On a machine without CUDA it says so in one line and exits 2. `--cpu` runs the same checks on
CPU with gloo (the CUDA-only ones skipped): the test suite uses it to prove the script itself
works where no GPU is lent.

Checks: device pick (cuda, nccl, one worker per GPU); NCCL's ReduceOp.AVG in an all-reduce and
in the averager; bf16-mixed and 16-mixed training (fp32 parameters, a finite falling loss, the
GradScaler on the GPU); pinned-memory loading; the CUDA RNG state through a checkpoint; a run
killed mid-way resuming bit-identical; `ft=torchft` (torchft's NCCL process group, 4-bit
messages gathered on the device) giving the same model as without it; sharded DiLoCo
(`dist.shard_size=2`, FSDP2 on NCCL, with 2 GPUs or more); DiLoCo's outer state in pinned host
memory (`sync.outer_state=cpu`: the device memory it frees, what an outer step then costs, the
model against `device`); and a short `make train` on dist.device=cuda (with the peak allocated
in its summary).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run as a script from anywhere: `localsgd` from this checkout

# the small job of the exact-resume check (as tests/reliability_helpers.BASE): dropout makes the
# per-rank RNG state, CUDA's included, matter for an exact resume
RESUME_JOB = [
    "data=synthetic", "data.num_samples=600", "model=mlp", "model.hidden=[16]",
    "model.dropout=0.1", "trainer.batch_size=8", "trainer.max_steps=24",
    "trainer.checkpoint_every=5", "trainer.log_every=4", "trainer.eval_every=8",
    "trainer.progress=false", "trainer.deterministic=true", "sync.warmup_steps=6",
    "sync.period=5", "dist.timeout_s=60", "logger.wandb.mode=disabled",
]  # fmt: skip


class Checks:
    def __init__(self):
        self.failed = 0

    def run(self, name: str, fn) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
        except Skip as e:
            print(f"SKIP {name}: {e}", flush=True)
            return
        except Exception as e:  # noqa: BLE001 - every failure is reported, the rest still run
            self.failed += 1
            last = (str(e).strip().splitlines() or [""])[-1]
            print(f"FAIL {name}: {type(e).__name__}: {last}", flush=True)
            if os.environ.get("GPU_CHECK_VERBOSE"):
                traceback.print_exc()
            return
        print(f"PASS {name}: {detail} ({time.perf_counter() - start:.1f} s)", flush=True)


class Skip(Exception):
    pass


def check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# ----------------------------------------------------------------------------------------------
def device_pick(device: str) -> str:
    from localsgd.cli.launch import pick_backend, pick_device, resolve_world_size

    picked = pick_device("auto" if device == "cuda" else "cpu", 0)
    check(picked.type == device, f"dist.device=auto picked {picked}, expected {device}")
    backend = pick_backend("auto", picked)
    check(backend == ("nccl" if device == "cuda" else "gloo"), f"backend {backend}")
    world = resolve_world_size(None, "auto" if device == "cuda" else "cpu")
    expected = torch.cuda.device_count() if device == "cuda" else 4
    check(world == expected, f"dist.world_size=null gives {world}, expected {expected}")
    return f"{picked}, {backend}, {world} worker(s) by default"


def _collective_worker(info, store, device: str, out: str) -> None:
    import torch.distributed as dist

    from localsgd.averaging import CommStats, PeriodicAverager
    from localsgd.averaging.comm import supports_avg
    from localsgd.cli.launch import init_process_group, pick_backend, pick_device

    dev = pick_device(device, info.local_rank)
    init_process_group(info, pick_backend("auto", dev), 60, store)
    try:
        x = torch.full((1000,), float(info.rank + 1), device=dev)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)  # NCCL's (and gloo's, torch >= 2.13) average
        mean = (info.world_size + 1) / 2
        torch.manual_seed(info.rank)  # different replicas, averaged by the averager
        model = torch.nn.Linear(64, 8).to(dev)
        expected = [p.detach().clone() for p in model.parameters()]
        for t in expected:
            dist.all_reduce(t)
            t.div_(info.world_size)
        averager = PeriodicAverager(1, module=model, stats=CommStats())
        averager.maybe_average()
        close = all(
            torch.allclose(p, e, rtol=1e-6, atol=1e-7)
            for p, e in zip(model.parameters(), expected, strict=True)
        )
        result = {
            "avg_ok": bool(torch.allclose(x, torch.full_like(x, mean))),
            "averager_ok": close,
            "uses_avg": supports_avg(None),
            "backend": dist.get_backend(),
        }
        torch.save(result, os.path.join(out, f"{info.rank}.pt"))
    finally:
        dist.destroy_process_group()


def collectives(device: str) -> str:
    from localsgd.cli.launch import spawn

    world = torch.cuda.device_count() if device == "cuda" else 2
    with tempfile.TemporaryDirectory() as out:
        spawn(_collective_worker, world, 120, args=(device, out))
        results = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]
    for r in results:
        check(r["avg_ok"], "all_reduce(ReduceOp.AVG) is not the mean")
        check(r["averager_ok"], "PeriodicAverager's average differs from all_reduce / W")
    backend = results[0]["backend"]
    if device == "cuda":
        check(backend == "nccl", f"backend {backend}, not nccl")
        check(results[0]["uses_avg"] is not False, "the averagers would not use NCCL's AVG")
    note = "" if world > 1 else " (one GPU: a group of one; more GPUs exercise the ring)"
    return f"{backend}, {world} rank(s), ReduceOp.AVG and the averager agree{note}"


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import localsgd.cli.train  # noqa: F401  (registers the schemas)
    from localsgd.cli.overrides import CONF_DIR
    from localsgd.config import typed

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return typed(compose("config", overrides=overrides))


def _precision_worker(info, store, device: str, precision: str, out: str) -> None:
    import torch.distributed as dist

    from localsgd.cli.launch import init_process_group, pick_backend, pick_device
    from localsgd.loop.trainer import Trainer

    dev = pick_device(device, info.local_rank)
    init_process_group(info, pick_backend("auto", dev), 60, store)
    try:
        cfg = _config(
            ["data=synthetic", "data.num_samples=2000", "model=mlp", "trainer.max_steps=60",
             "trainer.batch_size=32", "trainer.progress=false", "trainer.track_drift=false",
             "sync.period=4", f"trainer.precision={precision}", "logger.wandb.mode=disabled"]
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as run_dir:
            t = Trainer(cfg, info, dev, run_dir)
            losses = [float(t.train_step(s)) for s in range(cfg.trainer.max_steps)]
            dtypes = {str(p.dtype) for p in t.model.parameters()}
            dtypes |= t.sync.buffer_dtypes
            scaler = t.recipe.scaler
            result = {
                "first": sum(losses[:10]) / 10,
                "last": sum(losses[-10:]) / 10,
                "dtypes": sorted(dtypes),
                "scale": None if scaler is None else float(scaler.get_scale()),
                "scaler_device": None if scaler is None else scaler._device,
                "accuracy": t.evaluate(split="test")["test_accuracy"],
            }
        torch.save(result, os.path.join(out, f"{info.rank}.pt"))
    finally:
        dist.destroy_process_group()


def precision(device: str, name: str) -> str:
    from localsgd.cli.launch import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_precision_worker, 1, 180, args=(device, name, out))
        r = torch.load(os.path.join(out, "0.pt"))
    check(r["dtypes"] == ["torch.float32"], f"parameters / averaged buffers are {r['dtypes']}")
    check(r["last"] < 0.8 * r["first"], f"loss {r['first']:.3f} -> {r['last']:.3f}: not learning")
    if name == "16-mixed":
        check(r["scale"] is not None and r["scale"] > 0, f"GradScaler scale {r['scale']}")
        check(r["scaler_device"] == device, f"GradScaler on {r['scaler_device']}")
    extra = f", GradScaler scale {r['scale']:g}" if r["scale"] is not None else ""
    return (
        f"loss {r['first']:.3f} -> {r['last']:.3f}, accuracy {r['accuracy']:.3f}, fp32 "
        f"parameters{extra}"
    )


def pinned_loading(device: str) -> str:
    if device != "cuda":
        raise Skip("pinned memory needs CUDA")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(256, 40), torch.randint(0, 10, (256,)))
    loader = DataLoader(data, batch_size=64, pin_memory=True, num_workers=1)
    moved = 0
    for x, y in loader:
        check(x.is_pinned() and y.is_pinned(), "DataLoader(pin_memory=True) gave unpinned batches")
        xg = x.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        check(torch.equal(xg.cpu(), x), "non_blocking copy changed the batch")
        moved += len(x)
    return f"{moved} samples through pinned batches and non_blocking copies"


def cuda_rng(device: str) -> str:
    if device != "cuda":
        raise Skip("no CUDA RNG on CPU")
    from localsgd.loop import checkpoint

    torch.cuda.manual_seed_all(7)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rng.pt")
        torch.save(checkpoint.rng_state(), path)
        expected = torch.rand(4, device="cuda")
        torch.cuda.manual_seed_all(8)  # disturb it
        state = torch.load(path, weights_only=True)
    check(len(state["cuda"]) == torch.cuda.device_count(), "CUDA RNG states not all saved")
    checkpoint.set_rng_state(state)
    check(torch.equal(torch.rand(4, device="cuda"), expected), "CUDA RNG not restored")
    return f"{len(state['cuda'])} CUDA generator state(s) round-trip through a checkpoint file"


def _cli(args: list[str], timeout: float, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    if fault:  # tests/faults.py, a trainer callback (importable from the repository root)
        args = [*args, f"trainer.callbacks=[{{_target_:tests.faults.Fault,spec:'{fault}'}}]"]
    cmd = [sys.executable, "-m", "localsgd.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _same_model(a: str, b: str) -> bool:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def exact_resume(device: str, tmp: str) -> str:
    world = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    args = RESUME_JOB + [f"dist.device={device}", f"dist.world_size={world}"]
    ref, run = os.path.join(tmp, "reference"), os.path.join(tmp, "resumed")
    proc = _cli(args + [f"hydra.run.dir={ref}"], 120)
    check(proc.returncode == 0, f"reference run failed: {proc.stderr.strip()[-300:]}")
    proc = _cli(args + [f"hydra.run.dir={run}"], 120, fault="kill:0:13")
    check(proc.returncode == 1, f"the kill at step 13 did not stop the run ({proc.returncode})")
    proc = _cli(args + [f"hydra.run.dir={run}"], 120)
    check(proc.returncode == 0, f"resumed run failed: {proc.stderr.strip()[-300:]}")
    check("resuming from" in proc.stderr, "the second run did not resume")
    check(
        _same_model(os.path.join(run, "model.pt"), os.path.join(ref, "model.pt")),
        "resumed model differs from the uninterrupted one",
    )
    return f"{world} worker(s), killed at step 13, resumed from step 10: bit-identical model"


def fault_tolerant(device: str, tmp: str) -> str:
    """`ft=torchft` on the device (torchft's NCCL process group on CUDA): Streaming DiLoCo in 4
    bits with error feedback, its messages all-gathered through the Manager into a buffer on the
    device, gives the same model as without `ft=`."""
    if device != "cuda":  # on CPU it is tests/test_ft_cli.py's no-fault test, in make test
        raise Skip("needs CUDA (the CPU path is tests/test_ft_cli.py's)")
    world = max(1, torch.cuda.device_count())
    args = [
        "data=synthetic", "data.num_samples=600", "model=mlp", "model.hidden=[32,32]",
        "trainer.batch_size=16", "trainer.max_steps=24", "trainer.checkpoint_every=0",
        "trainer.progress=false", "trainer.eval_every=1000", "sync.period=4",
        "sync.outer=diloco", "optim=adamw", "sync.fragments=2", "sync.comm_dtype=int4",
        "sync.error_feedback=true", "sync.check_replicas=true", "dist.timeout_s=60",
        "logger.wandb.mode=disabled", f"dist.device={device}", f"dist.world_size={world}",
    ]  # fmt: skip
    plain, ft = os.path.join(tmp, "ft-plain"), os.path.join(tmp, "ft-torchft")
    proc = _cli(args + [f"hydra.run.dir={plain}"], 120)
    check(proc.returncode == 0, f"run without ft failed: {proc.stderr.strip()[-300:]}")
    proc = _cli(args + ["ft=torchft", f"hydra.run.dir={ft}"], 180)
    check(proc.returncode == 0, f"ft=torchft failed: {proc.stderr.strip()[-300:]}")
    check(
        _same_model(os.path.join(plain, "model.pt"), os.path.join(ft, "model.pt")),
        "the model through torchft differs from the one without ft=",
    )
    return f"{world} replica group(s), 4-bit Streaming DiLoCo: the same model with and without ft="


def sharded(device: str, tmp: str) -> str:
    """`dist.shard_size=2`: DiLoCo across replica groups of 2 GPUs each, FSDP2 on NCCL inside
    a group; needs 2 GPUs at least (NCCL takes one rank per GPU)."""
    if device != "cuda":  # on CPU it is tests/test_sharded.py's, in make test
        raise Skip("needs CUDA (the CPU path is tests/test_sharded.py's)")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise Skip(f"needs 2 GPUs for 2 ranks a group, {gpus} here")
    world = gpus - gpus % 2
    run_dir = os.path.join(tmp, "sharded")
    args = [
        "data=synthetic", "data.num_samples=1200", "model=mlp", "model.hidden=[64,64]",
        "trainer.batch_size=16", "trainer.max_steps=24", "trainer.checkpoint_every=0",
        "trainer.progress=false", "trainer.eval_every=1000", "sync.period=4",
        "sync.outer=diloco", "optim=adamw", "sync.check_replicas=true", "dist.timeout_s=60",
        "logger.wandb.mode=disabled", "dist.device=cuda", f"dist.world_size={world}",
        "dist.shard_size=2", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    proc = _cli(args, 180)
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    check(summary["replica_checks"] > 0, "no sync was checked across the groups")
    state = summary["state_bytes"]
    return f"{world // 2} groups of 2 GPUs, rank 0 holds {state['total']:,} bytes of state"


def _outer_state_run(dev: torch.device, state: str) -> dict:
    """DiLoCo on a 134M-parameter model (8 x 4096^2, 537 MB in fp32), one GPU, with its outer
    state where `state` says: the device memory the averager holds, one outer step's time."""
    import statistics

    from localsgd.averaging import OuterAverager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(8))).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=dev).manual_seed(1)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(64, 4096, device=dev, generator=gen)).square().mean().backward()
        opt.step()

    step()  # the gradients and AdamW's moments exist: what is held from here is the averager's
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    averager = OuterAverager(2, module=model, outer_state=state)
    rounds = []
    for _ in range(8):  # outer steps after steps 0, 2, 4, 6 (momentum from the first)
        step()
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        acted = averager.maybe_average()
        torch.cuda.synchronize(dev)
        if acted:
            rounds.append(time.perf_counter() - start)
    return {
        "held": torch.cuda.memory_allocated(dev) - base,
        "round_s": statistics.median(rounds[1:]),  # the first pays one-time costs
        "pinned": all(a.is_pinned() for a in averager.rounds.anchors.first),
        "on_host": all(a.device.type == "cpu" for a in averager.rounds.anchors.first),
        "model": [p.detach().cpu() for p in model.parameters()],
    }


def _streaming_run(dev: torch.device, state: str) -> list[torch.Tensor]:
    """Streaming DiLoCo (2 fragments, τ = 1, α = 0.5) with its outer state where `state` says,
    the replica check after every merge (host anchors beside device values, gathered on NCCL);
    the final model."""
    from localsgd.averaging import StreamingAverager
    from localsgd.loop.guards import check_replicas

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    averager = StreamingAverager(
        8, module=model, fragments=2, delay_steps=1, merge_alpha=0.5, outer_state=state
    )
    gen = torch.Generator(device=dev).manual_seed(1)
    for step in range(20):
        opt.zero_grad()
        model(torch.randn(32, 512, device=dev, generator=gen)).square().mean().backward()
        opt.step()
        averager.maybe_average()
        if averager.merged:
            check_replicas(averager.common_tensors(), step, 0)
    averager.average()
    return [p.detach().cpu() for p in model.parameters()]


def _outer_state_worker(info, store, device: str, out: str) -> None:
    import torch.distributed as dist

    from localsgd.cli.launch import init_process_group, pick_backend, pick_device

    dev = pick_device(device, info.local_rank)
    init_process_group(info, pick_backend("auto", dev), 60, store)
    try:
        result = {}
        for state in ("device", "cpu"):
            result[state] = _outer_state_run(dev, state)
            torch.cuda.empty_cache()
        result["streaming"] = {s: _streaming_run(dev, s) for s in ("device", "cpu")}
        torch.save(result, os.path.join(out, f"{info.rank}.pt"))
    finally:
        dist.destroy_process_group()


def outer_state_on_host(device: str) -> str:
    """`sync.outer_state=cpu` on one GPU: the anchor and outer momentum pinned in host memory,
    the device memory that frees (two model-sized copies), one outer step's time against
    `device`, and the model against `device`'s: the same bits where the GPU's SGD kernels
    round as the CPU's, else within float32 rounding (the largest difference is reported)."""
    if device != "cuda":  # on CPU: tests/test_outer_state.py and tests/test_sharded.py
        raise Skip("needs CUDA (the CPU path is tests/test_outer_state.py's)")
    from localsgd.cli.launch import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_outer_state_worker, 1, 180, args=(device, out))
        r = torch.load(os.path.join(out, "0.pt"))
    dev, host = r["device"], r["cpu"]
    check(host["on_host"] and host["pinned"], "the anchors are not in pinned host memory")
    model_bytes = sum(p.numel() * 4 for p in dev["model"])
    check(dev["held"] >= 1.9 * model_bytes, f"device mode holds {dev['held']:,} bytes")
    check(host["held"] <= 0.1 * model_bytes, f"cpu mode still holds {host['held']:,} on the GPU")
    diffs = [
        max(float((a - b).abs().max()) for a, b in zip(one, two, strict=True))
        for one, two in ((dev["model"], host["model"]), r["streaming"].values())
    ]
    check(max(diffs) < 1e-5, f"the models differ by up to {max(diffs):g} (DiLoCo, streaming)")
    same = " and ".join(
        f"{name} " + ("bit-identical" if d == 0 else f"max |difference| {d:.2g}")
        for name, d in zip(("DiLoCo", "Streaming DiLoCo"), diffs, strict=True)
    )
    return (
        f"{model_bytes / 2**20:.0f} MiB model: {dev['held'] / 2**20:.0f} MiB of outer state on "
        f"the GPU with device, {host['held'] / 2**20:.0f} MiB with cpu; one outer step "
        f"{dev['round_s'] * 1e3:.1f} ms against {host['round_s'] * 1e3:.1f} ms "
        f"({host['round_s'] / dev['round_s']:.2f}x); models {same}"
    )


def make_train(device: str, tmp: str) -> str:
    run_dir = os.path.join(tmp, "make-train")
    # make train's job, shortened: 300 synchronous steps then k=16, to step 600
    args = f"dist.device={device} trainer.max_steps=600 trainer.progress=false"
    args += f" logger.wandb.mode=disabled hydra.run.dir={run_dir}"
    if device != "cuda":
        args += " dist.world_size=2"
    cmd = ["make", "-s", "train", f"ARGS={args}"] if shutil.which("make") else None
    if cmd is None:  # no make: the same command make train runs
        cmd = [sys.executable, "-m", "localsgd.train", "+experiment=post_local_sgd", *args.split()]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    check(summary["test_accuracy"] > 0.5, f"test accuracy {summary['test_accuracy']}")
    peak = summary.get("peak_allocated_bytes")  # CUDA's counter: absent on CPU
    check((peak is not None and peak > 0) == (device == "cuda"), f"peak_allocated_bytes {peak}")
    shown = f", peak allocated {peak / 2**20:.1f} MiB" if peak else ""
    return (
        f"{summary['world_size']} worker(s), {summary['steps']} steps, test accuracy "
        f"{summary['test_accuracy']}, {summary['wall_time_s']} s{shown}"
    )


BUDGET_S = int(os.environ.get("GPU_CHECK_BUDGET_S", 300))  # the tests shorten it


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def _over_budget(signum, frame) -> None:
    print(f"FAIL gpu-check: not done within {BUDGET_S} s", flush=True)
    # Kill what this script started: a worker still starting up has not yet asked to die with
    # its parent (PR_SET_PDEATHSIG), and would otherwise outlive the check.
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signal.SIGKILL)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU/gloo instead")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); run it on a GPU machine",
            flush=True,
        )
        return 2
    device = "cpu" if args.cpu else "cuda"
    signal.signal(signal.SIGALRM, _over_budget)
    signal.alarm(BUDGET_S)  # the whole check stays within five minutes, even if a step hangs
    if device == "cuda":
        print(f"gpu-check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)  # fmt: skip
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        checks.run("device pick", lambda: device_pick(device))
        checks.run("NCCL ReduceOp.AVG" if device == "cuda" else "gloo ReduceOp.AVG",
                   lambda: collectives(device))  # fmt: skip
        checks.run("bf16-mixed", lambda: precision(device, "bf16-mixed"))
        checks.run("16-mixed", lambda: precision(device, "16-mixed"))
        checks.run("pinned-memory loading", lambda: pinned_loading(device))
        checks.run("CUDA RNG in checkpoints", lambda: cuda_rng(device))
        checks.run("exact resume", lambda: exact_resume(device, tmp))
        checks.run("ft=torchft", lambda: fault_tolerant(device, tmp))
        checks.run("sharded DiLoCo", lambda: sharded(device, tmp))
        checks.run("outer state in host memory", lambda: outer_state_on_host(device))
        checks.run(f"make train on dist.device={device}", lambda: make_train(device, tmp))
    print(f"gpu-check: {'all passed' if not checks.failed else f'{checks.failed} failed'}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
