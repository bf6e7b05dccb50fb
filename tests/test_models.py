"""Model zoo: shapes, determinism, causality, parameter counts and refused combinations."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from localsgd.config import ConfigError
from localsgd.models import build_model
from tests.helpers import CONF


def cfg(name: str, **over) -> dict:
    """conf/model/NAME.yaml with `over` applied, as the CLI composes it."""
    node = OmegaConf.load(os.path.join(CONF, "model", f"{name}.yaml"))
    return {**OmegaConf.to_container(node), **over}


CLASSIFIERS = ["mlp", "cnn"]
SHAPES = [(40,), (1, 8, 8), (3, 32, 32), (2, 16)]


@pytest.mark.parametrize("name", CLASSIFIERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_classifier_output_shape(name, shape):
    torch.manual_seed(0)
    model = build_model(cfg(name), shape, 10)
    assert model(torch.randn(5, *shape)).shape == (5, 10)


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_resnet20_output_shape(shape):
    model = build_model(cfg("resnet20"), shape, 10)
    assert model(torch.randn(2, *shape)).shape == (2, 10)


def test_resnet20_parameter_count_and_buffers():
    model = build_model(cfg("resnet20"), (3, 32, 32), 10)
    n = sum(p.numel() for p in model.parameters())
    assert 0.26e6 < n < 0.28e6
    buffers = dict(model.named_buffers())
    assert any(k.endswith("running_mean") and v.is_floating_point() for k, v in buffers.items())
    assert all(v.dtype == torch.int64 for k, v in buffers.items() if "num_batches_tracked" in k)


def test_transformer_shape_and_causality():
    torch.manual_seed(0)
    model = build_model(cfg("transformer", d_model=32, n_layers=2, n_heads=4), (16,), 50, task="lm")
    model.eval()
    x = torch.randint(0, 50, (3, 16))
    out = model(x)
    assert out.shape == (3, 16, 50)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 50
    out2 = model(x2)
    assert torch.allclose(out[:, :10], out2[:, :10], atol=1e-5)
    assert not torch.allclose(out[:, 10:], out2[:, 10:])
    assert model(x[:, :7]).shape == (3, 7, 50)  # shorter sequences are fine


@pytest.mark.parametrize(
    "make",
    [
        lambda: cfg("cnn"),
        lambda: OmegaConf.create(cfg("cnn")),
        lambda: {"_target_": "localsgd.models.cnn"},  # the callable's own defaults
    ],
)
def test_config_flavours_build_identical_models_under_seed(make):
    torch.manual_seed(3)
    a = build_model(make(), (40,), 10)
    torch.manual_seed(3)
    b = build_model(cfg("cnn"), (40,), 10)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb)


def test_mlp_dropout_and_hidden():
    model = build_model(cfg("mlp", hidden=[16, 8], dropout=0.5), (40,), 3)
    linears = [(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear]
    assert linears == [(40, 16), (16, 8), (8, 3)]  # the widths asked for, not only the depth
    assert [m.p for m in model.modules() if type(m) is nn.Dropout] == [0.5, 0.5]


def test_cnn_overfits_tiny_mnist1d_batch():
    torch.manual_seed(0)
    x, y = torch.randn(32, 40), torch.randint(0, 10, (32,))
    model = build_model(cfg("cnn"), (40,), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = None
    for _ in range(60):
        loss = F.cross_entropy(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


def test_cnn_deep_config_on_tiny_images():
    model = build_model(cfg("cnn", channels=[8, 8, 8, 8, 8], kernel_size=3), (1, 8, 8), 10)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    # the deep config itself was built (five 3x3 convs of 8), not the preset's two layers
    convs = [m for m in model.modules() if type(m) is nn.Conv2d]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(8, (3, 3))] * 5


@pytest.mark.parametrize(
    "name,shape,task,match",
    [
        ("transformer", (40,), "classification", "transformer"),
        ("transformer", (1, 8, 8), "lm", "transformer"),
        ("resnet20", (40,), "classification", "resnet20"),
        ("resnet20", (2, 16), "classification", "resnet20"),
        ("mlp", (64,), "lm", "mlp"),
        ("cnn", (64,), "lm", "cnn"),
    ],
)
def test_bad_combinations_raise(name, shape, task, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_model(cfg(name), shape, 10, task=task)
    assert "\n" not in str(info.value)


def test_unknown_target_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^model\._target_ must be an importable") as info:
        build_model({"_target_": "localsgd.models.vit"}, (40,), 10)
    assert "\n" not in str(info.value)


def _net_with_kwargs(**kwargs):
    return kwargs  # not a module: refused


def _net_naming_some(num_classes, width=3):
    return torch.nn.Linear(width, num_classes)


def test_offered_values_reach_only_callables_that_name_them():
    model = build_model({"_target_": f"{__name__}._net_naming_some"}, (3,), 7)
    assert model.out_features == 7  # num_classes offered; input_shape and task not (not named)
    with pytest.raises(ConfigError, match="must return a torch.nn.Module"):
        build_model({"_target_": f"{__name__}._net_with_kwargs"}, (3,), 7)


def test_transformer_heads_must_divide_d_model():
    with pytest.raises(ValueError, match="n_heads"):
        build_model(cfg("transformer", d_model=30, n_heads=4), (16,), 20, task="lm")


def _takes_anything(**kwargs):
    _takes_anything.got = kwargs
    return torch.nn.Linear(1, 1)


def test_a_callable_with_kwargs_is_offered_everything_and_text_gets_vocab_size():
    build_model({"_target_": f"{__name__}._takes_anything", "width": 3}, (16,), 29, task="lm")
    assert _takes_anything.got == {
        "width": 3,
        "input_shape": [16],
        "num_classes": 29,
        "task": "lm",
        "vocab_size": 29,
    }  # fmt: skip  (instantiate passes sequences as lists)
