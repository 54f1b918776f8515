"""Emitting an epilogue graph as register code inside a kernel's epilogue.

:class:`EpilogueFusion` is the compile-time half (the graph and each operand's
kind and dtype: part of the kernel variant). At trace time the kernel calls
:meth:`EpilogueFusion.apply` once per accumulator element of a subtile, with the
element's global (m, n, l) coordinates; the graph's nodes become fp32 scalar
DSL ops, in topological order.

Operands reach the kernel as two tuples: ``tensors`` (row vectors ``(N, L)``,
column vectors ``(M, L)``, full tiles ``(M, N, L)``, in parameter order) and
``scalars`` (fp32, in parameter order). Loads clamp their coordinates into the
problem, so ragged edges read a valid element; the TMA store clips those lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from epicute.epilogue.graph import Graph
from epicute.epilogue.hashing import semantic_hash
from epicute.errors import EpilogueError

#: Epilogue value dtypes the kernel can load or round to.
DSL_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}

_SQRT1_2 = 0.7071067811865476
_GELU_TANH_C = 0.7978845608028654


@dataclass(frozen=True)
class EpilogueFusion:
    graph: Graph
    #: (name, kind, dtype) of each operand, in parameter order
    operands: tuple[tuple[str, str, str], ...]

    def __post_init__(self) -> None:
        outputs = dict(self.graph.outputs)
        if set(outputs) != {"D"}:
            extra = sorted(set(outputs) - {"D"})
            raise EpilogueError(
                f"epilogue outputs {extra}: the GEMM kernel emits only the main output 'D' so far; "
                "run aux outputs and reductions with backend='reference'"
            )
        if self.graph.node(outputs["D"]).kind != "tile":
            raise EpilogueError("output 'D' must be a full tile (depend on acc)")
        for node in self.graph.nodes:
            if node.op in ("quantize",) or node.op.endswith(("_sum", "_max", "_amax")) or node.op == "amax":
                raise EpilogueError(f"op {node.op!r} is not emitted by the GEMM kernel yet; use backend='reference'")
            if node.op == "cast" and node.attr("dtype") not in DSL_DTYPES:
                raise EpilogueError(f"cast to {node.attr('dtype')} is not emitted by the kernel yet")
        for name, kind, dtype in self.operands:
            if kind != "scalar" and dtype not in DSL_DTYPES:
                raise EpilogueError(f"operand {name!r} has dtype {dtype}; the kernel loads bf16, fp16 or fp32")

    @property
    def tensor_operands(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(op for op in self.operands if op[1] != "scalar")

    @property
    def scalar_operands(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(op for op in self.operands if op[1] == "scalar")

    def key(self) -> tuple:
        return (semantic_hash(self.graph), self.operands)

    # ------------------------------------------------------------ device side
    def apply(self, acc, m, n, l, extent_mn, tensors, scalars):
        """The D value of one element: ``acc`` and the operands at (m, n, l)."""
        g = self.graph
        slot = {name: i for i, (name, _, _) in enumerate(self.tensor_operands)}
        scalar_slot = {name: i for i, (name, _, _) in enumerate(self.scalar_operands)}
        m_in = cutlass.min(m, extent_mn[0] - 1)
        n_in = cutlass.min(n, extent_mn[1] - 1)
        values = {}
        for node in g.nodes:
            args = [values[a] for a in node.args]
            if node.op == "acc":
                v = acc
            elif node.op == "const":
                v = Float32(node.attr("value"))
            elif node.op == "input":
                name = node.attr("name")
                if node.kind == "scalar":
                    v = scalars[scalar_slot[name]]
                else:
                    t = tensors[slot[name]]
                    coord = {"row": (n_in, l), "col": (m_in, l), "tile": (m_in, n_in, l)}[node.kind]
                    v = t[coord].to(Float32)
            else:
                v = _emit_op(node.op, args, node)
            values[node.id] = v
        return values[dict(g.outputs)["D"]]


def _select(cond, a, b):
    return cutlass.select_(cond, a, b)


def _emit_op(op: str, args: list, node):
    """One elementwise op on fp32 scalars (the semantics of epicute.epilogue.reference)."""
    one, zero = Float32(1.0), Float32(0.0)
    math = cute.math
    if op == "add":
        return args[0] + args[1]
    if op == "sub":
        return args[0] - args[1]
    if op == "mul":
        return args[0] * args[1]
    if op == "div":
        return args[0] / args[1]
    if op == "neg":
        return -args[0]
    if op == "abs":
        return _select(args[0] < zero, -args[0], args[0])
    if op == "minimum":
        return cutlass.min(args[0], args[1])
    if op == "maximum":
        return cutlass.max(args[0], args[1])
    if op == "fma":
        return args[0] * args[1] + args[2]
    if op in ("exp", "exp2", "log", "sqrt", "rsqrt", "tanh"):
        return getattr(math, op)(args[0])
    if op == "sigmoid":
        return one / (one + math.exp(-args[0]))
    if op == "relu":
        return cutlass.max(args[0], zero)
    if op == "gelu_erf":
        x = args[0]
        return Float32(0.5) * x * (one + math.erf(x * Float32(_SQRT1_2)))
    if op == "gelu_tanh":
        x = args[0]
        return Float32(0.5) * x * (one + math.tanh(Float32(_GELU_TANH_C) * (x + Float32(0.044715) * x * x * x)))
    if op == "silu":
        return args[0] / (one + math.exp(-args[0]))
    if op == "softplus":
        # torch's threshold: above 20, softplus(x) == x in fp32.
        return _select(args[0] > Float32(20.0), args[0], math.log1p(math.exp(args[0])))
    if op == "clamp":
        x = args[0]
        lo, hi = node.attr("lo"), node.attr("hi")
        if hi is not None:
            x = cutlass.min(x, Float32(hi))
        if lo is not None:
            x = cutlass.max(x, Float32(lo))
        return x
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        a, b = args
        cond = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op]
        return _select(cond, one, zero)
    if op == "where":
        return _select(args[0] != zero, args[1], args[2])
    if op == "cast":
        return args[0].to(DSL_DTYPES[node.attr("dtype")]).to(Float32)
    raise EpilogueError(f"unknown epilogue op {op!r}")
