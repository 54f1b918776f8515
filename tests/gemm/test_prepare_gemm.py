"""``epicute.prepare_gemm``: a call prepared once launches what ``epicute.gemm`` would, and refuses, before any
launch, an argument it was not prepared for.

As in test_prepared.py: CPU tensors, the GPU check lifted, the compiled kernel replaced by a recorder.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import AlignmentError, OutputError, SignatureError
from epicute.gemm import api as api_module
from tests.gemm.test_prepared import E4, K, L, M, N, _cases, _described, _tensors, rand, stub_kernel

#: ``epicute.gemm``'s options, fixed when a call is prepared; the rest are the call's arguments.
OPTIONS = ("epilogue", "out_dtype", "out_dtypes", "config", "gated")


@pytest.fixture
def kernel(monkeypatch):
    return stub_kernel(monkeypatch)


def _split(kw: dict) -> tuple[dict, dict]:
    return {k: v for k, v in kw.items() if k in OPTIONS}, {k: v for k, v in kw.items() if k not in OPTIONS}


def _shapes(result) -> dict:
    result = result if isinstance(result, dict) else {"D": result}
    return {name: (t.shape, t.dtype) for name, t in result.items()}


@pytest.mark.parametrize("name", list(_cases()))
def test_a_prepared_call_launches_what_gemm_would(kernel, monkeypatch, name):
    make = _cases()[name]
    (a1, b1), kw1 = make(0)
    (a2, b2), kw2 = make(16)
    options, args1 = _split(kw1)
    prepared = epicute.prepare_gemm(a1, b1, **options, **args1)
    assert isinstance(prepared, epicute.PreparedGemmCall)
    assert not kernel.calls, "preparing launched"
    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    got = prepared(a2, b2, **_split(kw2)[1])
    assert not whole_path, "the prepared call validated, traced or planned"
    cached = kernel.calls[-1]

    monkeypatch.setattr(api_module, "_PREPARED_CALLS", {})
    want = epicute.gemm(a2, b2, **kw2)
    assert whole_path
    assert _shapes(got) == _shapes(want)
    callers = {t.untyped_storage().data_ptr() for t in _tensors(a2, b2, *kw2.values())}
    got_launch, want_launch = _described(cached), _described(kernel.calls[-1])
    assert got_launch[1] == want_launch[1], "scalars differ"
    assert len(got_launch[0]) == len(want_launch[0])
    for g, w in zip(got_launch[0], want_launch[0]):
        if w[3] in callers:  # the caller's tensor or a view of one: the very same view
            assert g == w
        else:  # allocated for the call: a new tensor of the same shape, strides and dtype
            assert g[3] not in callers and g[:3] == w[:3]


@pytest.mark.parametrize("batched", [False, True])
def test_a_plain_prepared_call_hands_the_kernel_the_callers_own_tensors(kernel, batched):
    lead = (L,) if batched else ()
    prepared = epicute.prepare_gemm(rand(*lead, M, K), rand(*lead, N, K).transpose(-1, -2))
    a, b = rand(*lead, M, K, offset=8), rand(*lead, N, K).transpose(-1, -2)
    d = prepared(a, b)
    (ka, kb, kd, *rest), scalars = kernel.calls[-1]
    assert ka is a and kb is b and kd is d and not rest and scalars == ()
    assert d.shape == (*lead, M, N) and d.dtype == torch.bfloat16
    out = torch.empty(*lead, M, N, dtype=torch.bfloat16)
    into = epicute.prepare_gemm(a, b, out=out)
    assert into(a, b, out=out) is out and kernel.calls[-1][0][2] is out


@pytest.mark.parametrize("fused", [False, True])
def test_gemm_repeats_calls_through_the_prepared_object(kernel, monkeypatch, fused):
    a, b = rand(M, K), rand(K, N)
    kw = {"epilogue": lambda acc, bias: acc + bias, "bias": rand(N)} if fused else {}
    prepared = epicute.prepare_gemm(a, b, **kw)
    assert any(p is prepared for p in api_module._PREPARED_CALLS.values())
    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    epicute.gemm(rand(M, K, offset=16), b, **kw)
    assert not whole_path, "epicute.gemm took the whole path after prepare_gemm"
    assert all(isinstance(p, epicute.PreparedGemmCall) for p in api_module._PREPARED_CALLS.values())


def _mismatches():
    """(prepared for, arguments, keywords, error, message) of calls a prepared call refuses, by name
    (:data:`MISMATCHES`)."""
    a, b, bias = rand(M, K), rand(N, K).t(), rand(N)
    plain = epicute.prepare_gemm(a, b)
    fused = epicute.prepare_gemm(a, b, epilogue=lambda acc, bias, alpha: acc * alpha + bias, bias=bias, alpha=0.5)
    out = rand(M, N)
    into = epicute.prepare_gemm(a, b, out=out)
    buf = rand(M * K + M * N)
    a_over, out_over = buf[: M * K].view(M, K), buf[: M * N].view(M, N)
    fp8 = rand(M, K, dtype=E4), rand(N, K, dtype=E4).t()
    one = torch.rand(())
    scaled = epicute.prepare_gemm(*fp8, a_scale=one, b_scale=one)
    return {
        "shape": (plain, (rand(M + 8, K), b), {}, SignatureError,
                  rf"a has shape \({M + 8}, {K}\); this call was prepared for \({M}, {K}\)"),
        "layout": (plain, (a, rand(K, N)), {}, SignatureError, r"b has strides \(\d+, 1\); .* prepared for \(1, \d+\)"),
        "dtype": (plain, (a, b.to(torch.float16)), {}, SignatureError,
                  "b has dtype torch.float16; this call was prepared for torch.bfloat16"),
        "misaligned": (plain, (rand(M, K, offset=1), b), {}, AlignmentError,
                       r"a.data_ptr\(\) is 2 bytes past a 16-byte boundary"),
        "not a tensor": (plain, (a.tolist(), b), {}, SignatureError, "a is a list"),
        "out not prepared": (plain, (a, b), {"out": out}, SignatureError,
                             "out is a torch.bfloat16 tensor of shape .*; this call was prepared with not given"),
        "out missing": (into, (a, b), {}, SignatureError, "out is not given; this call was prepared with a"),
        "out overlaps a": (into, (a_over, b), {"out": out_over}, OutputError, "out shares memory with a"),
        "operand not prepared": (plain, (a, b), {"bias": bias}, SignatureError, r"operands \['bias'\]"),
        "operand missing": (fused, (a, b), {"alpha": 0.5}, SignatureError,
                            r"operands \['alpha'\]: this call was prepared for \['alpha', 'bias'\]"),
        "operand kind": (fused, (a, b), {"bias": bias, "alpha": torch.tensor(0.5)}, SignatureError,
                         r"alpha is a torch.float32 tensor of shape \(\); this call was prepared with a float"),
        "operand shape": (fused, (a, b), {"bias": rand(L, N), "alpha": 0.5}, SignatureError,
                          rf"bias has shape \({L}, {N}\); this call was prepared for \({N},\)"),
        "operand pinned": (fused, (a, b), {"bias": epicute.RowVector(bias), "alpha": 0.5}, SignatureError,
                           r"bias is RowVector\(a torch.bfloat16 tensor of shape \(144,\)\)"),
        "one scale tensor, then two": (scaled, fp8, {"a_scale": one, "b_scale": torch.rand(())}, SignatureError,
                                       "a_scale and b_scale were one tensor when this call was prepared"),
    }  # fmt: skip


MISMATCHES = (
    "shape", "layout", "dtype", "misaligned", "not a tensor", "out not prepared", "out missing", "out overlaps a",
    "operand not prepared", "operand missing", "operand kind", "operand shape", "operand pinned",
    "one scale tensor, then two",
)  # fmt: skip


@pytest.mark.parametrize("name", MISMATCHES)
def test_a_mismatch_is_refused_before_any_launch(kernel, name):
    prepared, args, kw, error, message = _mismatches()[name]
    launched = len(kernel.calls)
    with pytest.raises(error, match=message):
        prepared(*args, **kw)
    assert len(kernel.calls) == launched


def test_a_launch_that_copies_runs_the_whole_path_every_call(kernel, monkeypatch):
    """A 2-D tile operand of a batched GEMM is copied over L per call: not recorded, so the prepared call checks
    its arguments, then goes the whole way."""
    a, b, c = rand(L, M, K), rand(L, K, N), rand(M, N)
    prepared = epicute.prepare_gemm(a, b, epilogue=lambda acc, C: acc + C, C=c)
    whole_path = []
    real_describe = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: whole_path.append(1) or real_describe(*args))
    d = prepared(a, b, C=rand(M, N, offset=8))
    assert whole_path and len(kernel.calls) == 1 and d.shape == (L, M, N)
    with pytest.raises(SignatureError, match="C has shape"):
        prepared(a, b, C=rand(L, M, N))
    assert len(kernel.calls) == 1
