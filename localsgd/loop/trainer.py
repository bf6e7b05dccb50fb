"""One worker's training loop: local SGD, periodic averaging, an optional synchronous warmup."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from localsgd.config import Config, plain
from localsgd.data import eval_batches, input_shape_of, load_data, task_of
from localsgd.data.validation import validation_of
from localsgd.instantiate import build, target_name
from localsgd.loop import checkpoint
from localsgd.loop.best import KeepBest
from localsgd.loop.build_sync import build_synchroniser
from localsgd.loop.data_shard import worker_batches
from localsgd.loop.evaluation import evaluate, held_out_loss, loss_and_correct, text_sample
from localsgd.loop.fsdp import Sharding
from localsgd.loop.guards import NonFiniteTracker
from localsgd.loop.loggers import build_loggers
from localsgd.loop.metrics import (
    PeakMemory,
    notice,
    progress_bar,
    rate_record,
    trim_metrics,
    write_json,
)
from localsgd.loop.optim import build_optimizer, build_schedule, set_lr
from localsgd.loop.pacing import build_pacer, pace_record
from localsgd.loop.recipe import Recipe, checkpoint_activations
from localsgd.loop.stop import StopAgreement
from localsgd.loop.worker import WorkerInfo
from localsgd.models import build_model
from localsgd.models.hf import HFCausalLM
from localsgd.models.hf_export import HF_DIR, write_hf


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
        # in memory for tensor sets, else a DataLoader over the shard (localsgd/data/loader.py)
        ws = info.world_size
        self.batches, self.reassign = worker_batches(c, self.data, info.rank, ws, device)
        self.sampler = self.batches.sampler

        torch.manual_seed(c.seed)  # the same initial model on every rank
        model = build_model(
            c.model, input_shape_of(self.data), self.data.num_classes, task_of(self.data)
        ).to(device)
        if c.trainer.activation_checkpointing:  # per block, before sharding wraps the blocks
            checkpoint_activations(model, c.dist.shard_blocks)
        # dist.shard_size > 1: sharded inside each replica group (FSDP2), before the optimizer
        # over the process group's ranks: every worker's, or under torchrun with torchft one
        # machine's (its replica group; torchft goes across the machines)
        ranks = dist.get_world_size() if dist.is_initialized() else info.world_size
        self.sharding = Sharding(c.dist.shard_size, ranks, device, c.dist.shard_blocks)
        self.model = self.sharding.shard(model, c.trainer.precision, c.trainer.compile)
        self.optimizer = build_optimizer(self.model.parameters(), c.optim, module=self.model)
        self.lr_schedule = build_schedule(c.lr_schedule, c.trainer.max_steps)
        # the strategy: warmup, averaging, drift, fault tolerance; every rank starts from rank
        # 0's model
        self.sync = build_synchroniser(
            c,
            info,
            self.model,
            self.optimizer,
            self.sharding,
            held_out=self.held_out_loss,
            store=store,
        )
        # which ticks compute (sync.inner_time_s, comm.simulate.worker_speed; loop/pacing.py)
        self.pacer = build_pacer(c, info.rank, rule=self.sync.computes)
        # after the averager: its flat-buffer views are what gets compiled
        self.recipe = Recipe.from_config(self.model, device, c.trainer, self.sharding.sharded)
        torch.manual_seed(c.seed + 1000 * info.rank + 1)  # dropout etc. differ per rank
        # The loop's own state (the LR is a function of the step): LOOP_STATE, checkpointed.
        self.step = 0
        self.next_eval = c.trainer.eval_every
        self.loss_sum = torch.zeros((), device=device)  # summed on device, read at log steps
        self.loss_count = 0
        self.skipped_steps = 0
        self.saved_at: int | None = None  # the step of the last checkpoint this rank wrote
        self.elapsed_s = 0.0  # training seconds before the last resume
        # of the training seconds, those this rank computed steps in (utilisation's numerator)
        self.compute_s = 0.0
        self.eval_s = 0.0  # of those and the seconds since, spent in periodic evaluation
        self.start: float | None = None  # perf_counter at the loop's start, less elapsed_s
        # Everything a checkpoint holds, registered once: saving and resuming walk this mapping.
        self.stateful: dict[str, checkpoint.Stateful] = {
            "model": checkpoint.ModuleState(self.model),
            "optimizer": self.optimizer,
            **self.sync.checkpoint_state(),  # averager, comm, drift, ft
            "sampler": self.batches,
            "rng": checkpoint.RNGState(),
            "scaler": self.recipe,
            "loop": self,
            **({"pacer": self.pacer} if self.pacer.active else {}),
        }
        # how this run's checkpoints are written: every rank its own, or one shared state (the
        # round driver's word), sharded through DCP or not; decided once (loop/checkpoint/)
        self.checkpoint_layout = checkpoint.layout_for(
            self.sync.shared_checkpoints, self.sharding.size, info.rank, info.world_size
        )
        self.resumed_from = resume_from
        if resume_from is not None:  # its own state, or every component moved to this layout
            self.step = checkpoint.resume(
                resume_from,
                info,
                self.sharding.size,
                device,
                self.stateful,
                self.sync.optional_state,
            )
        # objects with optional on_step_start(trainer, step) / on_step_end(trainer, step)
        self.callbacks = [
            build(cb, f"trainer.callbacks[{i}]") for i, cb in enumerate(c.trainer.callbacks)
        ]
        self.nonfinite = NonFiniteTracker(device)
        self.stop = StopAgreement(store, str(info.attempt))
        # trainer.keep_best: best.pt, the weights of the best evaluation by optimized_metric
        self.best = KeepBest(run_dir, c.optimized_metric, c.trainer.keep_best and self.is_main)

    LOOP_STATE = (
        "in_sync",
        "next_eval",
        "loss_sum",
        "loss_count",
        "skipped_steps",
        "elapsed_s",
        "eval_s",
        "compute_s",
    )

    def state_dict(self) -> dict[str, Any]:
        # the step too: a healing worker takes the whole loop state from its peer, and the
        # training seconds so far (not those before the peer's last resume: a healed worker 0
        # would time the run from its heal)
        state = {k: getattr(self, k) for k in self.LOOP_STATE}
        return {"step": self.step, **state, "elapsed_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.LOOP_STATE:  # a checkpoint written before eval_s existed keeps going
            setattr(self, k, state.get(k, getattr(self, k)))
        self.step = int(state.get("step", self.step))

    @property
    def in_sync(self) -> bool:
        """The replicas are identical right now (kept by the synchroniser)."""
        return self.sync.in_sync

    @in_sync.setter
    def in_sync(self, value: bool) -> None:
        self.sync.in_sync = value

    @property
    def comm_stats(self):
        """Every collective's counters (`rounds`, `bytes`, `seconds`)."""
        return self.sync.stats

    @property
    def samples_per_worker_step(self) -> int:
        return self.cfg.trainer.batch_size * self.cfg.trainer.accumulate_grad_batches

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

    def forward_backward(self) -> torch.Tensor:
        """`accumulate_grad_batches` micro-batches, each backpropagated at 1/k of its loss, so
        the gradient is that of the mean loss over the k batches (one batch k times as large);
        returns that mean loss, detached."""
        k = self.recipe.accumulate
        losses = []
        for _ in range(k):
            x, y = self.next_batch()
            with self.recipe.autocast():
                logits = self.recipe.forward(x)
            loss, _ = loss_and_correct(logits.float(), y, self.model)  # the loss in fp32
            self.recipe.backward(loss if k == 1 else loss / k)
            losses.append(loss.detach())
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def train_step(self, step: int) -> torch.Tensor | None:
        """One optimizer step (of `accumulate_grad_batches` batches), or an idle tick past this
        round's time budget (loop/pacing.py); then the average, when due. Returns the loss, or
        None when the tick idled or nan_policy=skip skipped it."""
        for callback in self.callbacks:
            if hasattr(callback, "on_step_start"):
                callback.on_step_start(self, step)
        pacer, loss, samples = self.pacer, None, 0
        # a sharded replica group computes a tick only where all its ranks would
        if not pacer.active or self.sync.in_warmup or self.sharding.all_of(pacer.computes()):
            began, in_comm = time.perf_counter(), self.comm_stats.seconds
            pacer.begin_step()
            loss = self.local_step(step)
            samples = 0 if loss is None else self.samples_per_worker_step
            pacer.end_step(samples)
            # compute: the step (a modelled slow worker's included), less its gradient average
            self.compute_s += time.perf_counter() - began - (self.comm_stats.seconds - in_comm)
        else:
            pacer.idle()
            self.sync.idled()
        self.sync.after_step(loss, samples)  # the model average, when due
        # a round every worker must reach (a fragment's, launched or blocking) ends the budget's
        if self.in_sync or self.sync.round_started:
            pacer.new_round()
        for callback in self.callbacks:
            if hasattr(callback, "on_step_end"):
                callback.on_step_end(self, step)
        return loss

    def local_step(self, step: int) -> torch.Tensor | None:
        """The optimizer step itself; returns its loss, or None when nan_policy=skip skipped
        it."""
        set_lr(self.optimizer, self.lr_schedule, step)
        self.sync.zero_grad(self.optimizer)
        loss = self.forward_backward()
        skip = self.skips(loss, step)
        if skip:  # drop what the bad batch contributed
            self.sync.zero_grad(self.optimizer)
        if self.sync.after_backward(skip):  # the warmup's gradient average
            self.recipe.step(self.optimizer)
        self.skipped_steps += skip
        return None if skip else loss

    def skips(self, loss: torch.Tensor, step: int) -> bool:
        """The NaN policy: `skip` drops a step with a non-finite loss (a host sync per step,
        only under this policy); `error` checks at log steps that none was seen."""
        if self.cfg.trainer.nan_policy == "skip":
            return not bool(torch.isfinite(loss))
        self.nonfinite.observe(loss, step)
        return False

    @property
    def merged(self) -> bool:
        """With a delayed average: the last step applied one (see `Synchroniser.merged`)."""
        return self.sync.merged

    def next_sync(self, step: int) -> int | None:
        """The first step index >= `step` whose update communicates, or None if none is left."""
        return self.sync.next_sync(step)

    def after_sync(self, step: int) -> None:
        self.sync.check_replicas(step, self.info.rank)
        self.stop.after_sync(step)
        if self.reassign is not None and self.sync.moves_shards:  # an excluded worker's shard
            self.reassign.after_sync(self.sync.trust, step)

    @property
    def held_out_split(self) -> str:
        """What training may look at besides its own data: the validation split (the test set
        when data.val_fraction=0 leaves none); the test set is otherwise read once, at the end."""
        return "test" if validation_of(self.data) is None else "val"

    def evaluate(self, full: bool = False, split: str | None = None) -> dict[str, float]:
        """This rank's model on `trainer.eval_samples` of `split` (all of it if `full`; the
        held-out split by default), its metrics named for the split (`val_loss`, ...)."""
        t = self.cfg.trainer
        split = split or self.held_out_split
        limit = None if full else t.eval_samples
        dataset = self.data.test if split == "test" else validation_of(self.data)
        batches = eval_batches(
            dataset, t.eval_batch_size, self.device, self.cfg.data.num_workers, limit
        )
        return evaluate(self.model, batches, self.recipe.autocast, task_of(self.data), split)

    def held_out_loss(self, round_: int, batch: int, samples: slice | None = None) -> torch.Tensor:
        """The model's per-sample losses, as it stands, on round `round_`'s held-out batch of
        `batch` samples (`sync.score`, from the validation split), or on its `samples`."""
        split = self.held_out_split
        return held_out_loss(
            self.model,
            self.data.test if split == "test" else validation_of(self.data),
            self.cfg.seed,
            round_,
            batch,
            self.device,
            self.recipe.autocast,
            samples,
        )

    def comm_record(self) -> dict[str, Any]:
        return {
            "comm_rounds": self.comm_stats.rounds,
            "comm_bytes": self.comm_stats.bytes,
            "comm_seconds": round(self.comm_stats.seconds, 6),
            **pace_record(self.pacer),  # computed and idle ticks
            # optimizer state sent, round weights, participants (ft), exclusions and drops
            **self.sync.record(),
        }

    def train(self) -> dict[str, Any] | None:
        """Local SGD, step by step: a local step on every worker (all-reducing gradients in the
        synchronous warmup) and, when the schedule says so, the average of the replicas; then
        logging, evaluation of the averaged model and a checkpoint, each when due. Returns the
        summary on rank 0; None on other ranks and after an agreed stop (SIGTERM, Ctrl-C)."""
        max_steps = self.cfg.trainer.max_steps
        # under torchft the first round; a restarted worker heals here (NoLivePeer: nobody is
        # left to heal from)
        done = self.sync.start(
            self.stateful,
            lambda: self.recipe.step(self.optimizer),
            lambda: self.step,  # a healed worker's step is its peer's
            self.cfg.trainer.checkpoint_every,
        )
        self.step += done
        self.open_run()
        failed = True
        try:
            while self.step < max_steps:
                self.stop.before_step(self.step, self.next_sync)
                loss = self.train_step(self.step)  # local step, maybe average
                self.step += 1
                if loss is not None:
                    self.loss_sum += loss
                    self.loss_count += 1
                if self.in_sync or self.merged:
                    self.after_sync(self.step - 1)
                self.maybe_log()
                self.maybe_evaluate()
                if self.maybe_checkpoint():  # an agreed stop, after its checkpoint
                    failed = False
                    return None
                self.bar.update(1)
            summary = self.finish()
            failed = False
            return summary
        finally:
            self.close_run(failed)

    def open_run(self) -> None:
        c = self.cfg.trainer
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        if self.is_main and self.resumed_from is not None:
            trim_metrics(metrics_path, self.step)  # lines past the checkpoint are redone
        self.logger = build_loggers(self.cfg, self.run_dir, self.is_main, append=self.step > 0)
        self.bar = progress_bar(c.max_steps, self.step, self.is_main and c.progress)
        self.start = time.perf_counter() - self.elapsed_s
        self.peak_memory = PeakMemory(self.device)  # CUDA only
        self.last_log = (time.perf_counter(), self.step)

    def close_run(self, failed: bool) -> None:
        self.bar.close()
        self.batches.close()  # stops DataLoader worker processes
        self.logger.close(failed)  # wandb.finish() even on error: the next job starts clean
        self.sync.close()

    def elapsed(self) -> float:
        """Training seconds so far, including those before a resume."""
        return self.elapsed_s if self.start is None else time.perf_counter() - self.start

    def maybe_log(self) -> None:
        c = self.cfg.trainer
        if self.step % c.log_every and self.step != c.max_steps:
            return
        self.nonfinite.check(self.info.rank)
        if not self.is_main:
            return
        loss = (self.loss_sum / max(1, self.loss_count)).item()
        self.loss_sum.zero_()
        self.loss_count = 0
        now = time.perf_counter()
        last_time, last_step = self.last_log
        self.last_log = (now, self.step)
        self.logger.log(
            {
                "step": self.step,
                "loss": loss,
                "lr": self.optimizer.param_groups[0]["lr"],
                "samples": self.step * self.samples_per_step,
                "wall_time_s": round(now - self.start, 3),
                "compute_seconds": round(self.compute_s, 6),
                **self.comm_record(),
                **rate_record(
                    (self.step - last_step) * self.samples_per_step,
                    now - last_time,
                    self.comm_stats.seconds,
                    now - self.start,
                    self.sync.drift,
                ),
                **self.peak_memory.interval(),  # since the last line (CUDA only)
            }
        )
        self.bar.set_postfix(
            loss=f"{loss:.4f}",
            syncs=self.comm_stats.rounds,
            **self.sync.fault_record(),
            refresh=False,
        )

    def maybe_evaluate(self) -> None:
        # The averaged model exists only right after a sync, so evaluation waits for one (with
        # overlap: for a merge, which leaves rank 0 one local step from the average).
        c = self.cfg.trainer
        ready = self.in_sync or self.merged
        if self.step < self.next_eval or not ready or self.step >= c.max_steps:
            return
        if self.sharding.evaluates(self.info.rank):  # rank 0 (sharded: its whole group)
            # wall time taken before the evaluation, for time-to-accuracy
            began = time.perf_counter()
            record = {"step": self.step, "wall_time_s": round(self.elapsed(), 3)}
            record.update(self.comm_record(), **self.evaluate())
            if self.is_main:
                self.logger.log(record)
                self.best.observe(self.step, record, self.model)
            self.eval_s += time.perf_counter() - began
        self.next_eval = (self.step // c.eval_every + 1) * c.eval_every

    def maybe_checkpoint(self, final: bool = False) -> bool:
        """Save when due or when a stop was agreed for this step; True to stop the run."""
        stopping = self.sync.checkpoint(
            self.step,
            self.cfg.trainer.checkpoint_every,
            self.stop,
            self.save_checkpoint,
            final=final,
        )
        if stopping and self.sync.writes_results(self.info.rank):
            why = self.stop.reason()  # a forwarded Ctrl-C reaches a worker as SIGTERM
            kept = (
                "with a checkpoint; run the same command again to resume"
                if self.saved_at == self.step
                else "without a checkpoint (see the line above)"
            )
            notice(f"{why}: stopped after step {self.step} {kept}")
        return stopping

    def finish(self) -> dict[str, Any] | None:
        """The final average, then on rank 0 (under ft: the first live worker) the evaluation,
        `model.pt` and the summary."""
        self.sync.finish()  # the final model is the average of the replicas
        self.maybe_checkpoint(final=True)  # under torchft: the final average's, shared
        wall = self.elapsed()
        self.loop_seconds = wall  # this rank's training loop (benchmarks take the slowest)
        writes = self.sync.writes_results(self.info.rank)
        rank, sharding = self.info.rank, self.sharding
        evaluates = sharding.sharded and self.sync.evaluates_final(rank, sharding)
        if not writes and not evaluates:
            return None
        # sharded: every rank of the writer's replica group evaluates and gathers the model;
        # the test set's one reading, beside the validation split's
        result = self.evaluate(full=True, split="test")
        if self.held_out_split == "val":
            result.update(self.evaluate(full=True, split="val"))
        sample = text_sample(self.model, self.data, self.cfg.trainer.sample_chars, self.cfg.seed)
        state = self.sharding.full_state(self.model)
        # what the whole replica group sent: each rank of it sends only its own shard
        group_bytes = self.sharding.group_sum(self.comm_stats.bytes)
        if not writes:
            return None
        self.logger.log({"step": self.step, **result})
        self.best.observe(self.step, result, self.model)
        result.update(sample)
        checkpoint.save_model(self.model, self.run_dir, state)
        if isinstance(self.model, HFCausalLM):  # model=hf: hf/, what from_pretrained loads
            write_hf(self.model, self.data, os.path.join(self.run_dir, HF_DIR), state)
        summary = {
            **result,
            "steps": self.step,
            **self.comm_record(),
            "wall_time_s": round(wall, 3),
            "eval_seconds": round(self.eval_s, 3),  # included in wall_time_s
            "compute_seconds": round(self.compute_s, 3),  # included in wall_time_s
            "world_size": self.info.world_size,
            **self.sync.summary(),  # period, warmup_steps, comm_levels
            "params": self.param_count,
            "shard_size": self.sharding.size,
            "comm_bytes_group": group_bytes,  # comm_bytes summed over this replica group
            "state_bytes": self.sync.state_bytes(self.model, self.optimizer),
            **self.peak_memory.run(),  # the whole run's, final average and evaluation included
            "skipped_steps": self.skipped_steps,
            "dataset": target_name(self.config["data"]),
            "model": target_name(self.config["model"]),
            # what building the model needs of the data: localsgd.load(run_dir) reads it
            "model_inputs": {
                "input_shape": list(input_shape_of(self.data)),
                "num_classes": self.data.num_classes,
                "task": task_of(self.data),
            },
            **self.best.summary(),  # trainer.keep_best
        }
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        self.logger.summary(summary)
        return summary

    def save_checkpoint(self, writes: bool = True) -> str:
        """This rank's part of the checkpoint of this step, in the run's layout (a collective
        where every rank writes its own); `writes` False: a shared checkpoint another worker
        writes, of which this one saves only what is its own (`checkpoint.save`)."""
        self.nonfinite.check(self.info.rank)  # a checkpoint never holds a diverged state
        self.elapsed_s = self.elapsed()
        if writes:
            self.saved_at = self.step
        return checkpoint.save(
            self.checkpoint_layout,
            self.run_dir,
            self.step,
            self.stateful,
            self.cfg.trainer.keep_checkpoints,
            config=self.config,
            writes=writes,
        )
