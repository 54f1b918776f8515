"""What an epilogue can compute: ``epicute.ops``.

Every function takes traced values (and Python numbers, which become constants
of the kernel) and records one op of the epilogue graph. Names follow torch.
Everything computes in fp32 unless :func:`cast` or :func:`quantize` says
otherwise; comparisons give 0/1 masks for :func:`where`. Operators
(``+ - * /``, unary ``-``, ``abs()``, ``< <= > >=``) work on traced values too.
"""

from __future__ import annotations

import numbers

import torch

from epicute.epilogue.dtypes import FP8_MAX, ir_dtype
from epicute.epilogue.proxy import Value, record
from epicute.errors import EpilogueError

#: What an op accepts as an argument: a traced value or a Python number (a constant).
Arg = Value | float


def neg(x: Arg) -> Value:
    """``-x``."""
    return record("neg", (x,))


def abs(x: Arg) -> Value:
    """``|x|``."""
    return record("abs", (x,))


def minimum(a: Arg, b: Arg) -> Value:
    """Elementwise minimum; NaN if either is NaN (like ``torch.minimum``)."""
    return record("minimum", (a, b))


def maximum(a: Arg, b: Arg) -> Value:
    """Elementwise maximum; NaN if either is NaN (like ``torch.maximum``)."""
    return record("maximum", (a, b))


def fma(a: Arg, b: Arg, c: Arg) -> Value:
    """``a * b + c``."""
    return record("fma", (a, b, c))


def exp(x: Arg) -> Value:
    """``e ** x``."""
    return record("exp", (x,))


def exp2(x: Arg) -> Value:
    """``2 ** x``."""
    return record("exp2", (x,))


def log(x: Arg) -> Value:
    """Natural logarithm."""
    return record("log", (x,))


def sqrt(x: Arg) -> Value:
    """Square root."""
    return record("sqrt", (x,))


def rsqrt(x: Arg) -> Value:
    """``1 / sqrt(x)``."""
    return record("rsqrt", (x,))


def tanh(x: Arg) -> Value:
    """Hyperbolic tangent."""
    return record("tanh", (x,))


def sigmoid(x: Arg) -> Value:
    """``1 / (1 + exp(-x))``."""
    return record("sigmoid", (x,))


def relu(x: Arg) -> Value:
    """``max(x, 0)``."""
    return record("relu", (x,))


def gelu(x: Arg, approximate: str = "none") -> Value:
    """GELU: ``"none"`` is ``x * Phi(x)`` with erf, ``"tanh"`` the tanh approximation (as in torch)."""
    ops = {"none": "gelu_erf", "tanh": "gelu_tanh"}
    if approximate not in ops:
        raise EpilogueError(f"gelu: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return record(ops[approximate], (x,))


def silu(x: Arg) -> Value:
    """``x * sigmoid(x)``."""
    return record("silu", (x,))


def softplus(x: Arg) -> Value:
    """``log(1 + exp(x))`` (``x`` itself above 20, like ``torch.nn.functional.softplus``)."""
    return record("softplus", (x,))


def clamp(x: Arg, lo: float | None = None, hi: float | None = None) -> Value:
    """``min(max(x, lo), hi)`` with constant bounds (use minimum/maximum for traced ones)."""
    if lo is None and hi is None:
        raise EpilogueError("clamp: give lo, hi or both")
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and not isinstance(bound, numbers.Real):
            raise EpilogueError(
                f"clamp: {name} must be a Python number (a constant of the kernel); got {type(bound).__name__}: "
                "for a traced bound use ops.maximum(x, lo) / ops.minimum(x, hi)"
            )
    if lo is not None and hi is not None and lo > hi:
        raise EpilogueError(f"clamp: lo={lo} > hi={hi}")
    attrs = (("hi", None if hi is None else float(hi)), ("lo", None if lo is None else float(lo)))
    return record("clamp", (x,), attrs)


def lt(a: Arg, b: Arg) -> Value:
    """``a < b`` as a 0/1 mask."""
    return record("lt", (a, b))


def le(a: Arg, b: Arg) -> Value:
    """``a <= b`` as a 0/1 mask."""
    return record("le", (a, b))


def gt(a: Arg, b: Arg) -> Value:
    """``a > b`` as a 0/1 mask."""
    return record("gt", (a, b))


def ge(a: Arg, b: Arg) -> Value:
    """``a >= b`` as a 0/1 mask."""
    return record("ge", (a, b))


def eq(a: Arg, b: Arg) -> Value:
    """``a == b`` as a 0/1 mask (``==`` itself is not traced)."""
    return record("eq", (a, b))


def ne(a: Arg, b: Arg) -> Value:
    """``a != b`` as a 0/1 mask (``!=`` itself is not traced)."""
    return record("ne", (a, b))


def where(cond: Arg, a: Arg, b: Arg) -> Value:
    """``a`` where ``cond`` is nonzero, else ``b`` (``cond`` is usually a comparison)."""
    return record("where", (cond, a, b))


def cast(x: Arg, dtype: torch.dtype) -> Value:
    """Round ``x`` to ``dtype``; computing goes on in fp32 with the rounded value.

    Rounding is to nearest even; conversions to fp8 saturate to its largest finite value.
    """
    return record("cast", (x,), (("dtype", ir_dtype(dtype, "cast")),))


def quantize(x: Arg, scale: Arg, dtype: torch.dtype = torch.float8_e4m3fn) -> Value:
    """``x * scale`` rounded to an fp8 ``dtype``, saturating at its largest finite value.

    ±448 for ``torch.float8_e4m3fn``, ±57344 for ``torch.float8_e5m2``; NaN stays NaN.
    """
    name = ir_dtype(dtype, "quantize")
    if name not in FP8_MAX:
        raise EpilogueError(
            f"quantize: dtype {dtype} is not an fp8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2 "
            "(ops.cast rounds to other dtypes)"
        )
    return record("quantize", (x, scale), (("dtype", name),))


def row_sum(x: Value) -> Value:
    """Sum over N of a tile: one value per row m (an output of shape ``(M,)``/``(L, M)``)."""
    return record("row_sum", (x,))


def row_max(x: Value) -> Value:
    """Max over N of a tile: one value per row m."""
    return record("row_max", (x,))


def row_amax(x: Value) -> Value:
    """Max of ``|x|`` over N of a tile: one value per row m."""
    return record("row_amax", (x,))


def col_sum(x: Value) -> Value:
    """Sum over M of a tile: one value per column n (an output of shape ``(N,)``/``(L, N)``)."""
    return record("col_sum", (x,))


def col_max(x: Value) -> Value:
    """Max over M of a tile: one value per column n."""
    return record("col_max", (x,))


def col_amax(x: Value) -> Value:
    """Max of ``|x|`` over M of a tile: one value per column n."""
    return record("col_amax", (x,))


def amax(x: Value) -> Value:
    """Max of ``|x|`` over the whole problem, all batches included: one scalar."""
    return record("amax", (x,))


__all__ = [
    "neg", "abs", "minimum", "maximum", "fma", "exp", "exp2", "log", "sqrt", "rsqrt", "tanh", "sigmoid",
    "relu", "gelu", "silu", "softplus", "clamp", "lt", "le", "gt", "ge", "eq", "ne", "where", "cast",
    "quantize", "row_sum", "row_max", "row_amax", "col_sum", "col_max", "col_amax", "amax",
]  # fmt: skip
