"""``epicute.gemm``'s own wiring on the CPU: the reference backend and argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epicute
from epicute import ConfigError, DeviceError, EpilogueError, ops


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


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_plain_reference_backend_saturates_fp8(dtype):
    # Rows of +-300 times columns of 50 sum to +-4.8e5, past both formats' largest finite values (448, 57344).
    a = torch.full((16, 32), 300.0, dtype=torch.bfloat16)
    a[8:] = -300.0
    b = torch.full((32, 16), 50.0, dtype=torch.bfloat16)
    d = epicute.gemm(a, b, out_dtype=dtype, backend="reference").float()
    largest = torch.finfo(dtype).max
    assert torch.all(d[:8] == largest) and torch.all(d[8:] == -largest)


def test_operands_without_epilogue_are_an_error():
    with pytest.raises(EpilogueError, match="without an epilogue"):
        epicute.gemm(rand(8, 8), rand(8, 8), bias=rand(8), backend="reference")


def test_unknown_backend_is_an_error():
    with pytest.raises(ConfigError, match="backend='triton'"):
        epicute.gemm(rand(8, 8), rand(8, 8), backend="triton")


SCALE = 2.0
NAMES = {"out": "D"}


def test_trace_memo_key_follows_what_the_trace_depends_on():
    """A fused call reuses its trace only while the function, its closure, defaults and named globals are unchanged."""
    global SCALE
    from epicute.epilogue.tracer import trace_key as _capture_key

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

    def named(acc):  # a module table read at trace time: the key holds its contents
        return {NAMES["out"]: acc}

    keyed = _capture_key(named)
    assert keyed is not None and keyed == _capture_key(named)
    NAMES["out"] = "aux"
    try:
        assert _capture_key(named) != keyed
    finally:
        NAMES["out"] = "D"
    assert _capture_key(epicute.epilogues.plain) == _capture_key(epicute.epilogues.plain.fn)


def test_reference_backend_checks_config_pins_as_the_kernel_does():
    a, b = rand(24, 32), rand(32, 40)
    with pytest.raises(ConfigError, match="tile_n=100"):
        epicute.gemm(a, b, backend="reference", config={"tile_n": 100})
    with pytest.raises(ConfigError, match="tile_n=100"):
        epicute.gemm(a, b, epilogue=lambda acc: acc * 2.0, backend="reference", config={"tile_n": 100})
    assert epicute.gemm(a, b, backend="reference", config={"tile_n": 128}).shape == (24, 40)


def test_reference_backend_refuses_meta_tensors_with_a_typed_error():
    a = torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(DeviceError, match="a is a meta tensor.*explain works on meta"):
        epicute.gemm(a, a, backend="reference")
    q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(DeviceError, match="q is a meta tensor"):
        epicute.attention(q, q, q, backend="reference")


def test_unknown_op_is_a_typed_error_with_suggestions():
    with pytest.raises(EpilogueError, match=r"no op 'gleu'; did you mean ops\.gelu"):
        epicute.ops.gleu  # noqa: B018
    assert not hasattr(epicute.ops, "gleu") and hasattr(epicute.ops, "gelu")


def test_plans_repr_in_one_line():
    a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    text = repr(epicute.explain(a, a, file=None))
    assert "\n" not in text and len(text) < 200 and "4096x4096x4096" in text
    q = torch.empty(2, 1000, 16, 128, dtype=torch.bfloat16, device="meta")
    text = repr(epicute.explain_attention(q, q, q, file=None))
    assert "\n" not in text and len(text) < 200 and "d128" in text


def test_square_problem_takes_a_bias_as_torch_broadcasts_it():
    # M == N: a 1-D operand is a row vector (one value per column), as in torch's a @ b + bias.
    a, b, bias = rand(48, 40), rand(40, 48), rand(48)
    d = epicute.gemm(
        a, b, epilogue=lambda acc, bias: acc + bias, bias=bias, backend="reference", out_dtype=torch.float32
    )
    ref = a.double() @ b.double() + bias.double()
    assert ((d.double() - ref).norm() / ref.norm()).item() < 1e-6
    col = epicute.gemm(a, b, epilogue=lambda acc, s: acc * s, s=bias[:, None], backend="reference",
                       out_dtype=torch.float32)  # fmt: skip
    ref = (a.double() @ b.double()) * bias.double()[:, None]
    assert ((col.double() - ref).norm() / ref.norm()).item() < 1e-6
