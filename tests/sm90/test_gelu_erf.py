"""The kernel's gelu (the ``gelu_erf`` entry of the op table, ``optable.gelu_erf``) run on torch
float32 tensors, against float64 ``x * Phi(x)``: the same code the kernel emits, on every range of x."""

import math

import pytest
import torch

from epicute.epilogue import optable


def kernel_gelu_fp32(x: torch.Tensor) -> torch.Tensor:
    # The emitter over the torch math namespace: rcp/exp2 in fp32 as the kernel's rcp.approx /
    # ex2.approx (<= 2 ulp: below what is checked).
    return optable.get("gelu_erf").emit(optable.TORCH_MATH, x)


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return 0.5 * x64 * torch.erfc(-x64 / math.sqrt(2.0))


def test_absolute_error_over_all_ranges():
    x = torch.cat([torch.linspace(-30, 30, 400_001), torch.randn(100_000) * 4]).float()
    err = (kernel_gelu_fp32(x).double() - exact_gelu(x)).abs()
    assert err.max().item() < 1e-6
    # No worse than torch's own float32 gelu, element by element up to the same bound.
    torch_err = (torch.nn.functional.gelu(x).double() - exact_gelu(x)).abs()
    assert err.max().item() <= max(torch_err.max().item(), 1e-6)


@pytest.mark.parametrize("lo,hi,bound", [(-3.0, 3.0, 1e-4), (-5.0, -3.0, 3e-3), (-8.0, -5.0, 2e-2)])
def test_relative_error(lo, hi, bound):
    x = torch.empty(200_000).uniform_(lo, hi)
    x = x[x != 0]  # gelu(0) = 0 has no relative error (an exact zero, drawn now and then; test_special_values)
    ref = exact_gelu(x)

    def worst_rel(out):
        return ((out.double() - ref).abs() / ref.abs()).max().item()

    rel = worst_rel(kernel_gelu_fp32(x))
    assert rel < bound
    # The negative tail is erfc computed directly, not 1 - erf: far better there than
    # torch's float32 gelu, which loses every digit by x = -5.
    assert rel <= worst_rel(torch.nn.functional.gelu(x))


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-30, -1e-30])
    out = kernel_gelu_fp32(x)
    assert out[0] == 0 and out[1] == 0
    assert out[2] == float("inf")
    assert out[3] == 0  # the limit; torch's gelu gives NaN, the reference follows the kernel
    assert torch.allclose(out[4:], 0.5 * x[4:], rtol=1e-6, atol=0)
    assert torch.isnan(kernel_gelu_fp32(torch.tensor([float("nan")]))).all()
