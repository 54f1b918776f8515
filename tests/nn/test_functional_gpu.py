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
