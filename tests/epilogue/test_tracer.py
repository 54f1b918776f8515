"""Tracing epilogue functions into graphs: nodes, kinds, dtypes, outputs, and every tracing error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue.graph import Graph
from epicute.epilogue.tracer import Epilogue, as_epilogue
from epicute.errors import EpilogueError

FFN_KINDS = {"bias": "row", "residual": "tile", "alpha": "scalar"}


@epicute.epilogue
def ffn_out(acc, bias, residual, alpha):
    return {"D": epicute.ops.gelu(alpha * acc + bias) + residual}


def ops_of(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_ffn_out_traces_to_the_expected_graph():
    graph = ffn_out.trace(FFN_KINDS, {"bias": "bf16", "residual": "bf16"}, d_dtype=torch.bfloat16)
    assert str(graph) == "\n".join([
        "%0 = acc() : tile fp32",
        "%1 = input(name='bias') : row bf16",
        "%2 = input(name='residual') : tile bf16",
        "%3 = input(name='alpha') : scalar fp32",
        "%4 = mul(%3, %0) : tile fp32",
        "%5 = add(%4, %1) : tile fp32",
        "%6 = gelu_erf(%5) : tile fp32",
        "%7 = add(%6, %2) : tile fp32",
        "output D = %7",
    ])  # fmt: skip
    assert graph.inputs == (("bias", 1), ("residual", 2), ("alpha", 3))
    assert graph.output_dtypes == (("D", "bf16"),)
    assert graph.output_node("D").op == "add" and graph.input_node("alpha").kind == "scalar"


def test_epilogue_object_keeps_fn_name_params_and_doc():
    def scaled(acc, alpha):
        """Scale the product."""
        return alpha * acc

    epi = epicute.epilogue(scaled)
    assert isinstance(epi, Epilogue) and epi.fn is scaled
    assert epi.name == "scaled" and epi.params == ("alpha",) and epi.__doc__ == "Scale the product."
    assert epicute.epilogue(epi) is epi and as_epilogue(epi) is epi
    assert repr(epi) == "<epilogue scaled(acc, alpha)>"


def test_plain_function_and_bare_return_mean_D():
    graph = as_epilogue(lambda acc: ops.relu(acc)).trace({})
    assert ops_of(graph) == ["acc", "relu"] and graph.outputs == (("D", 1),)


def test_scalar_operands_are_inputs_and_numbers_are_consts():
    shift = 0.25

    def f(acc, alpha):
        return alpha * acc + 2.5 - shift

    graph = as_epilogue(f).trace({"alpha": "scalar"})
    assert graph.input_node("alpha").op == "input"
    consts = [n.attr("value") for n in graph.nodes if n.op == "const"]
    assert consts == [2.5, 0.25]
    assert all(n.kind == "scalar" and n.dtype == "fp32" for n in graph.nodes if n.op == "const")


def test_reflected_operators_put_the_number_first():
    graph = as_epilogue(lambda acc: (2 - acc) * (1 / acc) + (3 * -abs(acc))).trace({})
    by_op = {n.op: n for n in graph.nodes}
    assert graph.node(by_op["sub"].args[0]).attr("value") == 2.0 and by_op["sub"].args[1] == 0
    assert graph.node(by_op["div"].args[0]).attr("value") == 1.0
    assert {"neg", "abs", "mul", "add"} <= set(by_op)


def test_numpy_scalars_are_constants_too():
    np = pytest.importorskip("numpy")
    graph = as_epilogue(lambda acc: np.float32(0.5) * acc).trace({})
    assert ops_of(graph) == ["acc", "const", "mul"] and graph.node(1).attr("value") == 0.5


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("scalar", "scalar"), "scalar"), (("row", "scalar"), "row"), (("col", "col"), "col"),
        (("row", "col"), "tile"), (("tile", "row"), "tile"), (("col", "tile"), "tile"),
    ],
)  # fmt: skip
def test_elementwise_kind_is_the_widest(kinds, expected):
    graph = as_epilogue(lambda acc, x, y: acc + ops.maximum(x, y)).trace({"x": kinds[0], "y": kinds[1]})
    assert next(n for n in graph.nodes if n.op == "maximum").kind == expected


def test_reductions_cast_quantize_and_comparisons_infer_kind_and_dtype():
    def f(acc, s):
        y = ops.cast(acc * s, torch.bfloat16)
        return {
            "D": ops.quantize(y, s, torch.float8_e5m2),
            "mask": acc > 0,
            "rs": ops.row_sum(y), "cs": ops.col_max(y), "m": ops.amax(acc),
        }  # fmt: skip

    graph = as_epilogue(f).trace({"s": "scalar"})
    kd = {name: (graph.output_node(name).kind, graph.output_node(name).dtype) for name, _ in graph.outputs}
    assert kd == {
        "D": ("tile", "fp8e5m2"), "mask": ("tile", "fp32"),
        "rs": ("col", "fp32"), "cs": ("row", "fp32"), "m": ("scalar", "fp32"),
    }  # fmt: skip
    cast = next(n for n in graph.nodes if n.op == "cast")
    assert cast.dtype == "bf16" and cast.attrs == (("dtype", "bf16"),)
    assert dict(graph.output_dtypes) == {"D": "fp8e5m2", "mask": "fp32", "rs": "fp32", "cs": "fp32", "m": "fp32"}


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"),
     (torch.float8_e4m3fn, "fp8e4m3"), (torch.float8_e5m2, "fp8e5m2")],
)  # fmt: skip
def test_cast_names_every_dtype(dtype, name):
    graph = as_epilogue(lambda acc: ops.cast(acc, dtype) * 2).trace({})
    assert next(n for n in graph.nodes if n.op == "cast").dtype == name


def test_op_names_and_attrs():
    def f(acc):
        return ops.gelu(acc, approximate="tanh") + ops.clamp(acc, hi=6) + ops.clamp(acc, lo=-1, hi=1)

    graph = as_epilogue(f).trace({})
    clamps = [n.attrs for n in graph.nodes if n.op == "clamp"]
    assert clamps == [(("hi", 6.0), ("lo", None)), (("hi", 1.0), ("lo", -1.0))]
    assert "gelu_tanh" in ops_of(graph)


def test_every_op_function_records_its_op():
    def f(acc, x):
        vals = [
            ops.neg(acc), ops.abs(acc), ops.minimum(acc, x), ops.maximum(acc, x), ops.fma(acc, x, 1.0),
            ops.exp(acc), ops.exp2(acc), ops.log(acc), ops.sqrt(acc), ops.rsqrt(acc), ops.tanh(acc),
            ops.sigmoid(acc), ops.relu(acc), ops.gelu(acc), ops.silu(acc), ops.softplus(acc),
            ops.lt(acc, x), ops.le(acc, x), ops.gt(acc, x), ops.ge(acc, x), ops.eq(acc, x), ops.ne(acc, x),
            ops.where(acc < x, acc, x),
        ]  # fmt: skip
        total = vals[0]
        for v in vals[1:]:
            total = total + v
        return total

    recorded = set(ops_of(as_epilogue(f).trace({"x": "row"})))
    expected = {"neg", "abs", "minimum", "maximum", "fma", "exp", "exp2", "log", "sqrt", "rsqrt", "tanh",
                "sigmoid", "relu", "gelu_erf", "silu", "softplus",
                "lt", "le", "gt", "ge", "eq", "ne", "where"}  # fmt: skip
    assert expected <= recorded


def test_identical_subexpressions_are_recorded_once_and_dead_code_dropped():
    def f(acc, alpha, unused):
        _ = ops.exp(acc) * 7.0  # never returned
        return (alpha * acc) + (alpha * acc) + (-0.0) + 0.0

    graph = as_epilogue(f).trace({"alpha": "scalar", "unused": "tile"})
    assert ops_of(graph).count("mul") == 1 and "exp" not in ops_of(graph)
    assert sorted(n.attr("value") for n in graph.nodes if n.op == "const") == [0.0, 0.0]  # -0.0 kept apart
    assert dict(graph.inputs).keys() == {"alpha", "unused"}
    assert [n.id for n in graph.nodes] == list(range(len(graph.nodes)))
    assert all(a < n.id for n in graph.nodes for a in n.args)


def test_epilogues_compose():
    @epicute.epilogue
    def inner(acc, bias):
        return ops.relu(acc + bias)

    graph = as_epilogue(lambda acc, bias, r: {"D": inner(acc, bias) + r}).trace({"bias": "row", "r": "tile"})
    assert ops_of(graph) == ["acc", "input", "input", "add", "relu", "add"]


def test_keyword_only_parameters_are_operands():
    def f(acc, *, gamma):
        return gamma * acc

    epi = as_epilogue(f)
    assert epi.params == ("gamma",)
    assert epi.trace({"gamma": "col"}).output_node("D").kind == "tile"


class TestOutputDtypes:
    def epi(self):
        return as_epilogue(
            lambda acc: {"D": acc * 2, "aux": acc + 1, "q": ops.quantize(acc, 1.0), "r": ops.row_max(acc)}
        )

    def test_defaults(self):
        graph = self.epi().trace({}, d_dtype=torch.float16)
        assert dict(graph.output_dtypes) == {"D": "fp16", "aux": "fp16", "q": "fp8e4m3", "r": "fp32"}

    def test_explicit_D_is_the_aux_default(self):
        graph = self.epi().trace({}, out_dtypes={"D": torch.bfloat16, "q": torch.float32}, d_dtype=torch.float16)
        assert dict(graph.output_dtypes) == {"D": "bf16", "aux": "bf16", "q": "fp32", "r": "fp32"}

    def test_unknown_output_is_an_error(self):
        with pytest.raises(EpilogueError, match=r"out_dtypes names \['nope'\]"):
            self.epi().trace({}, out_dtypes={"nope": torch.float32})

    def test_reduction_must_be_fp32(self):
        with pytest.raises(EpilogueError, match="reduction, which is always stored fp32"):
            self.epi().trace({}, out_dtypes={"r": torch.bfloat16})

    def test_unsupported_dtype(self):
        with pytest.raises(EpilogueError, match=r"out_dtypes\['D'\].*torch.float64"):
            self.epi().trace({}, out_dtypes={"D": torch.float64})


def _trace(fn, **kinds):
    return as_epilogue(fn).trace(kinds)


@pytest.mark.parametrize(
    ("fn", "kinds", "match"),
    [
        (lambda acc: acc if acc > 0 else -acc, {}, r"data-dependent Python control flow.*ops\.where"),
        (lambda acc: acc and acc, {}, "bool()"),
        (lambda acc: math.exp(acc), {}, r"float\(\)"),
        (lambda acc: max(acc, 0.0), {}, "bool()"),
        (lambda acc: ops.where(acc == 0, 1.0, acc), {}, r"ops\.eq"),
        (lambda acc: ops.where(acc != 0, 1.0, acc), {}, r"ops\.ne"),
        (lambda acc: torch.exp(acc), {}, "torch function 'exp'"),
        (lambda acc: acc + torch.ones(3), {}, "make it a parameter of the epilogue"),
        (lambda acc: torch.ones(3) * acc, {}, "pass tensors as operands"),
        (lambda acc: acc + "x", {}, "got str"),
        (lambda acc, b: ops.row_sum(b), {"b": "row"}, "row_sum: reduces a tile value.*row value"),
        (lambda acc: ops.amax(ops.row_sum(acc)), {}, "result of row_sum"),
        (lambda acc: {"D": acc - ops.row_max(acc)}, {}, "return it as an output instead"),
        (lambda acc: {"out": acc}, {}, "without 'D'"),
        (lambda acc, b: {"D": b * 2}, {"b": "col"}, "D is a col value; it must be a tile"),
        (lambda acc, b: {"D": acc, "s": b * 2}, {"b": "scalar"}, "output 's' is a scalar value"),
        (lambda acc: {"D": acc, "c": 1.0}, {}, "output 'c' is float"),
        (lambda acc: {"D": acc, "not valid": acc}, {}, "must be a Python identifier"),
        (lambda acc: ops.gelu(acc, approximate="fast"), {}, "approximate='fast'"),
        (lambda acc: ops.clamp(acc), {}, "give lo, hi or both"),
        (lambda acc: ops.clamp(acc, lo=acc), {}, r"ops\.maximum"),
        (lambda acc: ops.clamp(acc, lo=1, hi=-1), {}, "lo=1 > hi=-1"),
        (lambda acc: ops.quantize(acc, 1.0, torch.bfloat16), {}, "not an fp8 dtype"),
        (lambda acc: ops.cast(acc, torch.float64), {}, "cast: dtype torch.float64 is not supported"),
    ],
)  # fmt: skip
def test_tracing_errors(fn, kinds, match):
    with pytest.raises(EpilogueError, match=match):
        _trace(fn, **kinds)


def test_ops_outside_a_trace_and_escaped_values_are_errors():
    with pytest.raises(EpilogueError, match="while it is traced"):
        ops.exp(1.0)
    kept = []
    as_epilogue(lambda acc: kept.append(acc * 2) or acc * 2).trace({})
    with pytest.raises(EpilogueError, match="another trace"):
        as_epilogue(lambda acc: acc + kept[0]).trace({})
    with pytest.raises(EpilogueError, match="while it is traced"):
        kept[0] + 1


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda: None, "first parameter must be the accumulator"),
        (lambda *args: args[0], "first parameter must be the accumulator"),
        (lambda acc, *rest: acc, r"\*rest"),
        (lambda acc, **kw: acc, r"\*\*kw"),
        (42, "must be a function of the accumulator"),
    ],
)
def test_bad_epilogue_signatures(fn, match):
    with pytest.raises(EpilogueError, match=match):
        epicute.epilogue(fn)


@pytest.mark.parametrize(
    ("kinds", "dtypes", "match"),
    [
        ({"bias": "row", "residual": "tile"}, None, "takes operands"),
        ({**FFN_KINDS, "gamma": "scalar"}, None, "takes operands"),
        (FFN_KINDS, {"beta": "fp32"}, "takes operands"),
        ({**FFN_KINDS, "bias": "vector"}, None, "kind 'vector' is not one of"),
        (FFN_KINDS, {"bias": "int8"}, "operand 'bias': dtype 'int8' is not supported"),
    ],
)
def test_trace_checks_operand_kinds_and_dtypes(kinds, dtypes, match):
    with pytest.raises(EpilogueError, match=match):
        ffn_out.trace(kinds, dtypes)


def test_traced_values_show_their_node():
    seen = []
    as_epilogue(lambda acc, b: seen.append(acc + b) or acc).trace({"b": "col"})
    assert seen[0].kind == "tile" and seen[0].dtype == "fp32"
    assert repr(seen[0]) == "<traced %2 = add(%0, %1) : tile fp32>"


# --- Python the tracer has no op for (issue 56, item 6) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda acc: acc**2, r"\*\* on a traced epilogue value is not supported.*x \* x.*ops\.sqrt"),
        (lambda acc: 2**acc, r"\*\* on a traced epilogue value.*ops\.exp2\(y\)"),
        (lambda acc: acc // 2, r"// on a traced epilogue value is not supported"),
        (lambda acc: 7.0 // acc, r"// on a traced epilogue value"),
        (lambda acc: acc % 2, r"% on a traced epilogue value is not supported"),
        (lambda acc: divmod(acc, 2), r"divmod\(\) on a traced epilogue value"),
        (lambda acc: acc @ acc, r"@ on a traced epilogue value is not supported.*elementwise"),
        (lambda acc: round(acc), r"round\(\) on a traced epilogue value.*ops\.cast"),
        (lambda acc: acc[0], r"indexing a traced epilogue value is not supported"),
        (lambda acc: acc[:, 1:], r"indexing a traced epilogue value"),
        (lambda acc: (acc > 0) & (acc < 1), r"& on a traced epilogue value.*\(a > 0\) \* \(b < 1\)"),
        (lambda acc: (acc > 0) | (acc < 1), r"\| on a traced epilogue value.*ops\.maximum"),
        (lambda acc: ~(acc > 0), r"~ on a traced epilogue value.*1 - mask"),
        (lambda acc: acc << 1, r"<< on a traced epilogue value"),
        (lambda acc: acc.sum(), r"a traced epilogue value has no attribute 'sum'.*ops\.row_sum\(x\)"),
        (lambda acc: acc.exp(), r"no attribute 'exp'.*write ops\.exp\(x\)"),
        (lambda acc: acc.pow(2), r"no attribute 'pow'.*x \* x"),
        (lambda acc: acc * acc.shape[0], r"no attribute 'shape'.*Python numbers"),
        (lambda acc: acc.T, r"no attribute 'T'"),
        (lambda acc: acc.to(torch.bfloat16), r"no attribute 'to'.*ops\.cast\(x, dtype\)"),
        (lambda acc: np.exp(acc), r"numpy's exp can't run on a traced epilogue value.*ops\.exp\(x\)"),
        (lambda acc: np.sum(acc), r"numpy's add\.reduce can't run.*ops\.row_sum"),
        (lambda acc: np.float32(2.0) ** acc, r"numpy's power can't run"),
        (lambda acc: list(acc), r"iterating over \(or unpacking\) a traced epilogue value"),
        (lambda acc: len(acc), r"len\(\) of a traced epilogue value"),
        (lambda acc: acc(1), r"a traced epilogue value is not a function"),
        (lambda acc: complex(acc), r"complex\(\) needs the data"),
        (lambda acc: setattr(acc, "x", 1) or acc, r"can't be given attribute 'x'"),
        (lambda acc: acc * (1 / 0), r"epilogue '<lambda>' raised ZeroDivisionError while it was traced"),
        (lambda acc: undefined_name * acc, r"raised NameError while it was traced"),  # noqa: F821
    ],
)  # fmt: skip
def test_unsupported_python_is_an_epilogue_error_that_says_what_to_write(fn, match):
    with pytest.raises(EpilogueError, match=match):
        _trace(fn)


def test_unsupported_attributes_keep_attribute_error_semantics():
    """``hasattr`` and protocol lookups still work on traced values (the error is an AttributeError too), and
    numpy scalars still combine with them as numbers."""
    seen = {}

    def fn(acc):
        seen["hasattr"] = hasattr(acc, "sum"), hasattr(acc, "__array__")
        return np.float32(2.0) * acc + np.float64(1.0) - np.int64(3) * acc

    graph = _trace(fn)
    assert seen["hasattr"] == (False, False)
    assert [n.op for n in graph.nodes if n.op != "const"] == ["acc", "mul", "add", "mul", "sub"]
    with pytest.raises(AttributeError):
        _trace(lambda acc: acc.sum())
    with pytest.raises(TypeError):  # an op called wrongly stays a TypeError, and is an EpilogueError too
        _trace(lambda acc: ops.exp(acc, acc))


def test_score_mod_errors_name_the_score_mod():
    from epicute.epilogue.score_mod import score_mod

    with pytest.raises(EpilogueError, match=r"\*\* on a traced score_mod value") as info:
        score_mod(lambda s, b, h, q_idx, kv_idx: s**2).trace({})
    assert "epilogue" not in str(info.value)
    with pytest.raises(EpilogueError, match=r"torch function 'tanh' can't run on a traced score_mod value"):
        score_mod(lambda s, b, h, q_idx, kv_idx: torch.tanh(s)).trace({})
    with pytest.raises(EpilogueError, match=r"bool\(\) .* traced score_mod value, which does not exist while the "
                                            r"score_mod is traced"):  # fmt: skip
        score_mod(lambda s, b, h, q_idx, kv_idx: s if q_idx > kv_idx else -s).trace({})


# --- second pass of typed errors (issue 56) ---------------------------------------------------------------------


def _ref_gemm(epilogue, **operands):
    a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    return epicute.gemm(a, b, epilogue=epilogue, backend="reference", **operands)


@pytest.mark.parametrize("value", [10**400, torch.tensor(1j)], ids=["int-past-float", "complex-tensor"])
def test_a_scalar_operand_that_is_no_float_is_an_epilogue_error(value):
    # Before: OverflowError (an int past float's range) or TypeError (a complex item) from float().
    with pytest.raises(EpilogueError, match=r"^operand 'x' = .* is no float32 scalar"):
        _ref_gemm(lambda acc, x: acc * x, x=value)


def test_a_score_mod_passed_as_the_epilogue_is_refused():
    # Before: accepted (a ScoreMod is an Epilogue): its index parameters were traced as a GEMM's epilogue leaves.
    @epicute.score_mod
    def keep(score, b, h, q_idx, kv_idx):
        return score

    with pytest.raises(EpilogueError, match=r"is a score_mod \(epicute.score_mod\), not an epilogue: pass it as "
                                            r"score_mod="):  # fmt: skip
        _ref_gemm(keep)
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(EpilogueError, match=r"is a score_mod"):
        epicute.attention(q, q, q, epilogue=keep, backend="reference")
    assert epicute.attention(q, q, q, score_mod=keep, backend="reference").shape == q.shape


@pytest.mark.parametrize("bounds", [(math.nan, 1.0), (None, math.nan)])
def test_clamp_refuses_nan_bounds(bounds):
    # Before: accepted; torch.clamp (the reference) gives NaN, the kernel's max/min the other operand.
    lo, hi = bounds
    with pytest.raises(EpilogueError, match=rf"^clamp: {'lo' if lo != lo else 'hi'}=nan"):
        _ref_gemm(lambda acc: ops.clamp(acc, lo, hi))


@pytest.mark.parametrize(
    ("call", "name"),
    [(lambda: ops.quantize_groups(torch.ones(3)), "quantize_groups"), (lambda: ops.gelu(torch.ones(3)), "gelu"),
     (lambda: ops.gelu(torch.ones(3), approximate="tanh"), "gelu"), (lambda: ops.row_sum(torch.ones(3)), "row_sum")],
)  # fmt: skip
def test_ops_outside_a_trace_name_the_function_called(call, name):
    # Before: the IR op's name (group_quant, gelu_erf), which the user never wrote.
    with pytest.raises(EpilogueError, match=rf"^epicute.ops.{name}: works on the traced values"):
        call()
