"""Traced values, and the recorder that turns operations on them into graph nodes.

While an epilogue is traced, ``acc`` and its operands are :class:`Value` proxies.
Each operator or :mod:`epicute.ops` call on them appends one
:class:`~epicute.epilogue.graph.Node` to the active :class:`Recorder`, with its
kind and dtype inferred by the IR's rules, so the user's plain Python function
runs once and leaves the graph behind. Anything that would need a value's data
(``if``, ``bool()``, ``float()``, torch functions) raises an
:class:`~epicute.errors.EpilogueError` that says what to write instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

import torch

from epicute.epilogue import optable
from epicute.epilogue.graph import REDUCTIONS, Node
from epicute.epilogue.group_quant import GROUP_OPS
from epicute.errors import EpilogueError

_ACTIVE: ContextVar[Recorder | None] = ContextVar("epicute_epilogue_recorder", default=None)


def join_kinds(kinds: Sequence[str]) -> str:
    """The kind of an elementwise result: the widest argument; a row with a col gives a tile."""
    present = set(kinds)
    if "tile" in present or {"row", "col"} <= present:
        return "tile"
    return "row" if "row" in present else "col" if "col" in present else "scalar"


class Recorder:
    """The nodes of one trace, in creation (hence topological) order.

    Identical nodes are recorded once, so writing ``alpha * acc`` twice costs the
    kernel one multiply and does not change the graph's hash.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._memo: dict[tuple, int] = {}

    def add(
        self, op: str, args: tuple[int, ...] = (), kind: str = "tile", dtype: str = "fp32",
        attrs: tuple[tuple[str, Any], ...] = (),
    ) -> Value:  # fmt: skip
        # repr() keeps -0.0 apart from 0.0, which compare (and hash) equal.
        key = (op, args, kind, dtype, repr(attrs))
        node_id = self._memo.get(key)
        if node_id is None:
            node_id = self._memo[key] = len(self.nodes)
            self.nodes.append(Node(node_id, op, args, kind, dtype, attrs))
        return Value(self, node_id)

    def lift(self, x: Any, op: str) -> int:
        """The node id of an argument of ``op``: a traced value, or a Python number as a const."""
        if isinstance(x, Value):
            if x._rec is not self:
                raise EpilogueError(
                    f"{op}: got a traced value from another trace (one kept from an earlier trace of an "
                    "epilogue); compute every value inside the epilogue function"
                )
            return x.id
        if isinstance(x, numbers.Real):
            return self.add("const", kind="scalar", attrs=(("value", float(x)),)).id
        if isinstance(x, torch.Tensor):
            raise EpilogueError(
                f"{op}: a torch tensor of shape {tuple(x.shape)} met a traced value; an epilogue cannot capture "
                "tensors: make it a parameter of the epilogue and pass it as an operand"
            )
        raise EpilogueError(f"{op}: expected a traced value or a Python number, got {type(x).__name__}")

    @contextmanager
    def active(self) -> Iterator[Recorder]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def record(op: str, operands: Sequence[Any], attrs: tuple[tuple[str, Any], ...] = ()) -> Value:
    """Append ``op(*operands)`` to the trace the operands belong to; infer its kind and dtype."""
    rec = _ACTIVE.get()
    if rec is None:
        raise EpilogueError(
            f"epicute.ops {op}: works on the traced values of an epilogue function while it is traced, "
            "not outside one (to run an epilogue on tensors, use epicute.epilogue.reference_gemm or evaluate)"
        )
    args = [rec.nodes[rec.lift(x, op)] for x in operands]
    if op == "group_scales":  # the scales of a group_quant: one per row and group of columns
        return rec.add(op, tuple(a.id for a in args), "group", "fp32")
    for a in args:
        if a.op in GROUP_OPS:
            raise EpilogueError(
                f"{op}: an argument is the result of quantize_groups, which ends the epilogue (the kernel computes "
                "it after every other value of the tile); return it as D instead"
            )
        if a.op in REDUCTIONS:
            raise EpilogueError(
                f"{op}: an argument is the result of {a.op}, a reduction over the whole problem (across "
                "thread blocks) that is complete only when the kernel ends; return it as an output instead"
            )
    ids = tuple(a.id for a in args)
    if op in REDUCTIONS or op == "group_quant":
        (x,) = args
        if x.kind != "tile":
            raise EpilogueError(
                f"{op}: reduces a tile value (one per (m, n), e.g. a function of acc), but its argument "
                f"is a {x.kind} value"
            )
        if op == "group_quant":
            return rec.add(op, ids, "tile", dict(attrs)["dtype"], tuple(sorted(attrs)))
        return rec.add(op, ids, REDUCTIONS[op][0], "fp32")
    dtype = dict(attrs)["dtype"] if optable.get(op).rounds else "fp32"
    return rec.add(op, ids, join_kinds([a.kind for a in args]), dtype, tuple(sorted(attrs)))


def _untraceable(what: str) -> NoReturn:
    raise EpilogueError(
        f"{what} needs the data of a traced epilogue value, which does not exist while the epilogue is traced: "
        "data-dependent Python control flow (if/while, and/or, bool(), float(), min()/max()) can't be traced; "
        "use epicute.ops.where(cond, a, b), ops.minimum/ops.maximum or ops.clamp"
    )


class Value:
    """A traced value: one node of the graph being recorded. Use it like a number."""

    __slots__ = ("_rec", "id")
    # numpy scalars defer to our reflected operators instead of building object arrays.
    __array_ufunc__ = None

    def __init__(self, rec: Recorder, node_id: int) -> None:
        self._rec = rec
        self.id = node_id

    @property
    def node(self) -> Node:
        return self._rec.nodes[self.id]

    @property
    def kind(self) -> str:
        return self.node.kind

    @property
    def dtype(self) -> str:
        return self.node.dtype

    def __repr__(self) -> str:
        return f"<traced {self.node}>"

    def __add__(self, other: Any) -> Value:
        return record("add", (self, other))

    def __radd__(self, other: Any) -> Value:
        return record("add", (other, self))

    def __sub__(self, other: Any) -> Value:
        return record("sub", (self, other))

    def __rsub__(self, other: Any) -> Value:
        return record("sub", (other, self))

    def __mul__(self, other: Any) -> Value:
        return record("mul", (self, other))

    def __rmul__(self, other: Any) -> Value:
        return record("mul", (other, self))

    def __truediv__(self, other: Any) -> Value:
        return record("div", (self, other))

    def __rtruediv__(self, other: Any) -> Value:
        return record("div", (other, self))

    def __neg__(self) -> Value:
        return record("neg", (self,))

    def __pos__(self) -> Value:
        return self

    def __abs__(self) -> Value:
        return record("abs", (self,))

    def __lt__(self, other: Any) -> Value:
        return record("lt", (self, other))

    def __le__(self, other: Any) -> Value:
        return record("le", (self, other))

    def __gt__(self, other: Any) -> Value:
        return record("gt", (self, other))

    def __ge__(self, other: Any) -> Value:
        return record("ge", (self, other))

    # == and != must keep Python's bool contract (containers, `in`), so they are not traced.
    def __eq__(self, other: object) -> NoReturn:
        raise EpilogueError("== on traced epilogue values is not traced; use epicute.ops.eq(a, b) (ops.ne for !=)")

    def __ne__(self, other: object) -> NoReturn:
        raise EpilogueError("!= on traced epilogue values is not traced; use epicute.ops.ne(a, b) (ops.eq for ==)")

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        _untraceable("bool() (an if, while, and/or or assert on a traced value)")

    def __float__(self) -> float:
        _untraceable("float() (or a math.* function)")

    def __int__(self) -> int:
        _untraceable("int()")

    def __index__(self) -> int:
        _untraceable("using a traced value as an index")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> NoReturn:
        name = getattr(func, "__name__", repr(func))
        raise EpilogueError(
            f"torch function {name!r} can't run on a traced epilogue value: use epicute.ops "
            "(e.g. ops.exp, ops.gelu, ops.where) for math, and pass tensors as operands of the epilogue"
        )
