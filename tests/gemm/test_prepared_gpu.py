"""The cached path of ``epicute.gemm`` on the GPU: repeat calls with new values are right.

Each case calls ``epicute.gemm`` three times with fresh random tensors (and scalars) of
one signature: the first records its launch, the others replay it. Every call's outputs
(NaN-poisoned where preallocated) are checked against ``backend="reference"`` on the
same inputs. Then one repeat is captured in a CUDA graph and replayed over new values
written into the captured inputs.
"""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.gemm import api as api_module
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

M, N, K = 203, 264, 328
E4 = torch.float8_e4m3fn


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda").to(dtype)


def bias_aux_reduction():
    def make():
        kw = {"bias": rand(N), "alpha": float(torch.rand(()) + 0.5)}
        return (rand(M, K), rand(N, K).t()), kw

    def epilogue(acc, bias, alpha):
        return {"D": ops.gelu(alpha * acc + bias), "pre": acc + bias, "rs": ops.row_sum(acc)}

    return make, epilogue, {"out_dtypes": {"pre": torch.float32}}


def fp8_rowwise():
    def make():
        a, w = rand(M, K - 8, dtype=E4), rand(N, K - 8, dtype=E4)
        return (a, w.t()), {"a_scale": torch.rand(M, 1, device="cuda"), "b_scale": torch.rand(1, N, device="cuda")}

    return make, None, {}


def fp8_blockwise():
    def make():
        a, w = rand(M, K - 8, dtype=E4), rand(N, K - 8, dtype=E4)
        kb, nb = -(-(K - 8) // 128), -(-N // 128)
        scales = {"a_scale": torch.rand(kb, M, device="cuda").t(), "b_scale": torch.rand(nb, kb, device="cuda")}
        return (a, w.t()), scales

    return make, None, {}


def zero_k_pass():
    """K = 0 with tile operands and a column sum: a backward's gradient pass, made anew every step (its zero
    operands are two empty tensors on one null pointer; the kernel reads cached zeros in their place)."""

    def make():
        a, b = torch.empty(M, 0, device="cuda", dtype=torch.bfloat16), torch.empty(0, N, device="cuda",
                                                                                   dtype=torch.bfloat16)
        return (a, b), {"saved": rand(M, N), "grad": rand(M, N)}

    def epilogue(acc, saved, grad):
        d = grad * ops.tanh(saved)
        return {"D": d, "d_bias": ops.col_sum(d)}

    return make, epilogue, {}


CASES = {"bias_aux_reduction": bias_aux_reduction, "fp8_rowwise": fp8_rowwise, "fp8_blockwise": fp8_blockwise,
         "zero_k_pass": zero_k_pass}  # fmt: skip


def _check(got, want) -> None:
    got = got if isinstance(got, dict) else {"D": got}
    want = want if isinstance(want, dict) else {"D": want}
    assert set(got) == set(want)
    for name in want:
        err = rel_err(got[name].float().cpu(), want[name].float().cpu())
        assert err < (1e-4 if got[name].dtype == torch.float32 else 1e-2), f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_repeat_calls_with_new_values_match_the_reference(name):
    make, epilogue, fixed = CASES[name]()
    extra = {"epilogue": epilogue} if epilogue is not None else {}
    for i in range(3):
        (a, b), kw = make()
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = epicute.gemm(a, b, out=out, **extra, **fixed, **kw)
        want = epicute.gemm(a, b, backend="reference", **extra, **fixed, **kw)
        _check(got, want)
        if i == 0:
            recorded = set(api_module._PREPARED_CALLS)
    assert len(recorded) >= 1 and recorded <= set(api_module._PREPARED_CALLS)


def _fp8_scaled_cases():
    """name -> make(): ``(a, b, a_scale, b_scale)`` of one signature, new random values each time."""

    def operands(*lead):
        return rand(*lead, M, K - 8, dtype=E4), rand(*lead, N, K - 8, dtype=E4).transpose(-1, -2)

    def tensorwise():
        return (*operands(), torch.rand((), device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5)

    def one_scale_for_both():
        s = torch.rand((), device="cuda") + 0.5
        return (*operands(), s, s)

    def rowwise():
        return (*operands(), torch.rand(M, 1, device="cuda"), torch.rand(1, N, device="cuda"))

    def rowwise_batched():
        return (*operands(2), torch.rand(2, M, device="cuda"), torch.rand(2, N, device="cuda"))

    def blockwise():
        kb, nb = -(-(K - 8) // 128), -(-N // 128)
        return (*operands(), torch.rand(kb, M, device="cuda").t(), torch.rand(nb, kb, device="cuda"))

    def misaligned_scale():  # a_scale 4 bytes past a 16-byte boundary: the generic cached path, still right
        return (*operands(), torch.rand(M + 1, device="cuda")[1:], torch.rand(N, device="cuda"))

    cases = (tensorwise, one_scale_for_both, rowwise, rowwise_batched, blockwise, misaligned_scale)
    return {case.__name__: case for case in cases}


@pytest.mark.parametrize("name", list(_fp8_scaled_cases()))
def test_fp8_calls_with_only_scales_repeat_through_the_short_key(name, monkeypatch):
    """An fp8 call with scale tensors and nothing else is keyed by A's, B's and the scales' layouts: repeats
    launch through :meth:`PreparedGemmCall.scaled` (aligned scales) with the scales' views rebuilt, and match
    the reference whatever the new values."""
    from epicute.gemm.prepared import PreparedGemmCall

    short = []
    real = PreparedGemmCall.scaled
    monkeypatch.setattr(PreparedGemmCall, "scaled", lambda self, *args: short.append(self) or real(self, *args))
    make = _fp8_scaled_cases()[name]
    for _ in range(3):
        a, b, sa, sb = make()
        got = epicute.gemm(a, b, a_scale=sa, b_scale=sb)
        _check(got, epicute.gemm(a, b, a_scale=sa, b_scale=sb, backend="reference"))
    if name == "misaligned_scale":
        assert not short
    else:
        assert len(short) == 2 and all(p._scaled_plan is not None for p in short)


def test_the_cached_path_captures_in_a_cuda_graph():
    make, epilogue, fixed = bias_aux_reduction()
    (a, b), kw = make()
    epicute.gemm(a, b, epilogue=epilogue, **fixed, **kw)  # records the launch (and compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = epicute.gemm(a, b, epilogue=epilogue, **fixed, **kw)
    for _ in range(2):
        (a2, b2), kw2 = make()
        a.copy_(a2)
        b.copy_(b2)
        kw["bias"].copy_(kw2["bias"])  # alpha stays what was captured: a scalar is a launch argument
        graph.replay()
        torch.cuda.synchronize()
        _check(captured, epicute.gemm(a, b, epilogue=epilogue, backend="reference", **fixed, **kw))


def _prepared_cases():
    """name -> make(): ``(a, b), call arguments, options`` of one signature, new random values each time."""

    def plain():
        return (rand(M, K), rand(N, K).t()), {}, {}

    def plain_into_out():  # D NaN-poisoned: a tile the kernel skipped would show
        return (rand(M, K), rand(N, K).t()), {"out": torch.full((M, N), float("nan"), device="cuda")}, {}

    def batched():
        return (rand(3, M, K, dtype=torch.float16), rand(3, K, N, dtype=torch.float16)), {}, {}

    def decode():  # few rows: the planner splits K, whose workspace the direct launch looks up per stream
        return (rand(7, 2056), rand(1032, 2056).t()), {}, {}

    def epilogue_into_out():
        kw = {"bias": rand(N), "residual": rand(M, N), "alpha": float(torch.rand(()) + 0.5),
              "out": torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)}  # fmt: skip
        return (
            (rand(M, K), rand(K, N)),
            kw,
            {"epilogue": lambda acc, bias, residual, alpha: ops.silu(alpha * acc + bias) + residual},
        )

    return {"plain": plain, "plain_into_out": plain_into_out, "batched": batched, "decode": decode,
            "epilogue_into_out": epilogue_into_out}  # fmt: skip


def _reference(a, b, options: dict, kw: dict):
    """``backend="reference"`` of a call, D in ``out``'s dtype where it has one."""
    kw = {k: v for k, v in kw.items() if k != "out"} | ({"out_dtype": kw["out"].dtype} if "out" in kw else {})
    return epicute.gemm(a, b, backend="reference", **options, **kw)


@pytest.mark.parametrize("name", list(_prepared_cases()))
def test_a_prepared_call_matches_gemm_and_the_reference(name):
    make = _prepared_cases()[name]
    (a, b), kw, options = make()
    prepared = epicute.prepare_gemm(a, b, **options, **kw)
    for _ in range(3):  # new values (and scalars) of the prepared signature
        (a, b), kw, _ = make()
        got = prepared(a, b, **kw)
        if "out" in kw:
            assert got is kw["out"]
            kw["out"] = torch.full_like(kw["out"], float("nan"))  # for gemm's own launch below
        _check(got, _reference(a, b, options, kw))
        assert torch.equal(got, epicute.gemm(a, b, **options, **kw)), "the prepared call and epicute.gemm differ"


@pytest.mark.parametrize("name", ["plain", "decode", "epilogue_into_out"])
def test_a_prepared_call_captures_in_a_cuda_graph(name):
    make = _prepared_cases()[name]
    (a, b), kw, options = make()
    prepared = epicute.prepare_gemm(a, b, **options, **kw)
    prepared(a, b, **kw)  # warm: nothing is loaded or allocated once for all during capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prepared(a, b, **kw)
    for _ in range(2):
        (a2, b2), kw2, _ = make()
        a.copy_(a2)
        b.copy_(b2)
        for operand in ("bias", "residual"):  # alpha stays what was captured: a scalar is a launch argument
            if operand in kw:
                kw[operand].copy_(kw2[operand])
        graph.replay()
        torch.cuda.synchronize()
        _check(captured, _reference(a, b, options, kw))


def test_a_prepared_call_refuses_a_tensor_on_another_device_before_launching():
    a, b = rand(M, K), rand(N, K).t()
    prepared = epicute.prepare_gemm(a, b)
    with pytest.raises(epicute.SignatureError, match="a is on cpu; this call was prepared on cuda:0"):
        prepared(a.cpu(), b)
    with pytest.raises(epicute.SignatureError, match=r"b has shape \(328, 136\)"):
        prepared(a, b[:, :136])


def test_a_zero_k_pass_repeats_without_planning(monkeypatch):
    """A backward's gradient pass (K = 0) is made anew every training step: its repeats take the cached path
    (no describe_call, no planning), with the cached zeros standing in for its empty A and B."""
    described = []
    real = api_module.describe_call
    monkeypatch.setattr(api_module, "describe_call", lambda *args: described.append(args[9]) or real(*args))
    make, epilogue, _ = zero_k_pass()
    for _ in range(3):
        (a, b), kw = make()
        _check(epicute.gemm(a, b, epilogue=epilogue, **kw), epicute.gemm(a, b, epilogue=epilogue, backend="reference",
                                                                          **kw))  # fmt: skip
    assert described.count(True) <= 1  # the kernel backend's calls: only the first (none if recorded earlier)
