"""What an epilogue can compute: ``epicute.ops``.

Every function takes traced values (and Python numbers, which become constants
of the kernel) and records one op of the epilogue graph. Names follow torch.
Everything computes in fp32 unless :func:`cast` or :func:`quantize` says
otherwise; comparisons give 0/1 masks for :func:`where`. Operators
(``+ - * /``, unary ``-``, ``abs()``, ``< <= > >=``) work on traced values too.

Each elementwise op is declared once, in :mod:`epicute.epilogue.optable`: the
functions of the plain ones (``exp``, ``minimum``, ``where``, ...) are made from
their entries, with the entry's parameters and docstring; the ones that check
their arguments (``gelu``, ``clamp``, ``cast``, ``quantize``) are written out
here, and so are the reductions.
"""

from __future__ import annotations

import difflib
import inspect
import numbers
from collections.abc import Callable

import torch

from epicute.epilogue import optable
from epicute.epilogue.dtypes import FP8_MAX, ir_dtype
from epicute.epilogue.proxy import Value, record
from epicute.errors import EpilogueError

#: What an op accepts as an argument: a traced value or a Python number (a constant).
Arg = Value | float


# --------------------------------------------------- ops that check arguments
def gelu(x: Arg, approximate: str = "none") -> Value:
    """GELU: ``"none"`` is ``x * Phi(x)`` with erf, ``"tanh"`` the tanh approximation (as in torch)."""
    variants = {dict(op.variant)["approximate"]: op.name for op in optable.all_ops() if op.function == "gelu"}
    if approximate not in variants:
        raise EpilogueError(f"gelu: approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return optable.call(variants[approximate], x)


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
        if bound is not None and bound != bound:  # NaN: torch's clamp gives NaN, the kernel's max/min the other value
            raise EpilogueError(f"clamp: {name}=nan; pass a number, or leave {name} out (None) for no bound")
    if lo is not None and hi is not None and lo > hi:
        raise EpilogueError(f"clamp: lo={lo} > hi={hi}")
    return optable.call("clamp", x, hi=None if hi is None else float(hi), lo=None if lo is None else float(lo))


def cast(x: Arg, dtype: torch.dtype) -> Value:
    """Round ``x`` to ``dtype``; computing goes on in fp32 with the rounded value.

    Rounding is to nearest even; conversions to fp8 saturate to its largest finite value.
    """
    return optable.call("cast", x, dtype=ir_dtype(dtype, "cast"))


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
    return optable.call("quantize", x, scale, dtype=name)


def quantize_groups(x: Value, dtype: torch.dtype = torch.float8_e4m3fn, *, ue8m0: bool = False) -> tuple[Value, Value]:
    """Quantize a tile for the next fp8 GEMM: per row and group of 128 columns, ``scale = max(amax, 1e-4) /
    fp8_max`` (rounded up to a power of two with ``ue8m0=True``, DeepSeek-V3's scale format), values stored as
    ``x / scale`` in ``dtype``, saturating.

    Returns ``(q, scales)``: return ``q`` as ``"D"`` and ``scales`` as any other output; the scales come out
    ``(M, ceil(N/128))`` fp32, M-major, the blockwise ``a_scale`` of the next ``epicute.gemm`` (or
    ``torch._scaled_mm``). The quantized value ends the epilogue: nothing else may use it.

    Example:
        >>> def swiglu_quantize(acc, up):                        # doctest: +SKIP
        ...     q, scales = ops.quantize_groups(ops.silu(acc) * up, ue8m0=True)
        ...     return {"D": q, "scales": scales}
    """
    name = ir_dtype(dtype, "quantize_groups")
    if name not in FP8_MAX:
        raise EpilogueError(f"quantize_groups: dtype {dtype} is not an fp8 dtype; use torch.float8_e4m3fn or "
                            "torch.float8_e5m2")  # fmt: skip
    q = record("group_quant", (x,), (("dtype", name), ("ue8m0", bool(ue8m0))))
    return q, record("group_scales", (q,))


# ----------------------------------------------------------------- reductions
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


# ------------------------------------------------ ops made from table entries
def _function_of(op: optable.OpDef) -> Callable[..., Value]:
    """The ``epicute.ops`` function of a table entry: its parameters (then its attrs, by keyword), its doc."""
    params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Arg") for p in op.param_names]
    params += [inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY) for a in op.attrs]
    signature = inspect.Signature(params, return_annotation="Value")

    def function(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        return optable.call(op.name, *(bound.arguments[p] for p in op.param_names),
                            **{a: bound.arguments[a] for a in op.attrs})  # fmt: skip

    function.__name__ = function.__qualname__ = op.function_name
    function.__module__ = __name__
    function.__doc__ = op.doc
    function.__signature__ = signature
    return function


def _generated(op: optable.OpDef) -> bool:
    """Whether an entry's function is made here (not written out above: no variants to choose between)."""
    return op.function_name is not None and not op.variant and op.function_name not in _WRITTEN


#: The functions written out above; every other table entry with a function gets one made here.
_WRITTEN = frozenset(
    name for name, value in list(globals().items())
    if inspect.isfunction(value) and value.__module__ == __name__ and not name.startswith("_")
)  # fmt: skip
for _op in optable.BUILTIN:
    if _generated(_op):
        globals()[_op.function_name] = _function_of(_op)
del _op

#: Functions of ops registered after import (``optable.register``), made on first use.
_REGISTERED: dict[str, tuple[optable.OpDef, Callable[..., Value]]] = {}


class UnknownOpError(EpilogueError, AttributeError):
    """``ops.<name>`` for a name that is no op (an AttributeError too, so ``hasattr`` keeps working)."""


def __getattr__(name: str):
    if name.startswith("__"):  # protocol lookups (inspect, copy, pickle) expect a plain AttributeError
        raise AttributeError(name)
    op = next((op for op in optable.all_ops() if op.function_name == name and _generated(op)), None)
    if op is not None:  # a registered op's function
        if _REGISTERED.get(name, (None,))[0] is not op:
            _REGISTERED[name] = (op, _function_of(op))
        return _REGISTERED[name][1]
    names = sorted({*__all__, *(op.function_name for op in optable.all_ops() if op.function_name)})
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"did you mean {', '.join(f'ops.{c}' for c in close)}? " if close else ""
    raise UnknownOpError(f"epicute.ops has no op {name!r}; {hint}the ops are: {', '.join(names)}")


__all__ = sorted(_WRITTEN | {op.function_name for op in optable.BUILTIN if _generated(op)})
