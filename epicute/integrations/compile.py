"""torch.compile fusing into epicute, first part: a backend that lifts each linear layer, with the chain of
elementwise ops consuming it, into one :func:`epicute.gemm` whose epilogue is traced from those ops, and each
``F.scaled_dot_product_attention`` into :func:`epicute.attention`, then hands the graph to Inductor.

    compiled = torch.compile(model, backend=epicute.integrations.compile.backend)
    print(epicute.integrations.compile.last_report())   # what was lifted, what was left and why

The backend rewrites Dynamo's graph (torch-level calls, before AOTAutograd), so a lifted layer trains through the
epicute op's own autograd: its backward epilogue is derived from the lifted ops (:mod:`epicute.gemm.autograd`).
Everything else stays Inductor's. Lifted: ``F.linear`` and ``x @ w`` with a 2-D ``w`` (any leading dimensions, a
linear's bias too; bf16 or fp16, ``in`` and ``out`` multiples of 8) followed by single-use
``gelu``/``relu``/``silu``/``sigmoid``/``tanh`` and ``+ - * /`` with numbers, ``(out,)`` vectors, per-row
``(..., 1)`` columns or tensors of the output's shape, all in the layer's dtype; ``torch._grouped_mm(x, w, offs=offs)``
(what ``F.grouped_mm`` and transformers' grouped experts record) with the same chains, as one
:func:`epicute.grouped_gemm` (an MoE layer's SiLU and router weights ride in its epilogue). Every
candidate is lifted (no measurement against Inductor's own fusion yet), and its epilogue computes in fp32 without
the intermediate roundings to bf16 that the unfused ops make. Attention is lifted without a mask or dropout, bf16 or
fp16, head_dim 64, 128 or 256, any GQA ratio; causal only with as many queries as keys (torch aligns a causal mask
top-left, epicute bottom-right: they agree only there).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from epicute.epilogue import ops
from epicute.epilogue.operands import RowVector
from epicute.nn import functional as EF

#: torch callables (as Dynamo records them) -> the epicute op each becomes
FUNCTIONS: dict[Any, str] = {
    F.gelu: "gelu", torch.relu: "relu", F.relu: "relu", F.silu: "silu", torch.sigmoid: "sigmoid",
    torch.tanh: "tanh", operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul",
    operator.sub: "sub", torch.sub: "sub", operator.truediv: "div", torch.div: "div",
}  # fmt: skip
#: tensor methods -> the epicute op
METHODS = {"add": "add", "mul": "mul", "sub": "sub", "div": "div", "relu": "relu", "sigmoid": "sigmoid",
           "tanh": "tanh"}  # fmt: skip
#: epicute op -> how a lifted step applies it to traced values
APPLY: dict[str, Callable] = {
    **EF.ACTIVATIONS, "sigmoid": ops.sigmoid, "tanh": ops.tanh,
    "add": operator.add, "mul": operator.mul, "sub": operator.sub, "div": operator.truediv,
}  # fmt: skip
LIFTED_DTYPES = (torch.bfloat16, torch.float16)
#: the GEMM calls lifted: ``F.linear(x, w, b)`` (``w`` ``(out, in)``) and ``x @ w`` (``w`` ``(in, out)``)
GEMMS = (F.linear, operator.matmul, torch.matmul)


@dataclass
class Report:
    """One graph's rewrite: each linear node, lifted (with the ops its epilogue took) or left (and why)."""

    lifted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        def kernel(steps: tuple[str, ...]) -> str:
            if steps == ("attention",):
                return "attention"
            head, rest = ("grouped gemm", steps[1:]) if steps[:1] == ("grouped",) else ("linear", steps)
            return f"{head} -> {', '.join(rest) or '(no epilogue)'}"

        lines = [f"lifted {node}: {kernel(steps)}" for node, steps in self.lifted]
        lines += [f"left {node}: {why}" for node, why in self.left]
        return "\n".join(lines) or "no linear layers in the graph"


_REPORTS: list[Report] = []


def last_report() -> Report | None:
    """The report of the graph the backend compiled last (None before any)."""
    return _REPORTS[-1] if _REPORTS else None


def backend(gm: torch.fx.GraphModule, example_inputs: list, inner: str = "inductor") -> Callable:
    """A ``torch.compile`` backend: :func:`lift_linear_epilogues` on Dynamo's graph, then ``inner`` (Inductor, or
    ``"aot_eager"``: AOTAutograd without Inductor's code generation) compiles the result."""
    report = lift_linear_epilogues(gm)
    _REPORTS[:] = [*_REPORTS[-15:], report]
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


def lift_linear_epilogues(gm: torch.fx.GraphModule) -> Report:
    """Rewrite ``gm`` in place: every liftable linear node and its elementwise consumers become one call of
    :func:`lifted_gemm`, every liftable attention one call of :func:`lifted_attention`. Returns what was lifted and
    what was left."""
    report = Report()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            _lift_attention(gm, node, report)
            continue
        if node.op == "call_function" and node.target is torch._grouped_mm and node.graph is gm.graph:
            _lift_grouped(gm, node, report)
            continue
        if node.op != "call_function" or node.target not in GEMMS or node.graph is not gm.graph:
            continue
        linear = node.target is F.linear
        why = _why_not(node, linear)
        if why:
            report.left.append((node.name, why))
            continue
        x, weight, bias = (list(node.args) + [node.kwargs.get("bias") if linear else None])[:3]
        steps = _lift_chain(gm, node, lifted_gemm, (x, weight), {"linear": linear}, [bias] if bias is not None else [])
        report.lifted.append((node.name, steps))
    gm.graph.lint()
    gm.recompile()
    return report


def _lift_chain(gm: torch.fx.GraphModule, node: torch.fx.Node, fn: Callable, args: tuple, kwargs: dict,
                bias: list) -> tuple[str, ...]:  # fmt: skip
    """Replace the GEMM ``node`` and the elementwise chain consuming it (a ``bias`` first, as a row operand) by one
    call ``fn(*args, *operands, program=..., **kwargs)``; returns the chain's ops."""
    operands: list = list(bias)
    kinds: list[str] = ["row"] * len(bias)
    steps: list = [("add", (("acc",), ("operand", 0)))] if bias else []
    chain = [node]
    while (step := _next_step(chain[-1], _value(node), operands, kinds)) is not None:
        steps.append(step[0])
        chain.append(step[1])
    program = (tuple(steps), tuple(kinds))
    with gm.graph.inserting_before(chain[-1]):
        fused = gm.graph.call_function(fn, (*args, *operands), {"program": program, **kwargs})
    fused.meta.update(chain[-1].meta)
    chain[-1].replace_all_uses_with(fused)
    for dead in reversed(chain):
        gm.graph.erase_node(dead)
    return tuple(op for op, _ in steps)


#: torch._grouped_mm's keyword parameters, with their defaults
GROUPED_PARAMETERS = (("offs", None), ("bias", None), ("out_dtype", None))


def _lift_grouped(gm: torch.fx.GraphModule, node: torch.fx.Node, report: Report) -> None:
    """``torch._grouped_mm(x, w, offs=offs)`` (``F.grouped_mm`` records as it: an MoE layer's experts) and its
    elementwise consumers as one :func:`epicute.grouped_gemm` (:func:`lifted_grouped_gemm`)."""
    a, b = (_value(arg) if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    given = dict(zip((name for name, _ in GROUPED_PARAMETERS), node.args[2:])) | dict(node.kwargs)
    options = {name: given.get(name, default) for name, default in GROUPED_PARAMETERS}
    why = None
    if (
        not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or not isinstance(options["offs"], torch.fx.Node)
    ):
        why = "its inputs or offs are not traced tensors"
    elif a.dim() != 2 or b.dim() != 3:
        why = f"a {a.dim()}-D x {b.dim()}-D grouped_mm: epicute lifts (tokens, K) x (G, K, N) with offs"
    elif a.dtype not in LIFTED_DTYPES or b.dtype != a.dtype:
        why = f"dtypes {a.dtype} x {b.dtype}: epicute lifts bf16 or fp16 grouped GEMMs of one dtype"
    elif options["bias"] is not None or options["out_dtype"] not in (None, a.dtype):
        why = "a bias or another out_dtype"
    elif a.shape[-1] % 8 or b.shape[-1] % 8:  # symbolic sizes: a guard of the compiled graph
        why = f"K={a.shape[-1]}, N={b.shape[-1]}: both must be multiples of 8 (TMA's 16-byte rows)"
    elif a.stride(-1) != 1:
        why = f"x strides {tuple(a.stride())}: epicute's grouped GEMM reads row-major rows"
    if why:
        report.left.append((node.name, why))
        return
    steps = _lift_chain(gm, node, lifted_grouped_gemm, (*node.args[:2], options["offs"]), {}, [])
    report.lifted.append((node.name, ("grouped", *steps)))


def lifted_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *operands: torch.Tensor,
                        program: tuple):  # fmt: skip
    """``torch._grouped_mm(x, w, offs=offs)`` and the lifted ops as one :func:`epicute.grouped_gemm` (tiles
    ``(tokens, N)``, per-token columns ``(tokens, 1)``)."""
    from epicute.grouped.api import grouped_gemm

    values = {f"t{i}": t for i, t in enumerate(operands)}
    return grouped_gemm(x, w, offs, epilogue=lifted_epilogue(program), **values)


#: F.scaled_dot_product_attention's parameters after q, k, v, with their defaults
SDPA_PARAMETERS = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                   ("enable_gqa", False))  # fmt: skip


def _lift_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, report: Report) -> None:
    q, k, v = (_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args[:3])
    given = dict(zip((name for name, _ in SDPA_PARAMETERS), node.args[3:])) | dict(node.kwargs)
    options = {name: given.get(name, default) for name, default in SDPA_PARAMETERS}
    why = None
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        why = "q, k and v are not 4-D traced tensors"
    elif q.dtype not in LIFTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        why = f"dtype {q.dtype}: epicute's attention takes bf16 or fp16"
    elif options["attn_mask"] is not None or options["dropout_p"]:
        why = "an attn_mask or dropout: epicute's attention has neither"
    elif q.shape[-1] not in (64, 128, 256) or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        why = f"head_dim {q.shape[-1]}: epicute's attention takes 64, 128 or 256"
    elif q.shape[1] % k.shape[1]:
        why = f"{q.shape[1]} query heads over {k.shape[1]} key/value heads"
    elif options["is_causal"] and q.shape[2] != k.shape[2]:
        why = "causal with fewer queries than keys: torch aligns the mask top-left, epicute bottom-right"
    if why:
        report.left.append((node.name, why))
        return
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(lifted_attention, tuple(node.args[:3]),
                                       {"causal": bool(options["is_causal"]), "scale": options["scale"]})  # fmt: skip
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    report.lifted.append((node.name, ("attention",)))


def lifted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` (``(batch, heads, seqlen, dim)``)
    as :func:`epicute.attention` (``(batch, seqlen, heads, dim)``: transposed views both ways, no copies)."""
    from epicute.attention.api import attention

    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale)
    return out.transpose(1, 2)


def _value(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value")


def _why_not(node: torch.fx.Node, linear: bool) -> str | None:
    """Why this linear (or ``x @ w`` matmul) node is left to Inductor (None: it is lifted)."""
    x, weight = (_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args[:2])
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "its input or weight is not a traced tensor"
    if x.dtype not in LIFTED_DTYPES or weight.dtype != x.dtype:
        return f"dtypes {x.dtype} x {weight.dtype}: epicute lifts bf16 or fp16 GEMMs of one dtype"
    if weight.dim() != 2 or x.dim() < 2:
        return "a weight that is not 2-D, or a 1-D input"
    if weight.stride(-1) != 1 and weight.stride(-2) != 1:
        return f"weight strides {tuple(weight.stride())}: neither dimension is contiguous (TMA reads rows)"
    n, k = weight.shape if linear else reversed(weight.shape)
    if n % 8 or k % 8:  # symbolic sizes: a guard of the compiled graph (it recompiles where it fails)
        return f"weight {tuple(weight.shape)}: in and out must be multiples of 8 (TMA's 16-byte rows)"
    return None


def _next_step(last: torch.fx.Node, out: torch.Tensor, operands: list, kinds: list) -> tuple | None:
    """The chain's next elementwise op after ``last``, as ``((op, argument refs), node)``, registering its tensor
    operand; None where the chain ends (several users, an op epicute lacks, a dtype or shape change)."""
    users = list(last.users)
    if len(users) != 1:
        return None
    user = users[0]
    op = _op_of(user)
    value = _value(user)
    if op is None or not isinstance(value, torch.Tensor) or value.shape != out.shape or value.dtype != out.dtype:
        return None
    if op == "gelu":
        approximate = user.kwargs.get("approximate", "none")
        if approximate not in ("none", "tanh"):
            return None
        op = "gelu" if approximate == "none" else "gelu_tanh"
    if set(user.kwargs) - {"approximate"}:
        return None
    refs, added = [], []
    for arg in user.args:
        if arg is last:
            refs.append(("acc",))
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            refs.append(("const", float(arg)))
        elif isinstance(arg, torch.fx.Node) and isinstance(_value(arg), torch.Tensor):
            t = _value(arg)
            kind = ("tile" if t.shape == out.shape else "row" if tuple(t.shape) == (out.shape[-1],)
                    else "col" if tuple(t.shape) == (*out.shape[:-1], 1) else None)  # fmt: skip
            if kind is None or t.dtype not in (*LIFTED_DTYPES, torch.float32):
                return None
            refs.append(("operand", len(operands) + len(added)))
            added.append((arg, kind))
        else:
            return None
    if sum(ref == ("acc",) for ref in refs) != 1:
        return None
    for arg, kind in added:
        operands.append(arg)
        kinds.append(kind)
    return (op, tuple(refs)), user


def _op_of(node: torch.fx.Node) -> str | None:
    if node.op == "call_function":
        return FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return METHODS.get(node.target)
    return None


@functools.cache
def lifted_epilogue(program: tuple) -> Callable:
    """The epilogue of a lifted chain: ``f(acc, t0, t1, ...)`` applying its steps to the accumulator (one function
    per program, so its trace is remembered)."""
    steps, kinds = program

    def epilogue(acc, *operands):
        value = acc
        for op, refs in steps:
            args = [value if ref[0] == "acc" else operands[ref[1]] if ref[0] == "operand" else ref[1] for ref in refs]
            value = APPLY[op](*args)
        return value

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f"t{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(len(kinds))]
    epilogue.__signature__ = inspect.Signature(params)
    epilogue.__name__ = "lifted_" + "_".join(op for op, _ in steps) if steps else "lifted"
    return epilogue


def lifted_gemm(x: torch.Tensor, weight: torch.Tensor, *operands: torch.Tensor, program: tuple, linear: bool):
    """``F.linear(x, weight)`` (``linear``) or ``x @ weight`` and the lifted ops as one :func:`epicute.gemm` (what a
    rewritten graph calls), through :func:`epicute.nn.functional.linear`: row operands as ``RowVector``, tiles as
    ``(tokens, out)``."""
    _, kinds = program
    weight = weight if linear else weight.t()  # F.linear's (out, in)
    out = weight.shape[0]
    values = {f"t{i}": RowVector(t) if kind == "row" else t.reshape(-1, 1 if kind == "col" else out)
              for i, (t, kind) in enumerate(zip(operands, kinds))}  # fmt: skip
    return EF.linear(x, weight, epilogue=lifted_epilogue(program), **values)


__all__ = ["Report", "backend", "last_report", "lift_linear_epilogues", "lifted_attention", "lifted_gemm",
           "lifted_grouped_gemm"]  # fmt: skip
