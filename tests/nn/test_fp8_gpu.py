"""epicute.nn.fp8 on the kernels (the group quantizer and the blockwise or rowwise fp8 GEMMs): gradients against
float64 autograd of the same math, odd token counts."""

from __future__ import annotations

import pytest

from tests.nn.fp8_cases import TOL, errors, gated_errors, moe_errors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
@pytest.mark.parametrize(("lead", "bias"), [((1001,), True), ((3, 131), False)])
def test_gradients_against_float64(recipe, lead, bias):
    found = errors(recipe, lead, 1040, 528, bias, "cuda")
    assert all(e < TOL for e in found.values()), found


def test_the_gated_mlp_gradients_against_float64():
    found = gated_errors("blockwise", 1001, 1040, 528, "cuda")
    assert all(e < TOL for e in found.values()), found


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1001, 8, 2), (131, 5, 1)])
def test_the_experts_gradients_against_float64(tokens, experts, top_k):
    """The fp8 experts on the kernels (gathered fp8 rows, the gated GEMM's saved gate and up, the derivative's
    epilogue with the routing weight's row sum, variable-K fp8 weight gradients over padded experts), one expert
    routed nothing."""
    found = moe_errors(tokens, experts, 384, 320, top_k, "cuda")
    assert all(e < TOL for e in found.values()), found
