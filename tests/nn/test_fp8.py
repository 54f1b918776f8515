"""epicute.nn.fp8 on the reference backend: gradients against float64 autograd, the layer switch, typed errors."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute.nn import GatedMLP, Linear, MoEExperts, fp8_gated_mlp, fp8_linear, fp8_moe_experts
from tests.nn.fp8_cases import TOL, errors, gated_errors, moe_errors


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize(("lead", "bias"), [((37,), True), ((3, 13), False)])
def test_gradients_against_float64(recipe, lead, bias):
    with epicute.use_backend("reference"):
        found = errors(recipe, lead, 272, 144, bias, "cpu")
    assert all(e < TOL for e in found.values()), found


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_gated_mlp_gradients_against_float64(compiled):
    # Compiled (dynamic sizes): the gated GEMM's fake checked its blockwise scales against half of B's columns (D's),
    # refusing the scales of all of them that the eager call takes; a rowwise scale's check hashed the symbolic
    # sizes; and Inductor's CPU code made NaN of the reference quantizer's partial groups.
    with epicute.use_backend("reference"):
        found = gated_errors("blockwise", 37, 144, 272, "cpu", compiled)
    assert all(e < TOL for e in found.values()), found


@pytest.mark.parametrize(("tokens", "top_k"), [(37, 2), (67, 1)])
def test_the_experts_gradients_against_float64(tokens, top_k):
    """Every gradient of the fp8 experts (the routing weights' too), one expert routed no token. A routing weight's
    gradient is one dot product per routed row, whose norm-wise error over a handful of rows is noisy (up to 22 %
    over 5 rows, measured): the cases route 67 rows or more (5-8 % measured)."""
    with epicute.use_backend("reference"):
        found = moe_errors(tokens, 4, 256, 192, top_k, "cpu")
    assert all(e < TOL for e in found.values()), found


def test_the_experts_train_under_torch_compile():
    with epicute.use_backend("reference"):
        found = moe_errors(67, 4, 128, 128, 2, "cpu", compiled=True)
    assert all(e < TOL for e in found.values()), found


def test_the_experts_pad_each_experts_rows():
    """Each expert's routed rows start on a multiple of 128, in order, within a capacity that holds any routing;
    padding rows read token 0 with weight 0, and each (token, slot) pair finds its padded row."""
    from epicute.nn.functional import Routing

    index = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0]])
    weights = torch.rand(4, 2)
    route = Routing.of(index, weights, 5)  # experts 1 and 4 routed nothing
    padded = route.padded(128)
    assert route.counts.tolist() == [3, 0, 3, 2, 0] and padded.offsets.tolist() == [128, 128, 256, 384, 384]
    assert padded.token_of_row.shape == (768,)  # 8 rows + 127 * 5, rounded up to 128
    real = [0, 1, 2, 128, 129, 130, 256, 257]
    assert padded.slot_of.sort().values.tolist() == real
    assert torch.equal(padded.token_of_row[padded.slot_of], torch.arange(4).repeat_interleave(2))
    assert torch.equal(padded.weight[padded.slot_of, 0], weights.reshape(-1))
    assert not padded.weight[[r for r in range(768) if r not in real]].any()


@pytest.mark.parametrize(
    ("make", "features"),
    [(lambda: Linear(256, 144, fp8="blockwise", dtype=torch.bfloat16), (256, 144)),
     (lambda: GatedMLP(128, 256, fp8="blockwise", dtype=torch.bfloat16), (128, 128)),
     (lambda: MoEExperts(4, 128, 64, fp8="blockwise", dtype=torch.bfloat16), (128, 128))],
    ids=["linear", "gated_mlp", "experts"],
)  # fmt: skip
def test_the_layer_switch_trains_and_keeps_its_state_dict(make, features):
    layer = make()
    keys = set(layer.state_dict())
    x = torch.randn(2, 17, features[0], dtype=torch.bfloat16)
    route = ()
    if isinstance(layer, MoEExperts):
        x = x.reshape(34, features[0])
        route = torch.randint(0, 4, (34, 2)), torch.rand(34, 2)
    with epicute.use_backend("reference"):
        y = layer(x, *route)
        y.float().square().mean().backward()
    assert y.shape == (*x.shape[:-1], features[1]) and all(p.grad is not None for p in layer.parameters())
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
        (lambda: MoEExperts(4, 96, 64, fp8="blockwise"), epicute.ShapeError, "multiples of 128 and 64"),
        (lambda: MoEExperts(4, 128, 64, fp8="rowwise"), epicute.ConfigError, "fp8='rowwise'"),
        (lambda: fp8_moe_experts(torch.ones(3, 128), torch.ones(2, 96, 128), torch.ones(2, 128, 48),
                                 torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)), epicute.ShapeError,
         "intermediate size of 64"),
        (lambda: fp8_moe_experts(torch.ones(3, 128), torch.ones(2, 128, 128), torch.ones(2, 128, 32),
                                 torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)), epicute.ShapeError,
         "do not chain"),
        (lambda: fp8_moe_experts(torch.ones(3, 128), torch.ones(2, 128, 128), torch.ones(2, 128, 64),
                                 torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), recipe="rowwise"),
         epicute.ConfigError, "blockwise recipe"),
        (lambda: fp8_moe_experts(torch.ones(3, 128), torch.ones(2, 128, 128), torch.ones(2, 128, 64),
                                 torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)), epicute.ShapeError,
         r"need \(T, H\), \(T, k\)"),
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


def test_no_tokens_give_empty_outputs_and_zero_weight_gradients():
    """A batch of no tokens (an empty microbatch, an expert block routed nothing): empty outputs and input
    gradients, zero weight gradients, for the linear and the experts alike."""
    x = torch.randn(0, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    gate_up = epicute.interleave_gate_up(torch.randn(3, 64, 128), torch.randn(3, 64, 128)).bfloat16()
    gate_up.requires_grad_()
    down = torch.randn(3, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    with epicute.use_backend("reference"):
        y = fp8_linear(x, w)
        z = fp8_moe_experts(x, gate_up, down, torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2))
        (y.float().sum() + z.float().sum()).backward()
    assert y.shape == (0, 64) and z.shape == (0, 128) and x.grad.shape == (0, 128)
    assert not w.grad.any() and not gate_up.grad.any() and not down.grad.any()
