"""Split-K's launch on CPU: the strided K-slices of A and B, and the ordered sum of partials.

The kernel is replaced by a batched matmul over exactly the views the launch hands
it, so this checks the slicing for every operand major without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from epicute.plan import GemmProblem, plan_gemm
from epicute.plan.hardware import H100_SXM
from epicute.runtime import launch
from epicute.runtime.validate import check_gemm_args


@pytest.mark.parametrize("a_t", [False, True], ids=["a-row", "a-col"])
@pytest.mark.parametrize("b_t", [False, True], ids=["b-row", "b-col"])
def test_split_k_slices_and_sum(monkeypatch, a_t, b_t):
    m, n, k, splits = 24, 40, 4096, 4  # M stays a multiple of 8: column-major A is M-contiguous
    bf16 = torch.bfloat16
    a = torch.randn(k, m, dtype=bf16).t() if a_t else torch.randn(m, k, dtype=bf16)
    b = torch.randn(n, k, dtype=bf16).t() if b_t else torch.randn(k, n, dtype=bf16)
    seen = []

    def fake_kernel(a_slices, b_slices, partials, epi_tensors, epi_scalars):
        seen.append((a_slices.shape, b_slices.shape, partials.dtype))
        torch.bmm(a_slices.float(), b_slices.float(), out=partials)

    monkeypatch.setattr(launch, "kernel_for", lambda plan, fusion=None: fake_kernel)
    call = check_gemm_args(a, b, None, torch.float32, require_cuda=False)
    plan = plan_gemm(
        GemmProblem(m, n, k, a_major=call.problem.a_major, b_major=call.problem.b_major, d_dtype="fp32"),
        H100_SXM,
        split_k=splits,
    )
    out = torch.full((m, n), float("nan"))
    call = check_gemm_args(a, b, out, None, require_cuda=False)
    result = launch.launch_gemm(call, plan)
    assert seen == [(torch.Size([splits, m, k // splits]), torch.Size([splits, k // splits, n]), torch.float32)]
    assert result.data_ptr() == out.data_ptr()
    ref = a.double() @ b.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
