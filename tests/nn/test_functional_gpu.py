"""epicute.nn.functional on the GPU: the fused MLP backward (the down projection's data-gradient GEMM carrying the
activation's derivative and b1's gradient), the gated MLP and linear with an epilogue, against float64 autograd;
ragged token counts, eager and under torch.compile."""

from __future__ import annotations

import pytest
import torch

from tests.nn.functional_cases import gated_mlp_step, linear_step, mlp_step

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
TOL = 1e-2  # bf16 storage of h, the pre-activation and the gradients between the GEMMs (8 significant bits)


@pytest.mark.parametrize("activation", ["gelu", "silu", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_gradients(activation, bias):
    errors = mlp_step((3, 333), 512, 1048, DEVICE, activation, bias)
    assert all(e < TOL for e in errors.values()), errors


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_mlp_gradients(activation):
    errors = gated_mlp_step((1001,), 512, 1048, DEVICE, activation)
    assert all(e < TOL for e in errors.values()), errors


def test_linear_with_bias_and_an_epilogue():
    errors = linear_step((5, 201), 512, 264, DEVICE)
    assert all(e < TOL for e in errors.values()), errors


def test_compiled_mlp_training_step():
    """The autograd Function under torch.compile(fullgraph=True, dynamic=True): its GEMMs trace as op calls."""
    from epicute.nn import functional as EF

    torch._dynamo.reset()
    compiled = torch.compile(EF.mlp, fullgraph=True, dynamic=True)
    original = EF.mlp
    try:
        EF.mlp = compiled
        for tokens in ((333,), (777,)):
            errors = mlp_step(tokens, 512, 1048, DEVICE, "gelu", True)
            assert all(e < TOL for e in errors.values()), (tokens, errors)
    finally:
        EF.mlp = original


def test_moe_experts_gradients():
    """The experts of a skewed top-2 MoE layer (an expert no token picks) against float64 autograd, expert by
    expert; the result is the same bits run to run."""
    from epicute.nn import functional as EF

    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 301, 512, 264, 8, 2
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden**0.5
    down = torch.randn(experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16) / inter**0.5
    gate_up, down = gate_up.requires_grad_(), down.requires_grad_()
    popular = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.05, 0.02, 0.0])  # expert 7: never picked
    index = torch.stack([torch.multinomial(popular, top_k) for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEVICE), -1).requires_grad_()
    y = EF.moe_experts(x, gate_up, down, index, weights)
    assert torch.equal(y, EF.moe_experts(x, gate_up, down, index, weights))
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, gu64, d64, w64 = (t.detach().double().requires_grad_() for t in (x, gate_up, down, weights))
    want = torch.zeros(tokens, hidden, device=DEVICE, dtype=torch.float64)
    for e in range(experts):
        token, slot = torch.where(index == e)
        g, u = torch.nn.functional.linear(x64[token], gu64[e]).chunk(2, dim=-1)
        rows = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, d64[e]) * w64[token, slot, None]
        want = want.index_add(0, token, rows)
    want.backward(grad.double())
    errors = {name: ((got.double() - ref).norm() / ref.norm()).item() for name, got, ref in (
        ("out", y, want.detach()), ("x", x.grad, x64.grad), ("gate_up", gate_up.grad, gu64.grad),
        ("down", down.grad, d64.grad), ("weights", weights.grad, w64.grad))}  # fmt: skip
    assert all(e < TOL for e in errors.values()), errors
