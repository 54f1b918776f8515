"""epicute.nn.fp8 on the reference backend: gradients against float64 autograd, the layer switch, typed errors."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.nn import Linear, fp8_linear
from tests.nn.fp8_cases import TOL, errors


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize(("lead", "bias"), [((37,), True), ((3, 13), False)])
def test_gradients_against_float64(recipe, lead, bias):
    with epicute.use_backend("reference"):
        found = errors(recipe, lead, 272, 144, bias, "cpu")
    assert all(e < TOL for e in found.values()), found


def test_the_layer_switch_trains_and_keeps_its_state_dict():
    layer = Linear(256, 144, fp8="blockwise", dtype=torch.bfloat16)
    keys = set(layer.state_dict())
    x = torch.randn(2, 17, 256, dtype=torch.bfloat16)
    with epicute.use_backend("reference"):
        y = layer(x)
        y.float().square().mean().backward()
    assert y.shape == (2, 17, 144) and layer.weight.grad is not None and layer.bias.grad is not None
    assert set(layer.state_dict()) == keys and "fp8='blockwise'" in repr(layer)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: fp8_linear(torch.ones(4, 32), torch.ones(16, 32), recipe="tensorwise"), epicute.ConfigError,
         "recipe='tensorwise'"),
        (lambda: fp8_linear(torch.ones(4, 40), torch.ones(16, 40)), epicute.ShapeError, "multiples of 16"),
        (lambda: fp8_linear(torch.ones(4, 32), torch.ones(16, 48)), epicute.ShapeError, "F.linear takes"),
        (lambda: fp8_linear(torch.ones(4, 32), torch.ones(16, 32), torch.ones(8)), epicute.ShapeError, "bias"),
        (lambda: Linear(32, 16, fp8="e4m3"), epicute.ConfigError, "fp8='e4m3'"),
        (lambda: Linear(32, 16, fp8="rowwise", epilogue=lambda acc: acc), epicute.ConfigError, "fuses none"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()
