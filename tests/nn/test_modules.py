"""epicute.nn's layers on the CPU (the GEMMs by the reference backend): state dicts in the checkpoint's layout,
training against the same layer written in torch (float64 autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import epicute
from epicute.nn import GatedMLP, Linear

TOL = 1e-2  # bf16 weights, activations and gradients


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def test_gated_mlp_state_dict_has_the_checkpoint_layout():
    gate, up, down = (nn.Linear(48, 80, bias=False), nn.Linear(48, 80, bias=False), nn.Linear(80, 48, bias=False))
    mlp = GatedMLP.from_projections(gate, up, down)
    state = mlp.state_dict()
    assert sorted(state) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    for key, linear in (("gate_proj.weight", gate), ("up_proj.weight", up), ("down_proj.weight", down)):
        assert torch.equal(state[key], linear.weight.detach())  # a copy of the same values: moved, not computed
    concatenated = GatedMLP(48, 80)
    concatenated.load_state_dict({"gate_up_proj.weight": torch.cat([gate.weight, up.weight]).detach(),
                                  "down_proj.weight": down.weight.detach()})  # fmt: skip
    assert torch.equal(concatenated.gate_up, mlp.gate_up)
    assert torch.equal(mlp.gate_up, epicute.interleave_gate_up(gate.weight, up.weight))


def test_gated_mlp_trains_like_the_torch_mlp(reference_layers):
    torch.manual_seed(0)
    ref = [nn.Linear(48, 80, bias=False, dtype=torch.bfloat16) for _ in range(2)]
    down = nn.Linear(80, 48, bias=False, dtype=torch.bfloat16)
    mlp = GatedMLP.from_projections(ref[0], ref[1], down)
    x = torch.randn(3, 7, 48, dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64 = x.detach().double().requires_grad_()
    g64, u64, d64 = (p.weight.detach().double().requires_grad_() for p in (*ref, down))
    want = F.linear(F.silu(F.linear(x64, g64)) * F.linear(x64, u64), d64)
    want.backward(grad.double())
    grads = mlp.gate_up.grad  # the interleaved weight's: the reference's gate and up gradients, interleaved
    errors = {"out": _rel(y, want.detach()), "x": _rel(x.grad, x64.grad), "down": _rel(mlp.down_proj.weight.grad,
              d64.grad), "gate_up": _rel(grads, epicute.interleave_gate_up(g64.grad, u64.grad))}  # fmt: skip
    assert all(e < TOL for e in errors.values()), errors


def test_linear_shares_its_parameters_and_trains(reference_layers):
    torch.manual_seed(1)
    torch_linear = nn.Linear(48, 40, dtype=torch.bfloat16)
    layer = Linear.from_linear(torch_linear)
    assert layer.weight is torch_linear.weight and sorted(layer.state_dict()) == ["bias", "weight"]
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
    F.linear(x64, w64, b64).square().sum().backward()
    for got, want in ((x.grad, x64.grad), (layer.weight.grad, w64.grad), (layer.bias.grad, b64.grad)):
        assert _rel(got, want) < TOL


def test_gated_mlp_refuses_what_it_cannot_hold():
    with pytest.raises(epicute.ShapeError, match="multiple of 8"):
        GatedMLP(48, 84)
    with pytest.raises(epicute.ShapeError, match="gate_proj has a bias"):
        GatedMLP.from_projections(nn.Linear(8, 16), nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))


def test_bad_layer_arguments_are_refused_with_the_fix():
    from epicute.nn import Attention, MoEExperts, top_k_routing

    with pytest.raises(epicute.EpilogueError, match=r"activation='swish': MoEExperts takes one of"):
        MoEExperts(4, 64, 128, activation="swish")
    with pytest.raises(epicute.ShapeError, match="intermediate_size=100"):
        MoEExperts(4, 64, 100)
    with pytest.raises(epicute.ShapeError, match=r"router_logits \(5, 8\) and top_k=9"):
        top_k_routing(torch.randn(5, 8), 9)
    with pytest.raises(epicute.ShapeError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        Attention(384, 6, 4)
    from epicute.nn import rotary
    from epicute.nn.functional import linear

    for t, positions in ((torch.randn(1, 4, 2, 63), torch.arange(4)[None]),  # odd head_dim
                         (torch.randn(2, 4, 2, 64), torch.arange(5)[None]),  # positions of another length
                         (torch.randn(4, 2, 64), torch.arange(4)[None])):  # no batch  # fmt: skip
        with pytest.raises(epicute.ShapeError, match="rotary takes t .batch, s, heads, head_dim. with an even"):
            rotary(t, positions)
    with pytest.raises(epicute.ShapeError, match="weight is NoneType; linear takes a 2-D"):
        linear(torch.randn(4, 16), None)


@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_routing_picks_the_largest_probabilities(normalize):
    from epicute.nn import top_k_routing

    logits = (torch.rand(37, 8).argsort(-1) * 0.37).to(torch.bfloat16)  # distinct in each row: no ties to break
    index, weights = top_k_routing(logits, 2, normalize=normalize)
    probs = torch.softmax(logits.double(), dim=-1)
    assert torch.equal(index.sort(-1).values, probs.topk(2, dim=-1).indices.sort(-1).values)
    want = probs.gather(1, index)
    want = want / want.sum(-1, keepdim=True) if normalize else want
    assert weights.dtype == torch.float32 and ((weights.double() - want).norm() / want.norm()).item() < 1e-6
