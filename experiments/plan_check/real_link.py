"""A real slow link beside the prediction (issue 51, item 4): two network namespaces, one veth
pair, a `tbf` rate limit on both ends, no `comm.simulate`.

This machine's kernel has the `tbf` qdisc (a token-bucket rate limit) but not `netem`, so the link
is slow in bandwidth only: its latency is the veth's and gloo's own. The script (root only):

1. makes namespaces `lsgd-plan-a` and `lsgd-plan-b`, joined by the veth pair `lsgdpa`/`lsgdpb`
   with the addresses 10.231.7.1 and 10.231.7.2 (a /30 inside the namespaces, no route out) and
   `tc qdisc ... tbf rate RATE` on each end, so each direction carries RATE;
2. probes the link between the two namespaces as the plan does (`localsgd.planner.measure.
   probe_link`: a one-value all-reduce's time, then an all-reduce and an all-gather of the
   model's fp32 size), one worker in each namespace, gloo bound to the veth (`GLOO_SOCKET_IFNAME`);
3. runs each setting of SETTINGS for real, `torchrun --nnodes 2` with one worker per namespace
   (the rendezvous at 10.231.7.1), the LM job of check.py, with the `StepClock` callback;
4. predicts each run's utilisation with the model, from the probed link and the run's own step
   times (as check.py does), and writes real_link.json and real_link.md beside this file;
5. removes the namespaces (and with them the veth pair), whatever happened.

    python experiments/plan_check/real_link.py                 # 50 Mbit/s
    python experiments/plan_check/real_link.py --rate-mbit 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import load_average, machine  # noqa: E402
from experiments.plan_check.check import corpus, job, run_step_times  # noqa: E402
from localsgd.planner.grid import BY_KEY  # noqa: E402
from localsgd.planner.model import Link, predict_run, sync_steps  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NAMESPACES = ("lsgd-plan-a", "lsgd-plan-b")
DEVICES = ("lsgdpa", "lsgdpb")
ADDRESSES = ("10.231.7.1", "10.231.7.2")
PORT = 29611
STEPS = 128
SETTINGS = ("diloco-h16", "stream-h16-p4-t1", "ddp")
BIN = os.path.dirname(sys.executable)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def make_link(rate_mbit: float) -> None:
    remove_link()
    for ns in NAMESPACES:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", DEVICES[0], "type", "veth", "peer", "name", DEVICES[1])
    for ns, dev, addr in zip(NAMESPACES, DEVICES, ADDRESSES, strict=True):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # a bucket of 64 kB (well above rate / HZ) and a queue of at most 100 ms
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "100ms")  # fmt: skip


def remove_link() -> None:
    for ns in NAMESPACES:  # deleting a namespace deletes the veth end inside it, and the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def on_both(args: list[str], timeout: float) -> None:
    """`args` (a module and its arguments) as a 2-node torchrun job, node k in namespace k."""
    procs = []
    for rank, (ns, dev) in enumerate(zip(NAMESPACES, DEVICES, strict=True)):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT}  # fmt: skip
        cmd = ["ip", "netns", "exec", ns, os.path.join(BIN, "torchrun"), "--nnodes=2",
               f"--node-rank={rank}", "--nproc-per-node=1", f"--master-addr={ADDRESSES[0]}",
               f"--master-port={PORT}", *args]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit("a torchrun node hung") from None
        outs.append((p.returncode, err))
    for code, err in outs:
        if code != 0:
            raise SystemExit(f"a torchrun node failed ({code}):\n{err[-3000:]}")


def probe(out: str, nbytes: int) -> None:
    """One worker of the link probe (under torchrun, in a namespace)."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from localsgd.planner.measure import probe_link

    dist.init_process_group("gloo", init_method="env://", timeout=dt.timedelta(seconds=120))
    try:
        record = probe_link(nbytes, torch.device("cpu"))
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(record, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--report", action="store_true", help="redo the .md from the .json")
    parser.add_argument("--probe", nargs=2, metavar=("OUT", "BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return probe(args.probe[0], int(args.probe[1]))
    json_path = os.path.join(args.out, "real_link.json")
    if args.report:
        from localsgd.planner.sizes import ModelShape

        with open(json_path) as f:
            results = json.load(f)
        derive(results, ModelShape.from_dict(results["shape"]))
        write(results, args.out)
        return results
    if os.geteuid() != 0:
        raise SystemExit("network namespaces need root")
    from localsgd.planner.cli import compose
    from localsgd.planner.sizes import ModelShape, shape_of

    shown = sys.argv[1:] if argv is None else argv
    results = {
        "command": " ".join(["python experiments/plan_check/real_link.py", *shown]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_start": load_average(),
        "rate_mbit": args.rate_mbit,
        "steps": args.steps,
        "runs": [],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plan-real-") as tmp:
        os.chmod(tmp, 0o755)
        base = job(corpus(tmp), args.steps)
        _, run_cfg, _ = compose(base)
        shape = shape_of(run_cfg)
        results["shape"] = shape.to_dict()
        try:
            make_link(args.rate_mbit)
            probe_out = os.path.join(tmp, "probe.json")
            on_both([os.path.abspath(__file__), "--probe", probe_out, str(4 * shape.params)], 300)
            with open(probe_out) as f:
                results["probe"] = json.load(f)
            print(f"probe: {results['probe']}", flush=True)
            for key in args.settings:
                setting = BY_KEY[key]
                run_dir = os.path.join(tmp, key)
                clock = os.path.join(run_dir, "clock")
                overrides = [*base, *setting.overrides(args.steps),
                             f"trainer.callbacks=[{{_target_:localsgd.planner.measure.StepClock,"
                             f"out:'{clock}'}}]", f"hydra.run.dir={run_dir}"]  # fmt: skip
                on_both(["-m", "localsgd.train", *overrides], 900)
                ranks = []
                for r in range(2):
                    with open(os.path.join(clock, f"rank{r}.json")) as f:
                        ranks.append(json.load(f))
                with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                    last = [r for r in map(json.loads, f) if "loss" in r][-1]
                results["runs"].append({"setting": key, "ranks": ranks,
                                        "comm_bytes": last["comm_bytes"]})  # fmt: skip
                print(
                    f"{key}: {ranks[0]['compute_s'] / ranks[0]['wall_s']:.3f} measured", flush=True
                )
        finally:
            remove_link()
    results["total_s"] = time.perf_counter() - t0
    results["load_end"] = load_average()
    derive(results, ModelShape.from_dict(results["shape"]))
    write(results, args.out)
    return results


def write(results: dict, out: str) -> None:
    with open(os.path.join(out, "real_link.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = render(results)
    with open(os.path.join(out, "real_link.md"), "w") as f:
        f.write(text)
    print(text)


def derive(results: dict, shape) -> None:
    probe_rec = results["probe"]
    probed = Link(probe_rec["latency_s"], probe_rec["bandwidth_gbps"], probe_rec["gather_gbps"])
    nominal = Link(probe_rec["latency_s"], results["rate_mbit"] / 1e3)
    for run in results["runs"]:
        schedule = BY_KEY[run["setting"]].schedule(shape)
        samples = run_step_times(run["ranks"])
        means = [sum(s) / len(s) for s in samples]
        r0 = run["ranks"][0]
        run["measured"] = r0["compute_s"] / r0["wall_s"]
        for name, link in (("probed", probed), ("nominal", nominal)):
            util, _ = predict_run(schedule, link, means, results["steps"], samples=samples,
                                  reps=200)  # fmt: skip
            run[f"predicted_{name}"] = util[0]
        run["bytes_expected"] = sum(
            schedule.fragment_bytes[p] for p, _, _ in sync_steps(schedule, results["steps"])
        )
        run["step_ms"] = [m * 1e3 for m in means]


def render(results: dict) -> str:
    p = results["probe"]
    lines = [
        "# A real slow link: two network namespaces, a veth pair, tbf (issue 51, item 4)",
        "",
        f"- command: `{results['command']}`; started {results['started']}, "
        f"{results['total_s']:.0f} s",
        f"- machine: {results['machine']}; load at start {results['load_start']}, at end "
        f"{results['load_end']}",
        f"- link: `tbf rate {results['rate_mbit']:g}mbit burst 64kb latency 100ms` on both ends "
        "of a veth pair between two network namespaces (no netem on this kernel: no added "
        "delay); one gloo worker in each, `torchrun --nnodes 2`, no `comm.simulate`",
        f"- probed between the two workers (`probe_link`, {p['probe_bytes']:,} bytes): latency "
        f"{p['latency_s'] * 1e3:.2f} ms (a one-value all-reduce), all-reduce payload rate "
        f"{p['bandwidth_gbps'] * 1e3:.1f} Mbit/s, all-gather {p['gather_gbps'] * 1e3:.1f} Mbit/s",
        f"- job: check.py's LM job, {results['steps']} steps, seed 0",
        "",
        "| setting | step ms (rank 0 / 1) | measured | predicted, probed link | predicted, "
        "tbf's nominal rate | rank 0's comm s | bytes (counted / predicted) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in results["runs"]:
        r0 = run["ranks"][0]
        lines.append(
            f"| {BY_KEY[run['setting']].label} | "
            + " / ".join(f"{s:.1f}" for s in run["step_ms"])
            + f" | {run['measured']:.3f} | {run['predicted_probed']:.3f} | "
            f"{run['predicted_nominal']:.3f} | {r0['comm_s']:.2f} | {run['comm_bytes']:,} / "
            f"{run['bytes_expected']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
