"""epicute.nn.fp8 on the reference backend: gradients against float64 autograd, the layer switch, typed errors."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.nn import GatedMLP, Linear, fp8_gated_mlp, fp8_linear
from tests.nn.fp8_cases import TOL, errors, gated_errors


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize(("lead", "bias"), [((37,), True), ((3, 13), False)])
def test_gradients_against_float64(recipe, lead, bias):
    with epicute.use_backend("reference"):
        found = errors(recipe, lead, 272, 144, bias, "cpu")
    assert all(e < TOL for e in found.values()), found


def test_the_gated_mlp_gradients_against_float64():
    with epicute.use_backend("reference"):
        found = gated_errors("blockwise", 37, 144, 272, "cpu")
    assert all(e < TOL for e in found.values()), found


@pytest.mark.parametrize(
    ("make", "features"),
    [(lambda: Linear(256, 144, fp8="blockwise", dtype=torch.bfloat16), (256, 144)),
     (lambda: GatedMLP(128, 256, fp8="blockwise", dtype=torch.bfloat16), (128, 128))],
    ids=["linear", "gated_mlp"],
)  # fmt: skip
def test_the_layer_switch_trains_and_keeps_its_state_dict(make, features):
    layer = make()
    keys = set(layer.state_dict())
    x = torch.randn(2, 17, features[0], dtype=torch.bfloat16)
    with epicute.use_backend("reference"):
        y = layer(x)
        y.float().square().mean().backward()
    assert y.shape == (2, 17, features[1]) and all(p.grad is not None for p in layer.parameters())
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
        (lambda: GatedMLP(32, 64, fp8="rowwise"), epicute.ConfigError, "fp8='rowwise'"),
        (lambda: fp8_gated_mlp(torch.ones(4, 40), torch.ones(64, 40), torch.ones(40, 32)), epicute.ShapeError,
         "multiples of 16"),
        (lambda: fp8_gated_mlp(torch.ones(4, 32), torch.ones(64, 32), torch.ones(32, 32), recipe="rowwise"),
         epicute.ConfigError, "recipe='rowwise': the fp8 gated MLP takes the blockwise recipe"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _loss_curve(fp8: str | None, steps: int = 40) -> list[float]:
    """A small model (Linear, GatedMLP, Linear) fitting a fixed random target with AdamW: its loss at each step."""
    from torch import nn

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    model = nn.Sequential(Linear(32, 64, fp8=fp8, dtype=bf16), GatedMLP(64, 128, fp8=fp8, dtype=bf16),
                          Linear(64, 16, fp8=fp8, dtype=bf16))  # fmt: skip
    target = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 32, generator=batches)
        with torch.no_grad():
            y = target(x)
        loss = (model(x.to(bf16)).float() - y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_fp8_training_follows_the_bf16_loss_curve():
    # Each step's gradients carry the ~7 % relative error of two chained fp8 GEMMs (the tests above); AdamW's
    # normalized steps keep the curves within about that of each other (measured <= 4.3 %): 10 % at every step,
    # both falling at least fivefold, and not the same curve (the switch really runs fp8).
    with epicute.use_backend("reference"):
        fp8, bf16 = _loss_curve("blockwise"), _loss_curve(None)
    assert fp8[-1] < fp8[0] / 5 and bf16[-1] < bf16[0] / 5
    assert max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 0.1
    assert fp8 != bf16
