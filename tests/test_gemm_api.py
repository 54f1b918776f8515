"""``epicute.gemm``'s own wiring on the CPU: the reference backend and argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute import ConfigError, EpilogueError, ops


def rand(*shape):
    return torch.randn(shape, dtype=torch.bfloat16)


def test_reference_backend_runs_the_epilogue_on_cpu():
    a, b, bias, r = rand(17, 64), rand(64, 136), rand(136), rand(17, 136)
    d = epicute.gemm(a, b, epilogue=lambda acc, bias, r, alpha: ops.gelu(alpha * acc + bias) + r,
                     bias=bias, r=r, alpha=0.5, backend="reference")  # fmt: skip
    ref = F.gelu(0.5 * (a.float() @ b.float()) + bias.float()) + r.float()
    assert d.shape == (17, 136) and d.dtype == torch.bfloat16
    assert ((d.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_reference_backend_writes_out_and_returns_all_outputs():
    a, b = rand(2, 24, 32), rand(2, 32, 40)
    out = torch.full((2, 24, 40), float("nan"), dtype=torch.bfloat16)
    res = epicute.gemm(a, b, epilogue=lambda acc: {"D": acc, "rows": ops.row_sum(acc)}, out=out, backend="reference")
    assert res["D"].data_ptr() == out.data_ptr() and not out.isnan().any()
    assert torch.allclose(res["rows"], (a.float() @ b.float()).sum(-1), rtol=1e-4, atol=1e-3)


def test_plain_reference_backend():
    a, b = rand(24, 32), rand(32, 40)
    d = epicute.gemm(a, b, out_dtype=torch.float32, backend="reference")
    assert torch.allclose(d, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_operands_without_epilogue_are_an_error():
    with pytest.raises(EpilogueError, match="without an epilogue"):
        epicute.gemm(rand(8, 8), rand(8, 8), bias=rand(8), backend="reference")


def test_unknown_backend_is_an_error():
    with pytest.raises(ConfigError, match="backend='triton'"):
        epicute.gemm(rand(8, 8), rand(8, 8), backend="triton")



SCALE = 2.0


def test_trace_memo_key_follows_what_the_trace_depends_on():
    """A fused call reuses its trace only while the function, its closure, defaults and named globals are unchanged."""
    global SCALE
    from epicute.api import _capture_key

    def scaled(acc, bias):
        return acc * SCALE + bias

    before = _capture_key(scaled)
    assert before == _capture_key(scaled) and hash(before) == hash(_capture_key(scaled))
    SCALE = 3.0
    try:
        assert _capture_key(scaled) != before
    finally:
        SCALE = 2.0

    def closing_over(c):
        return lambda acc: acc * c

    assert _capture_key(closing_over(1.0)) != _capture_key(closing_over(2.0))
    assert _capture_key(closing_over([1.0])) is None  # unhashable capture: always trace
    assert _capture_key(epicute.epilogues.plain) == _capture_key(epicute.epilogues.plain.fn)
