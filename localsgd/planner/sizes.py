"""What each setting puts on the wire for one model, exactly as the averagers count it.

`ModelShape.of(module)` records, once, the numbers of values the averagers send: the averaged
tensors (parameters and floating-point buffers) per flat buffer, split into the fragments
Streaming DiLoCo would make (`fragment_ids`, the averagers' own split), and the trainable
parameters the warmup's gradient average sends. `wire_bytes` turns a number of values into
bytes for a wire with the codecs' own formulas (`quantize.BlockCodec`, `sparse.TopKCodec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from localsgd.averaging.flat import averaged_tensors
from localsgd.averaging.streaming.fragments import fragment_ids
from localsgd.averaging.wire.compress import comm_dtype_of
from localsgd.averaging.wire.quantize import QUANTIZED_FORMATS, BlockCodec
from localsgd.averaging.wire.sparse import TopKCodec

# the fragment counts a plan may ask about
FRAGMENT_COUNTS = (1, 2, 4, 8)


@dataclass
class ModelShape:
    """Numbers of values, per flat buffer (one per dtype): `grads` the warmup's gradient
    buffers; `fragments[P][p]` fragment p of P's share of each flat buffer (zeros left out);
    `refused[P]` why the model cannot be cut in P fragments."""

    params: int
    grads: list[int]
    fragments: dict[int, list[list[int]]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, module: nn.Module, counts: tuple[int, ...] = FRAGMENT_COUNTS) -> ModelShape:
        trainable = [p for p in module.parameters() if p.requires_grad]
        tensors = averaged_tensors(module)
        groups = {t.dtype: None for t in tensors}  # flat buffers, in their order
        shape = cls(
            params=sum(p.numel() for p in trainable),
            grads=_per_dtype(trainable, {p.dtype: None for p in trainable}),
        )
        for count in counts:
            try:
                ids = fragment_ids(module, count)
            except ValueError as e:
                shape.refused[count] = str(e)
                continue
            shape.fragments[count] = [
                [
                    n
                    for n in _per_dtype(
                        [t for t, i in zip(tensors, ids, strict=True) if i == p], groups
                    )
                    if n
                ]
                for p in range(count)
            ]
        return shape

    def to_dict(self) -> dict:
        return {
            "params": self.params,
            "grads": self.grads,
            "fragments": {str(k): v for k, v in self.fragments.items()},
            "refused": {str(k): v for k, v in self.refused.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> ModelShape:
        return cls(
            params=int(d["params"]),
            grads=[int(n) for n in d["grads"]],
            fragments={int(k): v for k, v in d["fragments"].items()},
            refused={int(k): v for k, v in d["refused"].items()},
        )


def _per_dtype(tensors, groups: dict) -> list[int]:
    sizes = dict.fromkeys(groups, 0)
    for t in tensors:
        sizes[t.dtype] += t.numel()
    return list(sizes.values())


def wire_bytes(numel: int, wire: str, block_size: int = 128, topk: TopKCodec | None = None) -> int:
    """Bytes one worker sends for `numel` values on `wire`: a `sync.comm_dtype` name, or "topk"
    (`topk`: the codec, default SparseLoCo's 64 of 4096)."""
    if wire == "topk":
        return (topk or TopKCodec()).wire_bytes(numel)
    if wire in QUANTIZED_FORMATS:
        return BlockCodec(wire, block_size).wire_bytes(numel)
    return numel * comm_dtype_of(wire).itemsize


def gathered(wire: str) -> bool:
    """Whether the wire's messages are all-gathered (they cannot be summed in a reduction)."""
    return wire == "topk" or wire in QUANTIZED_FORMATS


def shape_of(run_cfg) -> ModelShape:
    """The shape of the model a run of the typed config `run_cfg` trains (its data read for
    the input shape and classes, the model built as the trainer builds it)."""
    from localsgd.data import input_shape_of, load_data, task_of
    from localsgd.models import build_model

    data = load_data(run_cfg.data, seed=run_cfg.seed)
    model = build_model(run_cfg.model, input_shape_of(data), data.num_classes, task_of(data))
    return ModelShape.of(model)
