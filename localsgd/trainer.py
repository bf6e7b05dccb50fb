"""One worker's training loop: local SGD, periodic averaging, an optional synchronous warmup."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from localsgd import checkpoint
from localsgd.averaging import CommStats, GradientAverager, SimulatedLink
from localsgd.config import Config, plain
from localsgd.data import (
    ShardSampler,
    eval_batches,
    input_shape_of,
    labels_of,
    load_data,
    make_batches,
    shard_indices,
    task_of,
)
from localsgd.drift import DriftMeter
from localsgd.failures import Fault, NonFiniteTracker, StopAgreement, check_replicas
from localsgd.instantiate import target_name
from localsgd.launch import WorkerInfo
from localsgd.loggers import build_loggers
from localsgd.metrics import progress_bar, trim_metrics, write_json
from localsgd.models import build_model
from localsgd.models.generate import generate_text
from localsgd.optim import build_optimizer, build_schedule, set_lr
from localsgd.recipe import Recipe
from localsgd.strategies import build_averager


def loss_and_correct(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over classes, for (B, C) class logits and (B, T, V) token logits alike."""
    logits, targets = logits.flatten(0, -2), targets.flatten()
    return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).sum()


class Trainer:
    def __init__(
        self,
        cfg: Config,
        info: WorkerInfo,
        device: torch.device,
        run_dir: str,
        resume_from: str | None = None,
        store: dist.Store | None = None,
    ):
        self.cfg = c = cfg
        self.config = plain(cfg)  # for wandb and the checkpoint marker
        self.info = info
        self.device = device
        self.run_dir = run_dir
        self.is_main = info.rank == 0

        self.data = load_data(c.data, seed=c.seed)
        shard = shard_indices(
            labels_of(self.data.train),
            info.world_size,
            info.rank,
            c.data.partition,
            seed=c.seed,
            classes_per_worker=c.data.classes_per_worker,
            alpha=c.data.alpha,
        )
        self.sampler = ShardSampler(shard, c.trainer.batch_size, seed=c.seed, rank=info.rank)
        # in memory for tensor sets, else a DataLoader over the shard (localsgd/data/loader.py)
        self.batches = make_batches(self.data, c.data, self.sampler, device)

        torch.manual_seed(c.seed)  # the same initial model on every rank
        self.model = build_model(
            c.model, input_shape_of(self.data), self.data.num_classes, task_of(self.data)
        ).to(device)
        self.comm = CommStats()
        sim = c.comm.simulate
        link = (
            SimulatedLink(sim.bandwidth_gbps, sim.latency_ms)
            if sim.bandwidth_gbps is not None or sim.latency_ms > 0
            else None
        )
        self.comm_disabled = c.comm.disabled
        self.optimizer = build_optimizer(self.model.parameters(), c.optim)
        self.lr_schedule = build_schedule(c.lr_schedule, c.trainer.max_steps)
        self.averager = build_averager(
            c.sync,
            self.model,
            self.optimizer,
            info.world_size,
            info.local_world_size,
            self.comm,
            link,
        )
        # Identical start even if ranks built different models (e.g. other torch builds); not a
        # training-time collective, so it is not counted in the comm statistics.
        self.averager.broadcast_(src=0)
        self.grad_averager = (
            GradientAverager(self.model, stats=self.comm, link=link)
            if c.sync.warmup_steps > 0
            else None
        )
        self.drift = DriftMeter(self.averager.flat.buffers) if c.trainer.track_drift else None
        # after the averager: its flat-buffer views are what gets compiled
        self.recipe = Recipe.from_config(self.model, device, c.trainer)
        self.step = 0
        self.in_sync = True  # replicas identical right now
        torch.manual_seed(c.seed + 1000 * info.rank + 1)  # dropout etc. differ per rank
        # Loop state a checkpoint carries besides the modules (the LR is a function of the step).
        self.next_eval = c.trainer.eval_every
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count = 0
        self.skipped_steps = 0
        self.elapsed_before = 0.0  # training seconds spent before the last resume
        self.resumed_from = resume_from
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        self.fault = Fault(info.rank)
        self.nonfinite = NonFiniteTracker(device)
        self.stop = StopAgreement(store, f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}")

    @property
    def samples_per_step(self) -> int:
        """Training samples one optimizer step consumes, over all workers."""
        t = self.cfg.trainer
        return t.batch_size * t.accumulate_grad_batches * self.info.world_size

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's next training batch (inputs, targets) on the device."""
        return self.batches.next()

    def forward_backward(self, poison: bool) -> torch.Tensor:
        """`accumulate_grad_batches` micro-batches, each backpropagated at 1/k of its loss, so
        the gradient is that of the mean loss over the k batches (one batch k times as large);
        returns that mean loss, detached. `poison`: the fault injection's NaN loss."""
        k = self.recipe.accumulate
        losses = []
        for _ in range(k):
            x, y = self.next_batch()
            with self.recipe.autocast():
                logits = self.recipe.forward(x)
            loss, _ = loss_and_correct(logits.float(), y)  # the loss itself in fp32
            if poison:
                loss = loss * float("nan")
            self.recipe.backward(loss if k == 1 else loss / k)
            losses.append(loss.detach())
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def train_step(self, step: int) -> torch.Tensor | None:
        """One optimizer step (of `accumulate_grad_batches` batches); returns the loss, or None
        when nan_policy=skip skipped it."""
        self.fault.before_step(step)
        set_lr(self.optimizer, self.lr_schedule, step)
        synchronous = self.averager.in_warmup
        # In the warmup the gradients are views of GradientAverager's flat buffer: zero them in
        # place. Afterwards drop them: zeroing and then accumulating into old gradients costs two
        # extra passes over the model per step (~10% of a step for a 10M MLP on CPU).
        self.optimizer.zero_grad(set_to_none=not synchronous)
        loss = self.forward_backward(self.fault.fires("nan", step))
        skip = False
        if self.cfg.trainer.nan_policy == "skip":
            skip = not bool(torch.isfinite(loss))  # a host sync per step, only under this policy
            if skip:  # drop what the bad batch contributed
                self.optimizer.zero_grad(set_to_none=not synchronous)
        else:
            self.nonfinite.observe(loss, step)
        if synchronous:
            self.grad_averager.all_reduce()  # post-local SGD's warmup: plain mini-batch SGD
        # In the warmup a skipping rank adds zero gradients but still steps, or replicas split.
        if not skip or synchronous:
            self.recipe.step(self.optimizer)
        self.skipped_steps += skip
        if not skip:
            self.averager.observe_loss(loss)  # only an adaptive period schedule reads it
        if self.comm_disabled:  # the no-communication baseline: never average
            self.in_sync = synchronous
        else:
            # drift is measured around averages that bring every replica together (widest level)
            averager = self.averager
            measure = self.drift is not None and averager.averages_all(averager.step)
            if measure:
                self.drift.before()
            averager.maybe_average()
            if measure:
                self.drift.after()
            self.in_sync = synchronous or self.averager.all_in_sync
        if self.fault.fires("desync", step):
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] += 1e-3
        return None if skip else loss.detach()

    @property
    def merged(self) -> bool:
        """With sync.overlap: the last step applied an average launched one step earlier (what
        every rank received is identical; the replicas differ by their last local step)."""
        return self.averager.merged

    def next_sync(self, step: int) -> int | None:
        """The first step index >= `step` whose update communicates, or None if none is left."""
        # a global sync: narrower hierarchical levels do not make the replicas identical
        nxt = step if step < self.cfg.sync.warmup_steps else self.averager.next_sync(step)
        return nxt if nxt < self.cfg.trainer.max_steps else None

    def after_sync(self, step: int) -> None:
        if self.cfg.sync.check_replicas:
            # In the warmup only the parameters are kept identical (BatchNorm statistics stay
            # local until the first average), so only they are compared there.
            warm = step < self.cfg.sync.warmup_steps
            tensors = list(self.model.parameters()) if warm else self.averager.common_tensors()
            check_replicas(tensors, step, self.info.rank)
        self.stop.after_sync()

    @torch.no_grad()
    def evaluate(self, full: bool = False) -> dict[str, float]:
        """Test loss (nats per token) and accuracy of this rank's model, plus perplexity for
        language models; on `trainer.eval_samples` of the test set unless `full`."""
        self.model.eval()
        total_loss, correct, count = 0.0, 0, 0
        t = self.cfg.trainer
        batches = eval_batches(
            self.data.test,
            t.eval_batch_size,
            self.device,
            self.cfg.data.num_workers,
            limit=None if full else t.eval_samples,
        )
        for x, y in batches:
            with self.recipe.autocast():  # evaluated in the precision it trains in
                logits = self.model(x)
            loss, right = loss_and_correct(logits.float(), y)
            total_loss += loss.item() * y.numel()
            correct += int(right)
            count += y.numel()
        self.model.train()
        result = {"test_loss": total_loss / count, "test_accuracy": correct / count}
        if task_of(self.data) == "lm":
            result["test_perplexity"] = math.exp(min(result["test_loss"], 700.0))
        return result

    def text_sample(self) -> dict[str, str]:
        """A generated sample for character-level language models (those with a vocabulary)."""
        vocab = getattr(self.data, "vocab", "")
        chars = self.cfg.trainer.sample_chars
        if task_of(self.data) != "lm" or not vocab or chars == 0:
            return {}
        context = getattr(self.model, "max_len", None) or self.data.test[0][0].shape[-1]
        text = generate_text(self.model, vocab, chars, context, seed=self.cfg.seed)
        return {"sample": text}

    def comm_record(self) -> dict[str, Any]:
        return {
            "comm_rounds": self.comm.rounds,
            "comm_bytes": self.comm.bytes,
            "comm_seconds": round(self.comm.seconds, 6),
        }

    def rate_record(self, interval_s: float, steps: int, total_s: float) -> dict[str, Any]:
        """Throughput since the last log line, the share of time spent communicating so far, and
        the mean replica drift over the averages since the last log line (when there were any)."""
        samples = steps * self.samples_per_step
        record = {
            "samples_per_s": round(samples / max(interval_s, 1e-9), 1),
            "comm_share": round(self.comm.seconds / max(total_s, 1e-9), 4),
        }
        drift = self.drift.take() if self.drift is not None else None
        if drift is not None:
            record["drift"] = drift
        return record

    def train(self) -> dict[str, Any] | None:
        c = self.cfg.trainer
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        if self.is_main and self.resumed_from is not None:
            trim_metrics(metrics_path, self.step)  # lines past the checkpoint are redone
        logger = build_loggers(self.cfg, self.run_dir, self.is_main, append=self.step > 0)
        failed = True
        bar = progress_bar(c.max_steps, self.step, self.is_main and c.progress)
        start = time.perf_counter() - self.elapsed_before
        last_time, last_step = time.perf_counter(), self.step
        every = c.checkpoint_every
        try:
            while self.step < c.max_steps:
                self.stop.before_step(self.step, self.next_sync)
                # Summed on device, read at log steps only: `.item()` every step would stall CUDA.
                loss = self.train_step(self.step)
                if loss is not None:
                    self.loss_sum += loss
                    self.loss_count += 1
                self.step += 1
                if self.in_sync or self.merged:
                    self.after_sync(self.step - 1)
                if self.step % c.log_every == 0 or self.step == c.max_steps:
                    self.nonfinite.check(self.info.rank)
                if self.is_main and (self.step % c.log_every == 0 or self.step == c.max_steps):
                    loss = (self.loss_sum / max(1, self.loss_count)).item()
                    self.loss_sum.zero_()
                    self.loss_count = 0
                    now = time.perf_counter()
                    record = {
                        "step": self.step,
                        "loss": loss,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        "samples": self.step * self.samples_per_step,
                        "wall_time_s": round(now - start, 3),
                        **self.comm_record(),
                        **self.rate_record(now - last_time, self.step - last_step, now - start),
                    }
                    last_time, last_step = now, self.step
                    logger.log(record)
                    bar.set_postfix(loss=f"{loss:.4f}", syncs=self.comm.rounds, refresh=False)
                # The averaged model exists only right after a sync, so evaluation waits for one
                # (with overlap: for a merge, which leaves rank 0 one local step from the average).
                ready = self.in_sync or self.merged
                if self.step >= self.next_eval and ready and self.step < c.max_steps:
                    if self.is_main:  # wall time taken before the evaluation, for time-to-accuracy
                        wall = round(time.perf_counter() - start, 3)
                        record = {"step": self.step, "wall_time_s": wall, **self.comm_record()}
                        logger.log({**record, **self.evaluate()})
                    self.next_eval = (self.step // c.eval_every + 1) * c.eval_every
                # (a stop agreed for the very last step just lets the run finish)
                stopping = self.stop.should_stop(self.step) and self.step < c.max_steps
                due = every > 0 and (self.step % every == 0 or self.step == c.max_steps)
                if due or stopping:
                    self.save_checkpoint(time.perf_counter() - start)
                if stopping:
                    if self.is_main:
                        print(
                            f"SIGTERM: stopped after step {self.step} with a checkpoint; run the "
                            f"same command again to resume",
                            file=sys.stderr,
                            flush=True,
                        )
                    failed = False  # a clean stop, not a failure
                    return None
                bar.update(1)
            if not self.in_sync and not self.comm_disabled:
                self.averager.average()  # the final model is the average of the replicas
                self.in_sync = True
            wall = time.perf_counter() - start
            self.loop_seconds = wall  # this rank's training loop (benchmarks take the slowest)
            if not self.is_main:
                failed = False
                return None
            result = self.evaluate(full=True)
            logger.log({"step": self.step, **result})
            result.update(self.text_sample())
            checkpoint.save_model(self.model, self.run_dir)
            summary = {
                **result,
                "steps": self.step,
                **self.comm_record(),
                "comm_levels": self.averager.comm_levels(),
                "wall_time_s": round(wall, 3),
                "world_size": self.info.world_size,
                "period": self.cfg.sync.period,
                "warmup_steps": self.cfg.sync.warmup_steps,
                "params": self.param_count,
                "skipped_steps": self.skipped_steps,
                "dataset": target_name(self.config["data"]),
                "model": target_name(self.config["model"]),
            }
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            logger.summary(summary)
            failed = False
            return summary
        finally:
            bar.close()
            self.batches.close()  # stops DataLoader worker processes
            logger.close(failed)  # wandb.finish() even on error: the next multirun job starts clean

    def save_checkpoint(self, elapsed: float) -> None:
        self.nonfinite.check(self.info.rank)  # a checkpoint never holds a diverged state
        state = {
            "step": self.step,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "averager": self.averager.state_dict(),
            "comm": self.comm.state_dict(),
            "sampler": self.batches.state_dict(),
            "rng": checkpoint.rng_state(),
            "in_sync": self.in_sync,
            "next_eval": self.next_eval,
            "loss_sum": self.loss_sum.detach().clone(),
            "loss_count": self.loss_count,
            "skipped_steps": self.skipped_steps,
            "elapsed_s": elapsed,
            "drift": self.drift.state_dict() if self.drift is not None else None,
            "scaler": self.recipe.state_dict(),
        }
        checkpoint.save(
            self.run_dir,
            self.step,
            self.info.rank,
            self.info.world_size,
            state,
            self.cfg.trainer.keep_checkpoints,
            config=self.config,
        )

    def load_checkpoint(self, folder: str) -> None:
        state = checkpoint.load(folder, self.info.rank, self.device)
        self.model.load_state_dict(state["model"])  # copies into the flat buffers' views
        self.optimizer.load_state_dict(state["optimizer"])
        self.averager.load_state_dict(state["averager"])
        self.comm.load_state_dict(state["comm"])
        self.batches.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.in_sync = bool(state["in_sync"])
        self.next_eval = int(state["next_eval"])
        self.loss_sum = state["loss_sum"].to(self.device)
        self.loss_count = int(state["loss_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.elapsed_before = float(state["elapsed_s"])
        if self.drift is not None and state.get("drift") is not None:
            self.drift.load_state_dict(state["drift"])
        self.recipe.load_state_dict(state.get("scaler"))
