"""The op table: every consumer reads it, its two halves agree, and a new op is one entry.

``epicute.ops``, the graph's arities, the tracer's dtype rule, the CPU reference,
the planner's instruction estimates, the kernel emitter (every kernel's) and the
fuzzer all read :mod:`epicute.epilogue.optable`. The last tests declare an
op here (``square_plus_one``), register it, and take it through the whole
pipeline: trace, reference, schedule, hash, fuzzer, and an sm_90a compile.
"""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch

from epicute import ops
from epicute.epilogue import optable
from epicute.epilogue.graph import ELEMENTWISE, REDUCTIONS
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.optable import Domain, OpDef
from epicute.epilogue.reference import evaluate
from epicute.epilogue.schedule import OP_INSTRUCTIONS, schedule
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError
from tests.epilogue.conftest import randn

F32 = {"rtol": 2e-6, "atol": 1e-6}


def recorded(fn, n_args: int):
    """The node ``fn`` records as D on ``n_args`` traced tile values (acc, then tile operands)."""
    epi = as_epilogue({
        1: lambda acc: fn(acc), 2: lambda acc, t0: fn(acc, t0), 3: lambda acc, t0, t1: fn(acc, t0, t1),
    }[n_args])  # fmt: skip
    graph = epi.trace(dict.fromkeys(epi.params, "tile"))
    return graph.output_node("D")


def graph_of(program):
    """A fuzz program's graph (operand kinds and dtypes as the program declares them)."""
    from epicute.epilogue.dtypes import TORCH_TO_IR

    kinds = {o.name: o.kind for o in program.operands}
    dtypes = {o.name: "fp32" if o.dtype is None else TORCH_TO_IR[o.dtype] for o in program.operands}
    return as_epilogue(program.fn).trace(kinds, dtypes, program.out_dtypes(), d_dtype=program.d_dtype)


def sample_attrs(op: OpDef) -> dict:
    return op.domain.attrs(random.Random(0)) if op.domain.attrs else {}


# ------------------------------------------------------------ the public ops
@pytest.mark.parametrize("op", optable.BUILTIN, ids=lambda op: op.name)
def test_every_op_is_recorded_by_its_ops_function_or_operator(op):
    assert op.function_name is not None or op.operator is not None, f"{op.name}: no way to write it"
    attrs = sample_attrs(op)
    if op.function_name is not None:
        function = getattr(ops, op.function_name)
        node = recorded(lambda *xs: function(*xs, **dict(op.variant), **attrs), op.arity)
        assert node.op == op.name and dict(node.attrs) == attrs
    if op.operator is not None:
        spelled = op.operator.format(*(f"xs[{i}]" for i in range(op.arity)))
        node = recorded(lambda *xs: eval(spelled, {}, {"xs": xs}), op.arity)
        assert node.op == op.name
    dtype = attrs["dtype"] if op.rounds else "fp32"
    assert node.kind == "tile" and node.dtype == dtype


def test_every_ops_function_records_a_table_op_or_a_reduction():
    functions = {op.function_name for op in optable.all_ops()}
    for name in ops.__all__:
        # quantize_groups records the graph's two group ops (epicute.epilogue.group_quant)
        assert name in functions or name in REDUCTIONS or name == "quantize_groups", f"ops.{name} is neither"
    assert functions - {None} <= set(ops.__all__)


def test_generated_functions_keep_the_entries_signature_and_doc():
    for op in optable.BUILTIN:
        function = getattr(ops, op.function_name or "", None)
        if function is None or op.variant or op.attrs:
            continue  # operator-only ops, and the hand-written gelu, clamp, cast, quantize
        assert list(inspect.signature(function).parameters) == list(op.param_names)
        assert function.__doc__ == op.doc and function.__name__ == op.function_name


def test_ops_refuses_wrong_arguments():
    with pytest.raises(TypeError):
        as_epilogue(lambda acc: ops.exp(acc, acc)).trace({})
    with pytest.raises(EpilogueError, match="takes 1 argument"):
        as_epilogue(lambda acc: optable.call("exp", acc, acc)).trace({})
    with pytest.raises(EpilogueError, match="attributes"):
        as_epilogue(lambda acc: optable.call("clamp", acc, lo=0.0)).trace({})
    with pytest.raises(EpilogueError, match="unknown elementwise epilogue op 'nope'"):
        as_epilogue(lambda acc: optable.call("nope", acc)).trace({})


# ------------------------------------------------------------- the consumers
def test_graph_and_schedule_views_are_the_table():
    assert dict(ELEMENTWISE) == {op.name: op.arity for op in optable.all_ops()}
    assert dict(OP_INSTRUCTIONS) == {op.name: op.instructions for op in optable.all_ops()}
    # today's estimates, unchanged by the move into the table
    assert OP_INSTRUCTIONS["gelu_erf"] == 14 and OP_INSTRUCTIONS["softplus"] == 25 and OP_INSTRUCTIONS["div"] == 10


def test_entries_are_complete():
    for op in optable.BUILTIN:
        assert len(op.domain.args) == op.arity == len(op.param_names), op.name
        assert set(op.domain.args) <= set(optable.DOMAIN_KINDS), op.name
        assert isinstance(op.instructions, int) and op.instructions >= 1, op.name
        assert not op.rounds or "dtype" in op.attrs, op.name
        assert set(sample_attrs(op)) == set(op.attrs), op.name
    assert {op.name for op in optable.BUILTIN if op.rounds} == {"cast", "quantize"}


def domain_value(kind: str, gen: torch.Generator, shape=(3, 5, 7)) -> torch.Tensor:
    x = 3 * randn(gen, *shape)
    if kind in ("positive", "nonzero"):
        return x.abs() + 1.0
    if kind == "small":
        return x.clamp(-4.0, 4.0)
    if kind == "condition":
        return (x > 0).float() * torch.where(randn(gen, *shape) > 0, 1.0, x)
    return x


@pytest.mark.parametrize("op", optable.BUILTIN, ids=lambda op: op.name)
def test_emitter_on_torch_agrees_with_the_reference(gen, op):
    """The two halves of an entry: its kernel code (run on torch, ``TORCH_MATH``) and its reference."""
    args = [domain_value(kind, gen) for kind in op.domain.args]
    attrs = sample_attrs(op)
    emitted = torch.as_tensor(op.emit(optable.TORCH_MATH, *args, **attrs))
    torch.testing.assert_close(emitted.float(), op.reference(*args, **attrs).float(), rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------- a new op
def square_plus_one(emit=lambda m, x: x * x + m.const(1.0)) -> OpDef:
    return OpDef(
        "square_plus_one", 1, reference=lambda x: x * x + 1.0, emit=emit, instructions=2,
        domain=Domain(("any",), lambda x: x * x + 1.0), doc="``x * x + 1``.",
    )  # fmt: skip


def test_a_new_op_is_one_table_entry(gen):
    def epi(acc, bias):
        return {"D": ops.square_plus_one(acc + bias), "via_call": optable.call("square_plus_one", acc)}

    with optable.registered(square_plus_one()) as op:
        # trace: through the generated ops function and through optable.call
        graph = as_epilogue(epi).trace({"bias": "row"})
        assert [n.op for n in graph.nodes].count("square_plus_one") == 2
        assert graph.output_node("D").kind == "tile" and graph.output_node("D").dtype == "fp32"
        assert inspect.signature(ops.square_plus_one).parameters.keys() == {"x"}
        # the CPU reference, against float64 math
        acc, bias = 3 * randn(gen, 2, 5, 7), 3 * randn(gen, 7)
        specs = as_epilogue(epi).operands({"bias": bias}, 5, 7, 2)
        out = evaluate(graph, acc, specs)
        x = acc.double() + bias.double()
        torch.testing.assert_close(out["D"].double(), x * x + 1, **F32)
        torch.testing.assert_close(out["via_call"].double(), acc.double() ** 2 + 1, **F32)
        # the planner's view: arity, cost
        assert ELEMENTWISE["square_plus_one"] == 1 and OP_INSTRUCTIONS["square_plus_one"] == 2
        sched = schedule(graph)
        assert "square_plus_one" in next(s.detail for s in sched.stages if s.kind == "compute")
        # the semantic hash (the compile-cache key) covers the op's definition
        before = semantic_hash(graph)
    with optable.registered(square_plus_one(emit=lambda m, x: m.const(1.0) + x * x)):
        assert semantic_hash(as_epilogue(epi).trace({"bias": "row"})) != before
    # gone again: nothing else was touched
    assert optable.find(op.name) is None and "square_plus_one" not in ELEMENTWISE
    with pytest.raises(AttributeError, match="no op 'square_plus_one'"):
        ops.square_plus_one  # noqa: B018


def test_a_new_op_is_fuzzed():
    from tests.gemm import epilogue_fuzz as fuzz

    with optable.registered(square_plus_one()) as op:
        assert op in fuzz.fuzzed_ops()
        rng = random.Random(1)
        programs = [fuzz.random_program(rng.getrandbits(32)) for _ in range(60)]
        using = [p for p in programs if any(n.op == op.name for n in graph_of(p).nodes)]
        assert using and "ops.square_plus_one(" in using[0].source
        p = using[0]
        assert not fuzz.run_case(p, 7, device="cpu", backend="reference"), p.source


def test_registering_checks_the_entry():
    with pytest.raises(EpilogueError, match="already in the table"):
        optable.register(dataclasses.replace(square_plus_one(), name="exp"))
    for name in ("acc", "row_sum", "not an identifier"):
        with pytest.raises(EpilogueError, match="identifier and not a leaf or reduction"):
            optable.register(OpDef(name, 1, torch.neg, lambda m, x: -x, 1, Domain(("any",), lambda x: x)))
    with pytest.raises(EpilogueError, match="arity 2"):
        optable.register(OpDef("two", 2, torch.add, lambda m, a, b: a + b, 1, Domain(("any",), lambda x: x)))
    with pytest.raises(EpilogueError, match="domain kinds"):
        optable.register(OpDef("odd", 1, torch.neg, lambda m, x: -x, 1, Domain(("weird",), lambda x: x)))
    with pytest.raises(EpilogueError, match=r"epicute.ops.where is taken"):
        optable.register(OpDef("my_where", 1, torch.neg, lambda m, x: -x, 1, Domain(("any",), lambda x: x),
                               function="where"))  # fmt: skip
    with pytest.raises(EpilogueError, match="built in"):
        optable.unregister("exp")
    assert optable.find("two") is None and optable.find("odd") is None


def test_math_namespaces_provide_the_same_primitives():
    pytest.importorskip("cutlass")
    from epicute.sm90.epilogue_emit import DSL_MATH

    for name in optable.MATH_PRIMITIVES:
        assert callable(getattr(DSL_MATH, name)) and callable(getattr(optable.TORCH_MATH, name)), name


@pytest.mark.compile
def test_a_new_op_compiles_into_the_gemm_and_attention():
    from epicute.attention.launch import AttentionVariant, compile_attention
    from epicute.attention.plan import default_config
    from epicute.epilogue.fusion import EpilogueFusion, ScoreModFusion
    from epicute.epilogue.schedule import ATTENTION_SM90
    from epicute.epilogue.score_mod import score_mod
    from epicute.gemm import GemmProblem
    from epicute.gemm.compile import GemmVariant, compile_gemm
    from epicute.gemm.heuristics import choose_config

    with optable.registered(square_plus_one()):
        epi = as_epilogue(lambda acc, bias: ops.square_plus_one(acc + bias) * bias)
        graph = epi.trace({"bias": "row"}, {"bias": "bf16"}, {"D": torch.bfloat16}, d_dtype=torch.bfloat16)
        fusion = EpilogueFusion(graph, (("bias", "row", "bf16"),))
        cfg = choose_config(GemmProblem(4096, 4096, 4096), epilogue=fusion.buffers())
        assert callable(compile_gemm(GemmVariant(cfg, "bf16", "bf16", "k", "n", fusion=fusion)))
        # The same entry is attention's: in its output epilogue and its score_mod.
        out = as_epilogue(lambda o: ops.square_plus_one(o)).trace({}, d_dtype=torch.bfloat16)
        soft = score_mod(lambda s, b, h, q_idx, kv_idx: ops.square_plus_one(s)).trace({})
        variant = AttentionVariant(default_config(128, False), "bf16", False, ScoreModFusion(soft, ()),
                                   EpilogueFusion(out, (), style=ATTENTION_SM90))  # fmt: skip
        assert callable(compile_attention(variant))
