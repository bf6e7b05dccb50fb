"""The settings a plan compares: each one's overrides, what it sends, and its schedule.

Every row is a sync config as the studies ran it (docs/studies.md), so that what they measured
about its loss applies (`evidence.verdict`): DiLoCo with the paper's outer step from the first
round (`sync.outer_warmup_rounds=0`), Streaming DiLoCo as the LM study's `sync=diloco` with
fragments, the 4-bit wire as `int4` with error feedback, top-k as `+experiment=sparseloco_nesterov`.
"""

from __future__ import annotations

from dataclasses import dataclass

from localsgd.averaging.wire.sparse import TopKCodec
from localsgd.planner.model import Schedule
from localsgd.planner.sizes import ModelShape, gathered, wire_bytes

# the top-k row: the bytes study's 0.001 frontier (46 of every 4096 values, the senders' mean)
TOPK_DENSITY = 46 / 4096
TOPK = TopKCodec(TOPK_DENSITY, 4096, "senders")
WIRE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "int4": "4-bit", "topk": "top-k 46/4096"}


@dataclass(frozen=True)
class Setting:
    key: str
    kind: str  # ddp | plain | diloco | streaming
    period: int = 1
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    wire: str = "float32"  # a sync.comm_dtype, or "topk"

    @property
    def label(self) -> str:
        wire = "" if self.wire == "float32" else f", {WIRE_NAMES[self.wire]}"
        if self.kind == "ddp":
            return "DDP-like (gradients every step)"
        if self.kind == "plain":
            overlap = ", overlap" if self.delay else ""
            return f"plain averaging H={self.period}{overlap}{wire}"
        if self.kind == "diloco":
            return f"DiLoCo H={self.period}{wire}"
        return (
            f"Streaming DiLoCo H={self.period} P={self.fragments} τ={self.delay}"
            f"{' α=' + format(self.alpha, 'g') if self.alpha else ''}{wire}"
        )

    def overrides(self, steps: int) -> list[str]:
        """The sync overrides that run this setting for a job of `steps` steps."""
        if self.kind == "ddp":  # the warmup's gradient all-reduce, for the whole run
            return ["sync=local_sgd", f"sync.warmup_steps={steps}", "sync.period=1"]
        if self.kind == "plain":
            out = ["sync=local_sgd", f"sync.period={self.period}"]
            return out + (["sync.overlap=true"] if self.delay else []) + self._wire()
        if self.wire == "topk":  # +experiment=sparseloco_nesterov's sync, at this period
            return [
                "sync=sparseloco",
                f"sync.period={self.period}",
                f"sync.topk_density={TOPK_DENSITY}",
                "sync.topk_mean=senders",
                "sync.error_feedback_decay=0.8",
                "sync.outer_momentum=0.5",
                "sync.outer_nesterov=true",
                "sync.outer_lr=1.0",
            ]
        out = ["sync=diloco", f"sync.period={self.period}", "sync.outer_warmup_rounds=0"]
        if self.kind == "streaming":
            out += [
                f"sync.fragments={self.fragments}",
                f"sync.delay_steps={self.delay}",
                f"sync.merge_alpha={self.alpha:g}",
            ]
        return out + self._wire()

    def _wire(self) -> list[str]:
        if self.wire == "float32":
            return []
        feedback = ["sync.error_feedback=true"] if gathered(self.wire) else []
        return [f"sync.comm_dtype={self.wire}", *feedback]

    def schedule(self, shape: ModelShape) -> Schedule | str:
        """What this setting sends for a model of `shape`, or why it cannot run on it."""
        if self.kind == "ddp":  # one fp32 all-reduce per gradient buffer
            return Schedule(1, (4 * sum(shape.grads),), pieces=len(shape.grads))
        if self.fragments not in shape.fragments:
            return shape.refused.get(self.fragments, f"fragments={self.fragments} not measured")
        parts = shape.fragments[self.fragments]
        topk = TOPK if self.wire == "topk" else None
        sizes = tuple(sum(wire_bytes(n, self.wire, topk=topk) for n in part) for part in parts)
        return Schedule(
            self.period,
            sizes,
            delay=self.delay,
            gather=gathered(self.wire),
            pieces=max(len(part) for part in parts),
        )


GRID = (
    Setting("ddp", "ddp"),
    Setting("plain-h16", "plain", 16),
    Setting("plain-h16-overlap", "plain", 16, delay=1),
    Setting("plain-h64", "plain", 64),
    Setting("diloco-h16", "diloco", 16),
    Setting("diloco-h16-bf16", "diloco", 16, wire="bfloat16"),
    Setting("diloco-h16-int4", "diloco", 16, wire="int4"),
    Setting("topk-h16", "diloco", 16, wire="topk"),
    Setting("diloco-h64", "diloco", 64),
    Setting("diloco-h64-int4", "diloco", 64, wire="int4"),
    Setting("stream-h16-p4-t0", "streaming", 16, 4, 0),
    Setting("stream-h16-p4-t1", "streaming", 16, 4, 1, 0.5),
    Setting("stream-h16-p4-t4", "streaming", 16, 4, 4, 0.5),
    Setting("stream-h16-p4-t1-int4", "streaming", 16, 4, 1, 0.5, "int4"),
    Setting("stream-h64-p4-t4", "streaming", 64, 4, 4, 0.5),
    Setting("stream-h64-p4-t4-int4", "streaming", 64, 4, 4, 0.5, "int4"),
)
BY_KEY = {s.key: s for s in GRID}
