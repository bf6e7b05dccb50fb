"""The config schema: these dataclasses are what `conf/*.yaml` may say, and `validate` their ranges.

Hydra type-checks every override against the dataclasses (so `optim.lr=abc` is refused by Hydra
itself); `validate` adds the range and combination checks a type cannot express, and runs in the
launching process before any worker starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from omegaconf import MISSING


class ConfigError(ValueError):
    """A setting is out of range. One-line message: the key, what is allowed, what was given."""


@dataclass
class DistConfig:
    # worker processes to spawn when not under torchrun; null = 4 on CPU, one per GPU on CUDA
    world_size: int | None = None
    backend: str = "auto"  # one of BACKENDS
    timeout_s: float = 180.0  # every collective fails after this long instead of hanging
    device: str = "auto"  # one of DEVICES
    # S: the workers as world_size/S replica groups of S contiguous ranks, each sharding the model
    # with FSDP2; local SGD / DiLoCo average the shards across the groups (1: every worker holds
    # the whole model). Phase 1: see docs/strategies.md#sharded-replicas for what it covers
    shard_size: int = 1
    # the dotted name of the submodule whose children are the FSDP units (and the blocks that
    # trainer.activation_checkpointing / trainer.compile treat one by one), e.g. "transformer.h";
    # null: the automatic rule, the longest ModuleList/Sequential
    # (localsgd.averaging.streaming.fragments)
    shard_blocks: str | None = None
    # M: run the M workers as threads of this one process (virtual workers, taking turns) instead
    # of M processes: the same training, with gloo's bits, on one core (localsgd/cli/virtual.py;
    # docs/performance.md#virtual-workers). null: processes
    virtual_workers: int | None = None


# dist.backend and dist.device (localsgd.cli.launch picks them: auto = nccl on CUDA, else gloo)
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainerConfig:
    max_steps: int | None = 3000  # optimizer steps per worker
    max_epochs: int | None = None  # or: passes over the smallest worker's shard (max_steps null)
    batch_size: int = 32  # per worker
    eval_every: int = 250  # evaluate the averaged model at the first sync at or after each multiple
    log_every: int = 25
    eval_batch_size: int = 1000
    # periodic evaluations read this many evenly spaced test samples (null: all); the final
    # evaluation always reads the whole test set
    eval_samples: int | None = None
    sample_chars: int = 200  # language models: characters of text generated at the end (0: none)
    # `_target_` configs of objects with on_step_start(trainer, step) and/or
    # on_step_end(trainer, step), called on every rank around each optimizer step
    callbacks: list[Any] = field(default_factory=list)
    progress: bool = True  # rank-0 progress bar
    # replica drift at each average: one persistent model-sized scratch buffer and one extra
    # scalar all-reduce per average (none between averages). null: wherever there is a mean to
    # measure it around, which ft=torchft's replica groups, each a world of its own, have not
    # (true there is refused in one line)
    track_drift: bool | None = None
    checkpoint_every: int = 500  # steps between checkpoints, plus one at the end; 0 = none
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones are deleted)
    # auto: the run dir's newest complete checkpoint; with the default timestamped run dir, the
    # newest unfinished run of the same overrides (localsgd/cli/run_dir.py) | never | a path
    resume: str = "auto"
    # keep best.pt: the weights of the best evaluation by optimized_metric, a val_* key
    # (localsgd/loop/best.py); localsgd.load(run_dir, best=True) loads them
    keep_best: bool = False
    nan_policy: str = "error"  # localsgd.loop.guards.NAN_POLICIES: error | skip
    deterministic: bool = False  # torch.use_deterministic_algorithms (CUDA); CPU is anyway
    # the recipe, named as in Lightning (localsgd/loop/recipe.py)
    # localsgd.loop.recipe.PRECISIONS: 32-true | bf16-mixed | 16-mixed (autocast; params stay fp32)
    precision: str = "32-true"
    gradient_clip_val: float | None = None  # clip the gradient norm to this; null / 0 = off
    accumulate_grad_batches: int = 1  # batches per optimizer step; sync.period counts steps
    compile: bool = False  # torch.compile the model's training forward
    # recompute each block's activations in the backward (localsgd.loop.recipe)
    activation_checkpointing: bool = False


@dataclass
class SyncLevel:
    # an integer, `world`, or `node` (the default: torchrun's LOCAL_WORLD_SIZE, the processes
    # on one machine; without torchrun all spawned workers are on one machine)
    group_size: Any = "node"
    period: int = MISSING


@dataclass
class HeLoCoConfig:
    # sync.staleness_correction=heloco (localsgd.averaging.asynchronous.heloco): per parameter
    # tensor, a contribution whose cosine with the outer momentum is >= keep is kept; below 0
    # its anti-aligned part shrinks (by at most shrink_cap); in between it turns toward the
    # momentum (by reorient); kappa: how far the momentum's norm lowers the confidence
    keep: float = 0.2
    shrink: float = 1.0
    shrink_cap: float = 0.5
    reorient: float = 0.5
    kappa: float = 1.0


@dataclass
class SyncConfig:
    period: int = 16  # k: average parameters every k optimizer steps
    warmup_steps: int = 0  # synchronous (gradient all-reduce) steps before local SGD starts
    # hierarchical local SGD, narrowest first; replaces `period` when given. With `outer` or the
    # streaming keys below, the widest level takes the (streamed) outer step and the others
    # average the whole model plainly
    levels: list[SyncLevel] = field(default_factory=list)
    schedule: str = "constant"  # constant | step | adaptive
    period_factor: int = 2  # step: k *= factor at each milestone; adaptive: k *= or //= factor
    period_milestones: list[int] = field(default_factory=list)  # step schedule
    min_period: int = 1  # adaptive
    max_period: int = 256  # adaptive
    adaptive_tolerance: float = 0.01  # adaptive: relative loss drop that counts as progress
    outer: str = "none"  # none | diloco | slowmo
    outer_lr: float | None = None  # null = the method's default (diloco 0.7, slowmo 1.0)
    outer_momentum: float | None = None  # null = diloco 0.9, slowmo 0.5
    outer_nesterov: bool | None = None  # null = diloco true, slowmo false
    # the first R outer steps move linearly from a plain average (lr 1, momentum 0) to the
    # outer_lr/outer_momentum above (0 = off): for runs with few outer steps
    outer_warmup_rounds: int = 0
    # where the outer step's state (anchors, outer momentum) lives: device (beside the model) |
    # cpu (host memory, pinned on CUDA; the outer step runs there, the same bits)
    outer_state: str = "device"
    # OPTIMIZER_STATE_MODES, at each sync: local | average | reset | desloc (DES-LOC: Adam's
    # first and second moments averaged at their own multiples of the sync period)
    optimizer_state: str = "local"
    # desloc: [first, second] moment periods, in parameter averages (the paper's K_u = 3 K_x,
    # K_v = 6 K_x); a momentum_buffer counts as a first moment
    moment_periods: list[int] = field(default_factory=lambda: [3, 6])
    # what an average sends (localsgd.averaging.COMM_DTYPES): float32 | bfloat16 | float16, or
    # block-quantised int8 | float8_e4m3fn | int4 | float4_e2m1 (per-block fp32 scales)
    comm_dtype: str = "float32"
    quant_block_size: int = 128  # values per scale of the block-quantised formats
    # keep each worker's rounding residual and add it to its next sync's change (checkpointed);
    # null: on with sync.compress=topk, which needs it, off otherwise
    error_feedback: bool | None = None
    # beta: the residual is decayed before it is added, e <- beta * e + change (SparseLoCo's
    # accumulator); 1 keeps every error, so that sum(sent) + residual = sum(changes)
    error_feedback_decay: float = 1.0
    # COMPRESSIONS: none | topk. topk (SparseLoCo): from each chunk of `topk_chunk` values of the
    # change (pseudo-gradient) only the round(topk_density * topk_chunk) largest go on the wire,
    # as Elias-Fano coded indices (about 2 + log2(chunk / k) bits each), 2-bit values and one
    # fp32 scale per chunk (localsgd/averaging/wire/sparse.py);
    # it replaces sync.comm_dtype (leave it float32) and needs sync.error_feedback=true
    compress: str = "none"
    topk_density: float = 0.015625  # 1/64: 64 of every 4096 values
    topk_chunk: int = 4096  # values per chunk, 2..1048576 (sparse.MAX_CHUNK)
    # what the sum of the decoded top-k messages is divided by: all (the number of workers: the
    # mean of the messages) | senders (per index, the number of workers that sent it: SparseLoCo's
    # reference code; an index one worker sent moves by its whole value)
    topk_mean: str = "all"
    # Streaming DiLoCo (Douillard et al. 2025): P fragments strided by block, fragment p's outer
    # step every `period` steps offset by p*period/P (1 = the whole model at once); async: each
    # phase of period/P steps sends one fragment in turn
    fragments: int = 1
    delay_steps: int = 0  # tau: a fragment's all-reduce runs while tau more steps train
    merge_alpha: float = 0.0  # merged = alpha * local + (1 - alpha) * global (paper: 0.5)
    # how a delayed merge treats the local values: mix (merge_alpha, above) | progress (global +
    # this rank's progress since the launch: DaSGD's delayed averaging; needs delay_steps >= 1)
    merge_rule: str = "mix"
    # Eager updates (Kale et al. 2025): the outer step uses the fresh local pseudo-gradient with
    # the others' one-round-late ones, so the whole outer all-reduce overlaps training
    eager: bool = False
    check_replicas: bool = False  # after each sync, verify replicas are bit-identical (a gather)
    # shorthand for delay_steps=1 with merge_rule=progress: each average launched asynchronously
    # and applied one step later, keeping that step's progress
    overlap: bool = False
    bucket_mb: float = 25.0  # a launched (delay_steps >= 1) fp32 average: buckets of this many MiB
    # ASYNC_MODES: sync (every round a barrier) | async (docs/asynchronous.md: each worker
    # sends its pseudo-gradient when its inner phase ends and trains on from the newest global
    # model; a syncer on rank 0 merges what has arrived; the workers meet at checkpoints)
    mode: str = "sync"
    min_quorum: int = 1  # async: the syncer merges once this many workers' contributions wait
    # async: ... and every worker due within this many seconds of the oldest has sent, or they
    # have passed (modelled, under worker_speed); null: adaptive, one step of the slowest worker
    grace_s: float | None = None
    # async: a contribution trained from a global model more than this many merges old is not
    # merged (its worker takes the newest model all the same); null: every one is
    max_staleness: int | None = None
    # async: Delayed Nesterov's N, the merges between outer momentum steps (Liu et al. 2024);
    # null: the number of workers; 1: the synchronous outer step (torch's SGD)
    outer_delay: int | None = None
    # async: none | heloco (HeLoCo, arXiv 2606.00271: the syncer corrects each stale
    # pseudo-gradient against the outer momentum before merging it; settings in `heloco`)
    staleness_correction: str = "none"
    heloco: HeLoCoConfig = field(default_factory=HeLoCoConfig)
    # per-worker step counts: each round's inner phase lasts at most this many seconds per
    # worker, a slow worker computing fewer of the round's steps instead of holding up the
    # others, and averages weigh each worker by the samples it trained on (localsgd.loop.pacing;
    # how: budget_merge; a robust sync.aggregate weighs nobody)
    inner_time_s: float | None = None
    # how a budget's round (or an asynchronous merge) merges the workers' changes: normalized
    # (each worker's change scaled to the round's most samples, so a slow worker's short change
    # does not shrink the mean: FedNova's normalized averaging) | weighted (the changes as they
    # are, weighed by samples); null: normalized. Refused where no merge weighs samples
    budget_merge: str | None = None
    # Workers you cannot trust (localsgd.averaging.trust.robust, docs/reliability.md): how each sync
    # combines the workers' contributions (changes since the last sync; DiLoCo's pseudo-
    # gradients). mean: today's all-reduce; clip | trimmed_mean | median all-gather them
    aggregate: str = "mean"  # localsgd.averaging.trust.robust.AGGREGATES
    clip_multiple: float = 2.0  # clip: each contribution's norm <= this x the round's median norm
    trim_fraction: float = 0.25  # trimmed_mean: cut from each side, per coordinate, in [0, 0.5)
    # drop a contribution holding NaN/Inf from its round (null: true). The mean checks in band
    # (localsgd.averaging.finite: no byte more in a clean round); false: the unguarded all-reduce
    drop_nonfinite: bool | None = None
    # score each contribution by the loss change it causes on a batch of score_batch test
    # samples drawn from the round's seed; a bad one is dropped from its round, and
    # exclude_after bad rounds running (0 = never) exclude its worker for good
    score: bool = False
    # each rank evaluates every candidate on 1/size of it: about score_batch x (size + 2) / size
    # forward passes a round, against period x batch_size forward and backward ones
    score_batch: int = 256
    score_fraction: float = 0.5  # bad: score <= this x the round's median score (when > 0)
    # ... and its per-sample losses worse than the median contribution's by more than score_z
    # standard errors (a paired test over the batch; 0: the fraction alone)
    score_z: float = 3.0
    # 3, not 2: an honest worker's change is worse than the others' on the batch in some
    # rounds (really, not by noise), and two such rounds running happened on the Shakespeare LM
    exclude_after: int = 3
    # or exclude_after bad rounds among its last exclude_window judged ones (null: running
    # only): an attacker that is bad every other round never runs up a streak
    exclude_window: int | None = None
    # a worker's first probation_rounds rounds: 2 bad rounds running exclude it (0: none). A
    # newcomer bad from the start is out in 2 rounds; an honest worker bad 2 rounds running
    # later (it happened on the Shakespeare LM, after 20 rounds of help) is not
    probation_rounds: int = 3
    # an excluded worker's shard: skip (lost to the run) | reassign (split among the others) |
    # take_over (its batch too: the global batch stays whole); null: reassign when sync.score
    # is on (the trust study: it did better than skip on every setting)
    excluded_shard: str | None = None


@dataclass
class SimulateConfig:
    # a slower network than the real one: every collective lasts >= latency + bytes / bandwidth
    bandwidth_gbps: float | None = None  # null: no bandwidth limit
    latency_ms: float = 0.0  # 0 with bandwidth_gbps null: no simulation
    # slow workers: worker r's step lasts worker_speed[r] * step_s seconds (one factor per
    # worker; null: none), its time budget counted in that modelled time (localsgd.loop.pacing)
    worker_speed: list[float] | None = None
    step_s: float | None = None  # the modelled seconds of one step at speed 1


@dataclass
class CommConfig:
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    # true: no collective after the initial broadcast (no averaging, no final average); the
    # workers train independently and rank 0's own model is evaluated. A throughput baseline only.
    disabled: bool = False


@dataclass
class FtConfig:
    # ft=torchft: averaging across replica groups through torchft's Manager, so that the job
    # outlives a dead worker (docs/reliability.md#workers-that-come-and-go)
    backend: str = "none"  # FT_BACKENDS: none | torchft
    lighthouse: str = ""  # host:port of a running torchft lighthouse; empty: start one here
    replica_id: str | None = None  # torchrun: this machine's replica group, NAME_INDEX
    replica_groups: int | None = None  # torchrun: how many replica groups (machines) the job has
    min_replicas: int = 1  # fewest replica groups an average may include
    max_restarts: int = 3  # times a dead worker is restarted (then it is lost for good)
    timeout_s: float = 30.0  # every torchft collective and heal fails after this long
    quorum_timeout_s: float = 60.0  # how long an average waits for ft.min_replicas groups
    # how long a round's collectives wait for a peer that stopped answering (frozen, not dead)
    # before the round fails and is retried without it: grace_s fixed, or (null) adaptive:
    # grace_factor x the longest collective of the last 16 committed rounds, at least
    # grace_min_s (>= the lighthouse's 2 s heartbeat timeout), at most ft.timeout_s; every
    # worker of a round waits the largest of the members' adaptive windows
    grace_s: float | None = None
    grace_factor: float = 4.0
    grace_min_s: float = 3.0
    # the lighthouse the command starts (ft.lighthouse empty): a worker it has not heard from
    # for heartbeat_timeout_s leaves the next quorum (a kill costs the others about this); a
    # quorum waits at most join_timeout_s for a live worker that has not joined yet
    heartbeat_timeout_s: float = 2.0
    join_timeout_s: float = 60.0
    # a sync that fails (a peer died, froze or was cut inside it) is retried at once with the
    # next quorum from each worker's state before it, instead of rolling back to the last
    # global state and syncing again a period later (plain and outer averaging)
    retry_failed_sync: bool = False
    # a worker heartbeats to the lighthouse only while healthy: it stops when a collective of
    # its round fails, or its training thread makes no progress (a step, a collective, a
    # quorum) for stall_s (inside a round, for the round's grace window if shorter), so the
    # others' next quorum forms without a cut-off worker after one window and the heartbeat
    # timeout instead of join_timeout_s; it rejoins and heals when it is back. false: torchft's
    # own heartbeats, which go on whatever the worker does
    # null: on wherever a lighthouse runs (not under sync.mode=async: true there is refused)
    heartbeat_gate: bool | None = None
    stall_s: float = 30.0  # longer than any step, evaluation or checkpoint between rounds
    host: str = "127.0.0.1"  # the interface the lighthouse, managers and heal servers bind to


FT_BACKENDS = ("none", "torchft")

# sync.compress
COMPRESSIONS = ("none", "topk")

# sync.mode
ASYNC_MODES = ("sync", "async")


# The optimizer and the LR schedule are built with hydra.utils.instantiate from `_target_`
# (any torch.optim class, or your own, with its keyword arguments beside it). These dataclasses
# are the schemas of the shipped presets (conf/optim/, conf/lr_schedule/) and hold their
# defaults; a config of your own with another `_target_` needs no schema.
@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1  # the peak learning rate; the schedule scales it
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4


@dataclass
class AdamWConfig:  # DiLoCo's inner optimizer (Douillard et al. 2023)
    _target_: str = "torch.optim.AdamW"
    lr: float = 4e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class MuonConfig:  # MuLoCo's inner optimizer: Muon on the weight matrices, AdamW on the rest
    _target_: str = "localsgd.loop.muon.MuonAdamW"
    lr: float = 4e-4  # both optimizers' (Muon's update scaled to AdamW's RMS: adjust_lr_fn)
    weight_decay: float = 0.1  # both optimizers'
    momentum: float = 0.95  # Muon's
    nesterov: bool = True  # Muon's
    ns_steps: int = 5  # Muon's Newton-Schulz iterations
    # Muon's: match_rms_adamw (the same lr as AdamW's) | original (Keller Jordan's scaling)
    adjust_lr_fn: str = "match_rms_adamw"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's
    eps: float = 1e-8  # AdamW's


# Schedules: `lr_schedule(step)` is the factor of each parameter group's `lr` at that optimizer
# step (localsgd/loop/optim.py); `max_steps` comes from trainer.max_steps when it is built.
@dataclass
class WarmupCosineConfig:
    _target_: str = "localsgd.loop.optim.WarmupCosine"
    warmup_steps: int = 50  # linear ramp from 0, independent of sync.warmup_steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of the peak


@dataclass
class ConstantLRConfig:
    _target_: str = "localsgd.loop.optim.WarmupConstant"
    warmup_steps: int = 0


@dataclass
class StepLRConfig:
    _target_: str = "localsgd.loop.optim.WarmupStep"
    warmup_steps: int = 0
    decay_steps: list[int] = field(default_factory=list)  # multiply by decay_factor at each
    decay_factor: float = 0.1


# model=hf (conf/model/hf.yaml): a Hugging Face causal LM, built, never downloaded
# (localsgd/models/hf.py). A size key left null takes, from scratch, the value in the comment;
# with config_path, that config.json's; with weights, the folder's (a set one must agree).
@dataclass
class HFModelConfig:
    _target_: str = "localsgd.models.hf.causal_lm"
    # any model type transformers' AutoConfig knows (llama, gpt2, qwen2, mistral, ...); null:
    # llama, or the model_type of config_path / weights
    family: str | None = None
    hidden_size: int | None = None  # 128
    num_hidden_layers: int | None = None  # 4
    num_attention_heads: int | None = None  # 4
    num_key_value_heads: int | None = None  # as many as the attention heads
    intermediate_size: int | None = None  # 4 x hidden_size
    max_position_embeddings: int | None = None  # data.seq_len
    vocab_size: int | None = None  # the data's tokenizer's
    tie_word_embeddings: bool | None = None  # the family's default
    # any other key of the family's config: +model.config.rope_theta=10000
    config: dict[str, Any] = field(default_factory=dict)
    config_path: str | None = None  # a local folder holding a config.json
    weights: str | None = None  # a local save_pretrained folder, to fine-tune
    attn_implementation: str = "sdpa"  # sdpa | eager (transformers' names)


# The data and model nodes are `_target_` configs, like `optim`: a callable and its keyword
# arguments beside it (`data.num_samples`, `model.hidden`, a user's own keys). The data node also
# holds localsgd's own keys, the fields of `DataOptions`: the schema puts them, with their
# defaults, into every data node (so `data.partition=by_class` needs no `+`), `load_data` keeps
# them from the callable, and `data_options` types them (`data.alpha=abc` is refused in one line).
@dataclass
class DataOptions:
    partition: str = "iid"  # localsgd.data.partition.PARTITIONS: iid | by_class | dirichlet
    classes_per_worker: int = 2  # by_class
    alpha: float = 0.5  # dirichlet concentration
    # localsgd.data.loader.LOADERS. auto: in memory when `train` is a TensorDataset, else a
    # DataLoader per rank | memory | stream
    loader: str = "auto"
    num_workers: int = 0  # DataLoader worker processes per rank (stream only)
    # the validation split held out of the train set (localsgd/data/validation.py): periodic
    # evaluation, optimized_metric, sync.score and keep_best read it, the test set only the
    # final evaluation. 0: none (periodic evaluation then reads the test set)
    val_fraction: float = 0.1


# localsgd's own keys of the `data` node; every other key is an argument of its `_target_`
DATA_OPTIONS = tuple(f.name for f in fields(DataOptions))


def _data_node() -> dict[str, Any]:
    # any callable returning an object with `train`, `test` (Datasets of (x, y)) and `num_classes`
    return {"_target_": MISSING, **asdict(DataOptions())}


def data_options(node: Any) -> DataOptions:
    """The data node's own keys (a mapping), typed and with their defaults; a value of the
    wrong type is a one-line ConfigError naming `data.KEY` and the type."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    schema = OmegaConf.structured(DataOptions)
    for key in DATA_OPTIONS:
        if key in node:
            try:
                schema[key] = node[key]
            except ValidationError:
                kind = type(getattr(DataOptions, key)).__name__
                raise ConfigError(f"data.{key} must be of type {kind}, got {node[key]!r}") from None
    return OmegaConf.to_object(schema)


@dataclass
class WandbConfig:
    # null: wandb's own WANDB_MODE / WANDB_PROJECT / WANDB_ENTITY / WANDB_DIR decide, and where
    # those are unset too: offline (no account or network; `wandb sync` later), project localsgd,
    # the run directory
    mode: str | None = None  # localsgd.loop.loggers.WANDB_MODES: offline | online | disabled
    project: str | None = None
    entity: str | None = None
    dir: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None  # null = from the command-line overrides
    group: str | None = None  # null = the multirun sweep directory (one group per sweep)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # a finished run's loss_vs_step.png in its directory (localsgd.analysis.plots.plot_run)
    plots: bool = True


@dataclass
class Config:
    seed: int = 0
    # the summary.json key `main` returns, the objective a Hydra sweeper (Optuna) optimises:
    # the validation split's; the language-model data presets set val_loss (minimise it:
    # hydra.sweeper.direction)
    optimized_metric: str = "val_accuracy"
    dist: DistConfig = field(default_factory=DistConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    optim: Any = MISSING  # a `_target_` config: conf/optim/ (sgd | adamw) or your own
    lr_schedule: Any = MISSING  # a `_target_` config: conf/lr_schedule/ or your own
    data: Any = field(default_factory=_data_node)  # a `_target_` config: conf/data/ or your own
    model: Any = MISSING  # a `_target_` config: conf/model/ or your own
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# The structured configs conf/ builds on: the root schema and the presets' schemas, which the
# group files extend (`defaults: [sgd_schema, _self_]`).
SCHEMAS = {
    (None, "config_schema"): Config,
    ("optim", "sgd_schema"): SGDConfig,
    ("optim", "adamw_schema"): AdamWConfig,
    ("optim", "muon_schema"): MuonConfig,
    ("model", "hf_schema"): HFModelConfig,
    ("lr_schedule", "warmup_cosine_schema"): WarmupCosineConfig,
    ("lr_schedule", "constant_schema"): ConstantLRConfig,
    ("lr_schedule", "step_schema"): StepLRConfig,
}


def register_schemas() -> None:
    """Put the schemas into Hydra's ConfigStore (before composing anything)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        store.store(group=group, name=name, node=node)


def typed(cfg: Any) -> Config:
    """The config as `Config` dataclass objects, what the workers get: from Hydra's DictConfig
    or a plain dict (resolved). `optim` / `lr_schedule` become their schema's dataclass, or a
    plain dict for a `_target_` config without one."""
    from omegaconf import OmegaConf

    if isinstance(cfg, Config):
        return cfg
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    # `data` and `model` hold their callable's own keys, which a dataclass object would drop:
    # they stay whole, as OpenNodes
    open_nodes = {
        k: _open_node(k, OmegaConf.to_container(cfg[k], resolve=True)) for k in OPEN_NODES
    }
    out = OmegaConf.to_object(cfg)  # resolves interpolations
    for key, node in open_nodes.items():
        setattr(out, key, node)
    return out


OPEN_NODES = ("data", "model")


def _open_node(key: str, node: dict) -> OpenNode:
    if key == "data":
        node.update(asdict(data_options(node)))  # localsgd's own keys typed, in the node's order
    return OpenNode(node)


class OpenNode(dict):
    """A config node with open keys (a `_target_` and its callable's arguments): a plain dict
    that also reads by attribute, as the typed nodes do (`cfg.data.partition`)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def plain(cfg: Any) -> dict:
    """The config as nested plain dicts and lists (checkpoint markers, wandb, .hydra files)."""
    import dataclasses

    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import OmegaConf

    if OmegaConf.is_config(cfg):
        # key by key: Hydra's own node (present with return_hydra_config) is left out
        return {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in cfg.items()
            if k != "hydra"
        }
    return cfg
