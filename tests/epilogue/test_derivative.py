"""Derivatives of traced graphs (epicute/epilogue/derivative.py) against torch's autograd of the reference.

Each derivative graph is evaluated by the CPU reference (the interpreter every epilogue is checked
against) and compared, element by element, with ``torch.autograd`` through the reference's own
evaluation of the original graph, computed in float64 on fresh random inputs (outputs stored in fp32,
as the reference stores them: so the two agree to fp32's rounding): score_mods attention training
needs (softcap, ALiBi, a masked one), every op of the table, a gated epilogue's two accumulators, and
random programs of the epilogue fuzzer.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import epicute
from epicute import ops
from epicute.epilogue import optable
from epicute.epilogue.derivative import derivative
from epicute.epilogue.reference import evaluate
from epicute.epilogue.tracer import as_epilogue
from epicute.errors import EpilogueError
from tests.gemm import epilogue_fuzz as fuzz

F64 = torch.float64
#: Both sides compute in float64; the derivative graph's constants are fp32 (as the kernel's are) and its output is
#: stored in fp32, the reference's largest dtype: a few fp32 roundings apart.
TOL = 1e-6


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| (an all-zero ``want``: ||got||); NaN anywhere gives inf."""
    got, want = got.double(), want.double()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("inf")
    scale = want.norm()
    return ((got - want).norm() / scale).item() if scale > 0 else got.norm().item()


@pytest.fixture(autouse=True)
def straight_through_roundings(monkeypatch):
    """The oracle's roundings pass gradients through unrounded, as the derivative rules do: torch's autograd of
    ``round_to(x).to(x.dtype)`` would round the gradient to the low-precision intermediate's dtype on its way."""
    for name in ("cast", "quantize"):
        op = optable.get(name)

        def straight(*args, _reference=op.reference, **attrs):
            exact = args[0] * args[1] if len(args) == 2 else args[0]
            return exact + (_reference(*args, **attrs) - exact).detach()

        monkeypatch.setitem(optable._OPS, name, dataclasses.replace(op, reference=straight))


def autograd_derivative(graph, acc, specs, wrt="acc", index_values=None, up=None):
    """d D / d wrt per element, by autograd through the reference's evaluation of ``graph``."""
    acc = acc.clone().requires_grad_(wrt == "acc")
    if up is not None:
        up = up.clone().requires_grad_(wrt == "acc_up")
    leaf = acc if wrt == "acc" else up if wrt == "acc_up" else None
    if leaf is None:
        spec = specs[wrt]
        leaf = spec.value.clone().to(F64).requires_grad_(True)
        specs = {**specs, wrt: type(spec)(**{**spec.__dict__, "value": leaf})}
    d = evaluate(
        graph, acc, specs, out_dtypes={"D": torch.float32}, compute_dtype=F64, index_values=index_values, up=up
    )["D"]
    if not d.requires_grad:  # D does not depend on wrt at all
        return torch.zeros(acc.shape, dtype=F64)
    (grad,) = torch.autograd.grad(d.expand(acc.shape).sum(), leaf, allow_unused=True, materialize_grads=True)
    return grad.expand(acc.shape)


def symbolic_derivative(graph, acc, specs, wrt="acc", index_values=None, up=None):
    d = evaluate(derivative(graph, wrt), acc, specs, out_dtypes={"D": torch.float32}, compute_dtype=F64,
                 index_values=index_values, up=up)["D"]  # fmt: skip
    return d.expand(acc.shape)


def attention_indices(m, n):
    return {
        "b": torch.zeros(1, 1, 1, dtype=F64),
        "h": torch.ones(1, 1, 1, dtype=F64),
        "q_idx": torch.arange(m, dtype=F64).view(1, m, 1),
        "kv_idx": torch.arange(n, dtype=F64).view(1, 1, n),
    }


SCORE_MODS = {
    "softcap": (lambda score, b, h, q_idx, kv_idx: 30.0 * ops.tanh(score / 30.0), {}),
    "alibi": (lambda score, b, h, q_idx, kv_idx, slope: score + slope * (kv_idx - q_idx), {"slope": 0.37}),
    "causal_softcap": (
        lambda score, b, h, q_idx, kv_idx: ops.where(kv_idx <= q_idx, 20.0 * ops.tanh(score / 20.0), -1e4),
        {},
    ),  # fmt: skip
    "scaled_square": (lambda score, b, h, q_idx, kv_idx, t: score * score * t + ops.sigmoid(score), {"t": 0.5}),
}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_derivatives_match_autograd(name):
    fn, operands = SCORE_MODS[name]
    mod = epicute.score_mod(fn)
    graph = mod.trace({p: "scalar" for p in mod.params}, {})
    m, n = 13, 17
    acc = torch.randn(1, m, n, dtype=F64) * 20
    specs = mod.operands(operands, m, n, 1)
    idx = attention_indices(m, n)
    want = autograd_derivative(graph, acc, specs, index_values=idx)
    got = symbolic_derivative(graph, acc, specs, index_values=idx)
    assert rel_err(got, want) < TOL


def _op_program(op: optable.OpDef):
    """``op`` on the accumulator and two operand tiles (whichever argument positions the op has)."""
    attrs = {"clamp": {"lo": -0.5, "hi": 0.7}, "cast": {"dtype": "bf16"}, "quantize": {"dtype": "fp8e4m3"}}.get(
        op.name, {}
    )

    def program(acc, u, v):
        args = (acc, u, v)[: op.arity]
        if op.name in ("log", "sqrt", "rsqrt"):
            args = (abs(acc) + 1.0,)
        if op.name == "div":
            args = (acc, abs(u) + 1.0)
        return optable.call(op.name, *args, **attrs)

    return program


@pytest.mark.parametrize("name", [op.name for op in optable.BUILTIN])
@pytest.mark.parametrize("wrt", ["acc", "u"])
def test_every_ops_rule_matches_autograd(name, wrt):
    op = optable.get(name)
    epi = as_epilogue(_op_program(op))
    graph = epi.trace({"u": "tile", "v": "tile"}, {})
    m, n = 11, 9
    gen = torch.Generator().manual_seed(random.getrandbits(31))
    acc = torch.randn(1, m, n, generator=gen, dtype=F64) * 2
    specs = epi.operands({"u": torch.randn(1, m, n, generator=gen), "v": torch.randn(1, m, n, generator=gen)}, m, n, 1)
    want = autograd_derivative(graph, acc, specs, wrt)
    got = symbolic_derivative(graph, acc, specs, wrt)
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL, name


def test_a_gated_epilogues_two_accumulators():
    epi = epicute.epilogue(lambda gate, up: ops.silu(gate) * up)
    from epicute.epilogue.gated import gated_epilogue

    gated = gated_epilogue(epi)
    graph = gated.trace({}, {})
    acc, up = torch.randn(1, 6, 8, dtype=F64), torch.randn(1, 6, 8, dtype=F64)
    for wrt in ("acc", "acc_up"):
        want = autograd_derivative(graph, acc, {}, wrt, up=up)
        assert rel_err(symbolic_derivative(graph, acc, {}, wrt, up=up), want) < TOL


@pytest.mark.parametrize("index", range(24))
def test_random_programs_derivatives_match_autograd(index):
    """The fuzzer's random epilogues (its ops, operand kinds and roundings): D's derivative by the accumulator."""
    seed = random.getrandbits(32)
    program = fuzz.random_program(seed)
    epi = as_epilogue(program.fn)
    kinds = {o.name: o.kind for o in program.operands if o.name in epi.params}
    m, n = 7, 10
    gen = torch.Generator().manual_seed(seed)
    shapes = {"row": (n,), "col": (m, 1), "tile": (m, n)}
    values = {p: 1.5 if kinds.get(p, "scalar") == "scalar" else torch.randn(shapes[kinds[p]], generator=gen)
              for p in epi.params}  # fmt: skip
    specs = epi.operands(values, m, n, 1)
    graph = epi.trace({p: s.kind for p, s in specs.items()}, {p: s.dtype for p, s in specs.items()})
    acc = torch.randn(1, m, n, generator=gen, dtype=F64)
    want = autograd_derivative(graph, acc, specs)
    got = symbolic_derivative(graph, acc, specs)
    assert rel_err(got, want) < TOL, (program.source, seed)


def test_derivative_errors_name_the_problem():
    epi = as_epilogue(lambda acc: {"D": acc, "s": ops.row_sum(acc)})
    graph = epi.trace({}, {})
    with pytest.raises(EpilogueError, match="wrt="):
        derivative(graph, wrt="bias")
    with pytest.raises(EpilogueError, match="no output 'E'"):
        derivative(graph, output="E")
    with pytest.raises(EpilogueError, match="reduction"):
        derivative(graph, output="s")


def test_an_op_without_a_rule_is_a_typed_error():
    square = optable.OpDef("square_no_rule", 1, lambda x: x * x, lambda m, x: x * x, 1,
                           optable.Domain(("any",), lambda x: x * x))  # fmt: skip
    with optable.registered(square):
        graph = as_epilogue(lambda acc: optable.call("square_no_rule", acc)).trace({}, {})
        with pytest.raises(EpilogueError, match="no derivative rule"):
            derivative(graph)


def _derivative_fusion():
    """The derivative of a softcap plus a tanh-GELU, as a GEMM epilogue of its own (its cap a scalar operand)."""
    from epicute.epilogue.fusion import EpilogueFusion

    epi = as_epilogue(lambda acc, cap: cap * ops.tanh(acc / cap) + ops.gelu(acc, approximate="tanh"))
    graph = epi.trace({"cap": "scalar"}, {})
    return graph, derivative(graph), EpilogueFusion(derivative(graph), (("cap", "scalar", "fp32"),))


def _derivative_variant(fusion):
    from epicute.gemm import GemmProblem, plan_gemm
    from epicute.gemm.compile import GemmVariant

    plan = plan_gemm(GemmProblem(1000, 512, 256, d_dtype="fp32"), "h100-sxm", tile_n=128)
    return GemmVariant(plan.config, "bf16", "fp32", "k", "n", fusion=fusion), plan


@pytest.mark.compile
def test_a_derivative_graph_compiles_as_an_epilogue_for_sm90a():
    """What a backward kernel does with a derivative: emit it like any epilogue (dead forward nodes pruned)."""
    from epicute.gemm.compile import compile_gemm

    _, graph, fusion = _derivative_fusion()
    computed = {node for stage in fusion.stages if stage.kind == "compute" for node in stage.nodes}
    assert computed and len(computed) < len(graph.nodes)  # the forward nodes the derivative does not need: pruned
    assert callable(compile_gemm(_derivative_variant(fusion)[0]))


@pytest.mark.gpu
def test_an_emitted_derivative_matches_autograd_on_the_gpu():
    """The derivative graph run as a GEMM's epilogue on the H100: d/dacc of the epilogue at acc = a @ b, against
    torch's autograd of the reference at the same accumulator (odd sizes, NaN-poisoned output)."""
    from epicute.gemm.compile import compile_gemm

    graph, _, fusion = _derivative_fusion()
    variant, plan = _derivative_variant(fusion)
    kernel = compile_gemm(variant)
    m, n, k = 1000, 520, 264  # N a multiple of 8: B and D rows 16-byte aligned for TMA
    a = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16) / 4
    d = torch.full((1, m, n), float("nan"), device="cuda")
    kernel(a, b, d, (), (7.5,), (), (), plan.max_active_clusters)
    acc = (a.double() @ b.double()).cpu()
    specs = as_epilogue(lambda acc, cap: acc).operands({"cap": 7.5}, m, n, 1)
    want = autograd_derivative(graph, acc, specs)
    assert rel_err(d.cpu(), want) < 1e-5
