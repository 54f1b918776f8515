"""``torch.ops.epicute.grouped_gemm`` and ``torch.compile`` through :func:`epicute.grouped_gemm`, on meta tensors
(the op's fake implementation: shapes and dtypes with no GPU; the GPU test runs it for real)."""

from __future__ import annotations

import pytest
import torch

import epicute
from epicute import ops
from epicute.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def swiglu(gate, up, score):
    return ops.silu(gate) * up * score


def f_plain(x, w, offs):
    return epicute.grouped_gemm(x, w.transpose(-2, -1), offs, out_dtype=torch.float32) * 2


def f_gated_gathered(x, w13, offs, index, score):
    return epicute.grouped_gemm(x, w13.transpose(-2, -1), offs, gated=True, epilogue=swiglu, score=score,
                                a_index=index)  # fmt: skip


def f_aux(x, w, offs, bias):
    out = epicute.grouped_gemm(x, w.transpose(-2, -1), offs, epilogue=lambda acc, bias: {"D": acc + bias, "pre": acc},
                               bias=bias, out_dtypes={"pre": torch.float32})  # fmt: skip
    return out["D"].float() + out["pre"]


def f_wgrad(x, dy, offs):
    return epicute.grouped_gemm(x.t(), dy, offs)


def f_fp8(x8, w8, offs, sa, sb):
    return epicute.grouped_gemm(x8, w8.transpose(-2, -1), offs, a_scale=sa, b_scale=sb)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_traces_through_grouped_gemm_on_meta(backend):
    torch._dynamo.reset()
    compile_ = lambda f: torch.compile(f, fullgraph=True, backend=backend)
    offs = meta(8, dtype=torch.int32)
    d = compile_(f_plain)(meta(300, 64), meta(8, 136, 64), offs)
    assert d.shape == (300, 136) and d.dtype == torch.float32
    h = compile_(f_gated_gathered)(meta(100, 64), meta(8, 272, 64), offs, meta(300, dtype=torch.int32),
                                   meta(300, 1, dtype=torch.float32))  # fmt: skip
    assert h.shape == (300, 136) and h.dtype == torch.bfloat16
    s = compile_(f_aux)(meta(300, 64), meta(8, 136, 64), offs, meta(8, 136))
    assert s.shape == (300, 136) and s.dtype == torch.float32
    dw = compile_(f_wgrad)(meta(300, 64), meta(300, 136), offs)
    assert dw.shape == (8, 64, 136) and dw.dtype == torch.bfloat16
    y = compile_(f_fp8)(meta(300, 256, dtype=torch.float8_e4m3fn), meta(8, 256, 256, dtype=torch.float8_e4m3fn),
                        offs, meta(300, 2, dtype=torch.float32), meta(8, 2, 2, dtype=torch.float32))  # fmt: skip
    assert y.shape == (300, 256) and y.dtype == torch.bfloat16


def test_dense_gated_gemm_compiles_on_meta():
    torch._dynamo.reset()

    def f(x, w13, score):
        return epicute.gemm(x, w13.t(), gated=True, epilogue=swiglu, score=score)

    h = torch.compile(f, fullgraph=True, backend="eager")(meta(17, 64), meta(272, 64), meta(17, 1, dtype=torch.float32))
    assert h.shape == (17, 136) and h.dtype == torch.bfloat16


def test_compiled_grouped_refusals():
    torch._dynamo.reset()
    offs = meta(2, dtype=torch.int32)

    def checked(x, w, offs):
        return epicute.grouped_gemm(x, w.transpose(-2, -1), offs, check_offsets=True)

    with pytest.raises(Exception, match="check_offsets"):
        torch.compile(checked, fullgraph=True, backend="eager")(meta(10, 64), meta(2, 136, 64), offs)

    def reference(x, w, offs):
        return epicute.grouped_gemm(x, w.transpose(-2, -1), offs, backend="reference")

    with pytest.raises(Exception, match="backend='kernel'"):
        torch.compile(reference, fullgraph=True, backend="eager")(meta(10, 64), meta(2, 136, 64), offs)
    assert issubclass(ConfigError, epicute.EpicuteError)


def test_opcheck_on_meta_tensors():
    from epicute.runtime.torch_ops import register_epilogue

    key = register_epilogue(lambda acc, bias: acc + bias)
    spec = ('{"config": {}, "gated": false, "out_dtype": null, "out_dtypes": {}, "pins": {}, "scalars": [], '
            '"tensors": ["a_index", "bias"]}')  # fmt: skip
    args = (meta(50, 64), meta(3, 64, 136), meta(3, dtype=torch.int32), [meta(70, dtype=torch.int32), meta(3, 136)],
            [], key, spec)  # fmt: skip
    torch.library.opcheck(torch.ops.epicute.grouped_gemm.default, args, test_utils=("test_schema",))
    (d,) = torch.ops.epicute.grouped_gemm(*args)
    assert d.shape == (70, 136) and d.device.type == "meta"


def test_compiled_grouped_reductions_have_their_shapes_on_meta():
    torch._dynamo.reset()

    def f(x, w, offs):
        out = epicute.grouped_gemm(x, w.transpose(-2, -1), offs, epilogue=lambda acc: {
            "D": acc, "rows": ops.row_sum(acc), "cols": ops.col_sum(acc), "peak": ops.amax(acc)})  # fmt: skip
        return out["rows"], out["cols"], out["peak"]

    rows, cols, peak = torch.compile(f, fullgraph=True, backend="eager")(meta(300, 64), meta(8, 136, 64),
                                                                         meta(8, dtype=torch.int32))  # fmt: skip
    assert rows.shape == (300,) and cols.shape == (8, 136) and peak.shape == (8,)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_grouped_calls_refuse_bad_configs_and_gradients_without_one(fullgraph):
    """A malformed config, and a gradient through a variable-K call (a weight gradient itself), are refused under
    torch.compile as in eager (fullgraph=True: dynamo's report carries the message)."""
    offs = meta(2, dtype=torch.int32)

    def pinned(x, w, offs):
        return epicute.grouped_gemm(x, w.transpose(-2, -1), offs, config={"tile_n": "128"})

    cases = [
        (pinned, (meta(10, 64), meta(2, 136, 64)), ConfigError, "GemmConfig.tile_n takes a positive int"),
        (f_wgrad, (meta(300, 64).requires_grad_(), meta(300, 136)), epicute.GradientError, "records no backward"),
    ]
    for fn, args, error, words in cases:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(fn, fullgraph=fullgraph, backend="eager")(*args, offs)
        assert isinstance(info.value, error) or words in str(info.value), info.value


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_grouped_training_step_on_meta(dynamic):
    """The op's registered backward under torch.compile(fullgraph=True): on "meta" tensors the whole step runs (the
    op's meta kernel is its fake), gathered rows and a gated epilogue with a router weight included; every input
    that needs a gradient gets one of its own shape."""

    def step(x, w13, offs, index, score):
        h = epicute.grouped_gemm(x, w13.transpose(-2, -1), offs, a_index=index, gated=True, score=score,
                                 epilogue=lambda gate, up, score: epicute.ops.silu(gate) * up * score)  # fmt: skip
        return h.float().sum()

    torch._dynamo.reset()
    x, w13, score = meta(100, 512).requires_grad_(), meta(4, 272, 512).requires_grad_(), meta(300, 1).requires_grad_()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)(
        x, w13, meta(4, dtype=torch.int32), meta(300, dtype=torch.int32), score
    )
    loss.backward()
    for t in (x, w13, score):
        assert t.grad is not None and t.grad.shape == t.shape
