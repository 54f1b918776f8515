"""Traced values, and the recorder that turns operations on them into graph nodes.

While an epilogue is traced, ``acc`` and its operands are :class:`Value` proxies.
Each operator or :mod:`epicute.ops` call on them appends one
:class:`~epicute.epilogue.graph.Node` to the active :class:`Recorder`, with its
kind and dtype inferred by the IR's rules, so the user's plain Python function
runs once and leaves the graph behind. Anything that would need a value's data
(``if``, ``bool()``, ``float()``, torch functions), and Python syntax the graph has
no op for (``**``, ``//``, ``%``, ``@``, ``round()``, indexing, bitwise operators,
tensor methods such as ``.sum()``, numpy functions), raises an
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
    kernel one multiply and does not change the graph's hash. ``hook`` names what
    is traced (``"epilogue"``, ``"score_mod"``) in the errors its values raise.
    """

    def __init__(self, hook: str = "epilogue") -> None:
        self.nodes: list[Node] = []
        self._memo: dict[tuple, int] = {}
        self.hook = hook

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


def _function_name(op: str) -> str:
    """The ``epicute.ops`` function a user calls to record ``op`` (``gelu`` for ``gelu_tanh``), for errors."""
    if op in GROUP_OPS:
        return "quantize_groups"
    try:
        function = optable.get(op).function
    except EpilogueError:  # not a table op: a reduction, whose function is its name
        return op
    return function or op


def record(op: str, operands: Sequence[Any], attrs: tuple[tuple[str, Any], ...] = ()) -> Value:
    """Append ``op(*operands)`` to the trace the operands belong to; infer its kind and dtype."""
    rec = _ACTIVE.get()
    if rec is None:
        raise EpilogueError(
            f"epicute.ops.{_function_name(op)}: works on the traced values of an epilogue function while it is "
            "traced, not outside one (to run an epilogue on tensors, use epicute.epilogue.reference_gemm or evaluate)"
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


def _untraceable(what: str, hook: str = "epilogue") -> NoReturn:
    raise EpilogueError(
        f"{what} needs the data of a traced {hook} value, which does not exist while the {hook} is traced: "
        "data-dependent Python control flow (if/while, and/or, bool(), float(), min()/max()) can't be traced; "
        "use epicute.ops.where(cond, a, b), ops.minimum/ops.maximum or ops.clamp"
    )


class UnsupportedAttributeError(EpilogueError, AttributeError):
    """An attribute a traced value does not have (``x.sum()``): an AttributeError too, so ``hasattr`` keeps
    working."""


#: What to write instead of a Python operator the graph has no op for.
_OPERATOR_FIXES = {
    "**": (
        "write x * x for a square, ops.sqrt(x) or ops.rsqrt(x) for ** 0.5 or ** -0.5, ops.exp2(y) for 2 ** y, "
        "and ops.exp(y * ops.log(x)) for x ** y with x > 0"
    ),
    "//": "there is no floor op: keep the division (x / y) in fp32",
    "%": "there is no remainder op: write x - y * q with q computed without it, or pass the remainder as an operand",
    "divmod()": "there is no floor or remainder op: keep the division (x / y) in fp32",
    "@": "an epilogue is elementwise: multiply (*) for one value per element, ops.row_sum/ops.col_sum to reduce",
    "&": "comparisons give 0/1 masks: multiply them for 'and' ((a > 0) * (b < 1)) and use ops.where(mask, x, y)",
    "|": "comparisons give 0/1 masks: ops.maximum(m1, m2) is 'or', and ops.where(mask, x, y) selects",
    "^": "comparisons give 0/1 masks: ops.abs(m1 - m2) is 'xor', and ops.where(mask, x, y) selects",
    "~": "comparisons give 0/1 masks: 1 - mask negates one (or compare the other way: x >= y for ~(x < y))",
    "<<": "shifts are not traced: multiply by 2 ** n (a Python number) instead",
    ">>": "shifts are not traced: divide by 2 ** n (a Python number) instead",
}
#: What to write instead of tensor methods and numpy functions that have other names in ``epicute.ops`` (or none).
_METHOD_FIXES = {
    "sum": "write ops.row_sum(x) (per row) or ops.col_sum(x) (per column)",
    "max": "write ops.row_max(x), ops.col_max(x) or ops.amax(x) to reduce, ops.maximum(x, y) elementwise",
    "amax": "write ops.row_amax(x), ops.col_amax(x) or ops.amax(x) (of |x|)",
    "min": "write ops.minimum(x, y) (elementwise)",
    "mean": "write ops.row_sum(x) / N (N a Python number)",
    "pow": _OPERATOR_FIXES["**"],
    "power": _OPERATOR_FIXES["**"],
    "square": "write x * x",
    "clip": "write ops.clamp(x, lo, hi)",
    "clamp": "write ops.clamp(x, lo, hi)",
    "to": "write ops.cast(x, dtype)",
    "float": "write nothing: a traced value is fp32 already (ops.cast(x, dtype) rounds to another dtype)",
    "half": "write ops.cast(x, torch.float16)",
    "bfloat16": "write ops.cast(x, torch.bfloat16)",
    "absolute": "write abs(x) or ops.abs(x)",
    "negative": "write -x",
    "reciprocal": "write 1.0 / x",
    "sign": "write ops.where(x > 0, 1.0, ops.where(x < 0, -1.0, 0.0))",
    "round": "write ops.cast(x, dtype) (rounds to a dtype, to nearest even)",
    "shape": "pass sizes as Python numbers (a scalar operand): the function sees one element at a time",
    "size": "pass sizes as Python numbers (a scalar operand): the function sees one element at a time",
    "item": "use the value itself: it is one number per element already",
    "tolist": "use the value itself: it is one number per element already",
}
for _name in ("T", "t", "transpose", "permute", "reshape", "view", "flatten", "unsqueeze", "squeeze", "expand"):
    _METHOD_FIXES[_name] = "compute elementwise: the function sees one element at a time (other shapes are operands)"


def _method_fix(name: str) -> str:
    """What to write instead of method (or numpy function) ``name`` on a traced value."""
    if name in _METHOD_FIXES:
        return _METHOD_FIXES[name]
    from epicute.epilogue import ops  # ops imports this module

    if name in ops.__all__:
        return f"write ops.{name}(x)"
    return "use Python operators and epicute.ops functions (ops.exp, ops.where, ops.row_sum, ...)"


#: numpy ufuncs that are the Python operators of traced values (a numpy scalar on the left of one calls it).
_NUMPY_OPERATORS = {
    "add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "div", "divide": "div", "negative": "neg",
    "absolute": "abs", "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge",
}  # fmt: skip


class Value:
    """A traced value: one node of the graph being recorded. Use it like a number."""

    __slots__ = ("_rec", "id")

    def __init__(self, rec: Recorder, node_id: int) -> None:
        object.__setattr__(self, "_rec", rec)
        object.__setattr__(self, "id", node_id)

    @property
    def _hook(self) -> str:
        return self._rec.hook

    def _unsupported(self, syntax: str) -> NoReturn:
        raise EpilogueError(
            f"{syntax} on a traced {self._hook} value is not supported (the {self._hook} is traced into a graph of "
            f"elementwise ops): {_OPERATOR_FIXES[syntax]}"
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Value:
        """A numpy scalar's operator on a traced value (``np.float32(2) * acc``) is traced as ours; any other numpy
        function is refused, naming the op to use."""
        name = getattr(ufunc, "__name__", repr(ufunc))
        if method == "__call__" and not kwargs and name in _NUMPY_OPERATORS:
            return record(_NUMPY_OPERATORS[name], tuple(float(x) if _numpy_number(x) else x for x in inputs))
        call = name if method == "__call__" else f"{name}.{method}"
        raise EpilogueError(
            f"numpy's {call} can't run on a traced {self._hook} value (numpy computes on data, and a traced value "
            f"has none): {_method_fix('sum' if method == 'reduce' and name == 'add' else name)}"
        )

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("_"):  # protocol lookups (numpy, torch, copy) expect a plain AttributeError
            raise AttributeError(name)
        raise UnsupportedAttributeError(
            f"a traced {self._hook} value has no attribute {name!r}: it stands for one number per element, not a "
            f"tensor (no tensor methods or attributes): for .{name}, {_method_fix(name)}"
        )

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise EpilogueError(f"a traced {self._hook} value can't be given attribute {name!r}: compute a new value")

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
        _untraceable("bool() (an if, while, and/or or assert on a traced value)", self._hook)

    def __float__(self) -> float:
        _untraceable("float() (or a math.* function)", self._hook)

    def __int__(self) -> int:
        _untraceable("int()", self._hook)

    def __complex__(self) -> complex:
        _untraceable("complex()", self._hook)

    def __index__(self) -> int:
        _untraceable("using a traced value as an index", self._hook)

    def __round__(self, ndigits: Any = None) -> NoReturn:
        raise EpilogueError(
            f"round() on a traced {self._hook} value is not supported: ops.cast(x, dtype) rounds to a dtype "
            "(to nearest even); there is no rounding to an integer"
        )


    def __getitem__(self, index: Any) -> NoReturn:
        raise EpilogueError(
            f"indexing a traced {self._hook} value is not supported: it stands for one number per element, not a "
            "tensor; reduce with ops.row_sum/ops.col_sum/ops.amax, or pass what you would index as an operand"
        )

    def __setitem__(self, index: Any, value: Any) -> NoReturn:
        raise EpilogueError(
            f"assigning into a traced {self._hook} value is not supported: compute a new value, selecting with "
            "ops.where(mask, x, y)"
        )

    def __iter__(self) -> NoReturn:
        raise EpilogueError(
            f"iterating over (or unpacking) a traced {self._hook} value is not supported: it stands for one number "
            "per element, not a sequence"
        )

    def __len__(self) -> NoReturn:
        raise EpilogueError(
            f"len() of a traced {self._hook} value is not supported: it stands for one number per element; pass "
            "sizes as Python numbers (operands or constants)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise EpilogueError(f"a traced {self._hook} value is not a function: use epicute.ops functions on it")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> NoReturn:
        name = getattr(func, "__name__", repr(func))
        hook = next((a._hook for a in (*args, *(kwargs or {}).values()) if isinstance(a, Value)), "epilogue")
        raise EpilogueError(
            f"torch function {name!r} can't run on a traced {hook} value: use epicute.ops "
            f"(e.g. ops.exp, ops.gelu, ops.where) for math, and pass tensors as operands of the {hook}"
        )


#: The binary operators a traced value refuses, by dunder name (their fixes: _OPERATOR_FIXES); each also reflected.
_REFUSED_OPERATORS = {
    "pow": "**", "floordiv": "//", "mod": "%", "divmod": "divmod()", "matmul": "@", "and": "&", "or": "|",
    "xor": "^", "lshift": "<<", "rshift": ">>",
}  # fmt: skip


def _refuse(syntax: str) -> Any:
    def refused(self: Value, *other: Any) -> NoReturn:
        self._unsupported(syntax)

    return refused


for _name, _syntax in _REFUSED_OPERATORS.items():
    setattr(Value, f"__{_name}__", _refuse(_syntax))
    setattr(Value, f"__r{_name}__", _refuse(_syntax))
Value.__invert__ = _refuse("~")  # type: ignore[method-assign]

def _numpy_number(x: Any) -> bool:
    """A numpy scalar (a number to the graph), told apart without importing numpy."""
    return type(x).__module__ == "numpy" and isinstance(x, numbers.Number) and not isinstance(x, Value)
