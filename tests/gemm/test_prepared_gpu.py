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


CASES = {"bias_aux_reduction": bias_aux_reduction, "fp8_rowwise": fp8_rowwise, "fp8_blockwise": fp8_blockwise}


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
