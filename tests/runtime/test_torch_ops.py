"""``epicute::gemm`` as a torch custom op: fake shapes, opcheck, torch.compile tracing (no GPU).

The op's real implementation launches kernels, so here it runs on meta tensors
(whose kernel is the fake implementation) and under FakeTensorMode; the GPU
tests run it for real, in CUDA graphs and compiled end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import epicute
from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.torch_ops import register_epilogue, registered_epilogue
from tests.conftest import recording_backend, subprocess_env

REPO = Path(__file__).resolve().parents[2]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def spec(tensors=(), scalars=(), pins=None, out_dtype=None, out_dtypes=None, config=None) -> str:
    return json.dumps(
        {"tensors": list(tensors), "scalars": list(scalars), "pins": pins or {}, "out_dtype": out_dtype,
         "out_dtypes": out_dtypes or {}, "config": config or {}},
        sort_keys=True,
    )  # fmt: skip


@epicute.epilogue
def bias_relu(acc, bias, alpha):
    return epicute.ops.relu(alpha * acc + bias)


CASES = [
    # (a, b, operands, scalars, epilogue, spec, expected [(shape, dtype)])
    ((meta(17, 72), meta(72, 136), [], [], None, spec()), [((17, 136), torch.bfloat16)]),
    ((meta(3, 17, 72), meta(3, 72, 136), [], [], None, spec(out_dtype="fp32")), [((3, 17, 136), torch.float32)]),
    (
        (meta(129, 64), meta(64, 1000), [meta(1000)], [0.5], bias_relu, spec(["bias"], ["alpha"])),
        [((129, 1000), torch.bfloat16)],
    ),
    (
        (meta(2, 33, 64), meta(2, 64, 40, dtype=torch.float16), [], [2.0], epicute.epilogues.tensor_quant,
         spec(scalars=["scale"], out_dtypes={"D": "fp8e4m3"})),
        [((2, 33, 40), torch.float8_e4m3fn), ((), torch.float32)],
    ),
]  # fmt: skip


def _args(case):
    a, b, operands, scalars, epi, text = case
    b = b.to(a.dtype)
    return (a, b, operands, scalars, register_epilogue(epi) if epi is not None else "", text)


@pytest.mark.parametrize("case, expected", CASES, ids=["2d", "batched-fp32", "bias-relu", "aux-amax"])
def test_fake_outputs_have_eager_shapes_dtypes_and_strides(case, expected):
    outs = torch.ops.epicute.gemm(*_args(case))
    assert [(tuple(o.shape), o.dtype) for o in outs] == expected
    assert all(o.is_contiguous() for o in outs)


@pytest.mark.parametrize("case", [c for c, _ in CASES[:3]], ids=["2d", "batched-fp32", "bias-relu"])
def test_opcheck_on_meta_tensors(case):
    torch.library.opcheck(torch.ops.epicute.gemm.default, _args(case))


def test_epilogue_keys_are_semantic_and_stable_across_processes():
    def make(shift):
        def shifted(acc, bias, alpha):
            return epicute.ops.relu(alpha * acc + bias + shift)

        return shifted

    # Two function objects that trace to one graph share a key; a captured constant is part of it.
    assert register_epilogue(make(1.0)) == register_epilogue(make(1.0))
    assert register_epilogue(make(2.0)) != register_epilogue(make(1.0))
    assert register_epilogue(bias_relu).startswith("bias_relu:")
    key = register_epilogue(epicute.epilogues.row_col_quant)
    assert registered_epilogue(key) is epicute.epilogues.row_col_quant
    code = (
        "import epicute; from epicute.runtime.torch_ops import register_epilogue as r; "
        "print(r(epicute.epilogues.row_col_quant))"
    )
    env = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.stdout.strip() == key, out.stderr
    with pytest.raises(EpilogueError, match="register_epilogue"):
        registered_epilogue("nobody:0")


def f_plain(a, b):
    return epicute.gemm(a, b, out_dtype=torch.float32) * 2


def f_fused(a, w, bias):
    return epicute.gemm(a, w.t(), epilogue=bias_relu, bias=bias, alpha=0.5) + 1


def f_aux(a, b):
    out = epicute.gemm(a, b, epilogue=epicute.epilogues.tensor_quant, scale=2.0, out_dtypes={"D": torch.float8_e4m3fn})
    return out["D"].float().sum() + out["amax"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_traces_through_gemm_on_meta(backend):
    torch._dynamo.reset()
    a, b, w, bias = meta(17, 64), meta(64, 136), meta(136, 64), meta(136)
    d = torch.compile(f_plain, fullgraph=True, backend=backend)(a, b)
    assert d.shape == (17, 136) and d.dtype == torch.float32
    y = torch.compile(f_fused, fullgraph=True, backend=backend)(a, w, bias)
    assert y.shape == (17, 136) and y.dtype == torch.bfloat16 and y.stride() == (136, 1)
    s = torch.compile(f_aux, fullgraph=True, backend=backend)(a, b)
    assert s.shape == () and s.dtype == torch.float32


def f_fp8(a, w, a_scale, b_scale, bias):
    return epicute.gemm(a, w.t(), a_scale=a_scale, b_scale=b_scale, epilogue=lambda acc, bias: acc + bias, bias=bias)


def f_fp8_plain(a, w, a_scale):
    return epicute.gemm(a, w.t(), a_scale=a_scale, b_scale=0.5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_traces_fp8_gemms_with_their_scales(backend):
    """The scales travel to the op as operands; its fake gives D in bf16 (fp8 inputs' default)."""
    torch._dynamo.reset()
    a, w = meta(17, 64, dtype=torch.float8_e4m3fn), meta(144, 64, dtype=torch.float8_e5m2)
    y = torch.compile(f_fp8, fullgraph=True, backend=backend)(a, w, meta(17, dtype=torch.float32),
                                                              meta(144, dtype=torch.float32), meta(144))  # fmt: skip
    assert y.shape == (17, 144) and y.dtype == torch.bfloat16
    y = torch.compile(f_fp8_plain, fullgraph=True, backend=backend)(a, w, meta((), dtype=torch.float32))
    assert y.shape == (17, 144) and y.dtype == torch.bfloat16


def test_torch_compile_under_fake_tensor_mode_records_one_op_per_call():
    backend, graphs = recording_backend()

    with FakeTensorMode():
        a = torch.empty(129, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(136, 64, dtype=torch.bfloat16, device="cuda")
        bias = torch.empty(136, dtype=torch.bfloat16, device="cuda")
        y = torch.compile(f_fused, fullgraph=True, backend=backend)(a, w, bias)
    assert y.shape == (129, 136) and y.device.type == "cuda"
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "epicute" in str(n.target)]
    assert len(calls) == 1
    # The epilogue is a string key in the graph, not a Python object.
    assert any(isinstance(arg, str) and arg.startswith("bias_relu:") for arg in calls[0].args)


def test_compiled_out_argument_is_written():
    torch._dynamo.reset()

    def f(a, b, out):
        return epicute.gemm(a, b, out=out)

    a, b, out = meta(17, 64), meta(64, 136), meta(17, 136, dtype=torch.float32)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b, out)
    assert got.shape == (17, 136) and got.dtype == torch.float32  # D computed in out's dtype, as in eager


def test_compiled_reference_backend_is_refused():
    torch._dynamo.reset()

    def f(a, b):
        return epicute.gemm(a, b, backend="reference")

    with pytest.raises(Exception) as info:
        torch.compile(f, fullgraph=True, backend="eager")(meta(8, 8), meta(8, 8))
    assert isinstance(info.value, ConfigError) or "backend='kernel'" in str(info.value)


def test_constant_result_marks_are_dynamos_own():
    """torch_ops marks its trace-time constants without importing dynamo; the mark must be the one
    ``torch._dynamo.assume_constant_result`` sets, or tracing would step into them."""
    from epicute.runtime import torch_ops

    def ours():
        return 0

    def dynamos():
        return 0

    torch_ops.assume_constant_result(ours)
    torch._dynamo.assume_constant_result(dynamos)
    assert ours.__dict__ == dynamos.__dict__ != {}
    assert all(f._dynamo_marked_constant for f in (torch_ops.register_traced, torch_ops.spec_text))


def _refused(exc: BaseException, error: type, words: str) -> bool:
    """Whether torch.compile's exception is ``error`` itself (a graph break ran the call eagerly) or dynamo's report
    of it (fullgraph=True: the message rides along)."""
    return isinstance(exc, error) or words in str(exc)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_training_calls_trace_forward_and_backward(dynamic):
    """Under torch.compile(fullgraph=True) a call whose inputs require grad traces into the op with its registered
    backward: on "meta" tensors the whole step runs (the op's meta kernel is its fake), and every input that needs
    a gradient gets one of its own shape and dtype; the saved accumulator (a "save" plan at K >= 256) stays out of
    the user's outputs."""

    def step(a, w, bias):
        d = epicute.gemm(a, w.t(), epilogue=lambda acc, bias: epicute.ops.gelu(acc + bias), bias=bias)
        return d.float().sum()

    torch._dynamo.reset()
    a, w, bias = meta(16, 512).requires_grad_(), meta(64, 512).requires_grad_(), meta(64).requires_grad_()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)(a, w, bias)
    loss.backward()
    for t in (a, w, bias):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_calls_refuse_gradients_through_what_has_none(fullgraph):
    """fp8 inputs and out= take no gradient: refused under torch.compile as in eager (epicute.GradientError naming
    the argument), before anything launches."""

    def into(a, b, out):
        return epicute.gemm(a, b, out=out)

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(into, fullgraph=fullgraph, backend="eager")(meta(16, 64).requires_grad_(), meta(64, 64),
                                                                  meta(16, 64))  # fmt: skip
    assert _refused(info.value, epicute.GradientError, "out=/outs= were given"), info.value
    torch._dynamo.reset()
    with torch.no_grad():  # inference traces as before
        d = torch.compile(into, fullgraph=fullgraph, backend="eager")(meta(16, 64).requires_grad_(), meta(64, 64),
                                                                      meta(16, 64))  # fmt: skip
    assert d.shape == (16, 64)


def test_compiled_calls_check_config_and_operand_names():
    torch._dynamo.reset()

    def pinned(a, b):
        return epicute.gemm(a, b, config={"tile_n": "128"})

    with pytest.raises(Exception) as info:
        torch.compile(pinned, fullgraph=True, backend="eager")(meta(16, 64), meta(64, 64))
    assert _refused(info.value, ConfigError, "GemmConfig.tile_n takes a positive int")

    def named_out(a, b, t):
        return epicute.gemm(a, b, epilogue=lambda acc, out: acc + out, out=t)

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(named_out, fullgraph=True, backend="eager")(meta(16, 64), meta(64, 64), meta(16, 64))
    assert _refused(info.value, EpilogueError, "epicute.gemm's own parameter out=")


def test_every_op_runs_its_cuda_kernel_straight_from_the_dispatcher():
    """Each family's op has a CUDA kernel of its own (not only custom_op's wrapped composite one, whose output
    aliasing check cost more host time than the launch), and keeps custom_op's autograd and meta kernels."""
    from epicute.runtime.torch_ops import define_ops

    ops = define_ops()
    assert {"epicute::gemm", "epicute::attention", "epicute::grouped_gemm"} <= set(ops)
    for name in ops:
        for key in ("CUDA", "AutogradCUDA", "Autograd", "Meta", "CompositeExplicitAutograd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


def test_a_call_recording_no_gradient_skips_the_custom_ops_autograd_kernel():
    """The CUDA autograd kernel runs the implementation itself only where autograd has nothing to do and nothing
    traces the op: plain tensors, none requiring grad unless grad mode is off, no dispatch mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from epicute.runtime.torch_ops import records_no_gradient

    a, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    assert records_no_gradient((a, a.t(), [a, a], [], 0.5, "key"))
    assert not records_no_gradient((a, w, [], [], "", ""))
    assert not records_no_gradient((a, a, [a, w], [1.0], "", ""))
    with torch.no_grad():
        assert records_no_gradient((a, w, [w], [], "", ""))
    assert not records_no_gradient((torch.nn.Parameter(torch.randn(2)), a))

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watching():
        assert not records_no_gradient((a, a))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(a)
    assert not records_no_gradient((fake, a))
