"""Operands of an epilogue: what kind each passed value is, and its canonical view.

An operand's kind is read off what the user passes, given the GEMM's M, N, L,
by torch's broadcasting against the ``(L, M, N)`` result: trailing dimensions
line up with ``(..., M, N)``, each of size 1 or the axis' size. So a Python
number or 1-element tensor is a ``"scalar"``; ``(N,)``, ``(1, N)``, ``(L, 1, N)``
a ``"row"`` vector (one value per column n); ``(M, 1)``, ``(L, M, 1)`` a
``"col"`` vector (one value per row m); ``(M, N)``, ``(L, M, N)`` a ``"tile"``.
A 1-D tensor is therefore always a row vector, also when M == N: its meaning
never depends on the sizes of one call. One batched form goes beyond torch:
``(L, N)`` is a per-batch row vector. A shape that fits two kinds meaning
different math (``(L, N)`` when L == M) must be pinned with :class:`RowVector`,
:class:`ColVector`, :class:`Scalar` or :class:`Tile`, at the call or as the
parameter's annotation in the epilogue; a pin also accepts its kind's compact
forms (``ColVector(t)`` for ``t`` of shape ``(M,)`` or ``(L, M)``).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from epicute.epilogue.dtypes import TORCH_TO_IR
from epicute.errors import EpilogueError


@dataclass(frozen=True, eq=False)
class Pin:
    """A value whose operand kind is fixed by the user instead of inferred from its shape."""

    value: Any
    kind: ClassVar[str]


class Scalar(Pin):
    """One value for the whole problem: a Python number or a 1-element tensor."""

    kind = "scalar"


class RowVector(Pin):
    """One value per column n, broadcast along M: shape ``(N,)`` or ``(L, N)``."""

    kind = "row"


class ColVector(Pin):
    """One value per row m, broadcast along N: shape ``(M,)``, ``(L, M)``, ``(M, 1)`` or ``(L, M, 1)``."""

    kind = "col"


class Tile(Pin):
    """One value per (m, n): shape ``(M, N)`` or ``(L, M, N)``."""

    kind = "tile"


PINS: dict[str, type[Pin]] = {cls.kind: cls for cls in (Scalar, RowVector, ColVector, Tile)}


@dataclass(frozen=True, eq=False)
class OperandSpec:
    """An operand resolved against a problem.

    ``value`` is a Python float for a scalar, else a view (never a copy) of the
    tensor in canonical shape: row ``(L, N)``, col ``(L, M)``, tile ``(L, M, N)``;
    a missing L is broadcast with a zero stride. ``dtype`` is the IR dtype the
    kernel loads (``"fp32"`` for scalars).
    """

    name: str
    kind: str
    dtype: str
    value: float | torch.Tensor


#: Shapes a pinned operand may take, as the problem dimension each axis runs over.
_PINNED_FORMS = (
    ("row", ("n",)), ("row", ("l", "n")), ("row", ("1", "n")), ("row", ("l", "1", "n")),
    ("col", ("m",)), ("col", ("l", "m")), ("col", ("m", "1")), ("col", ("l", "m", "1")),
    ("tile", ("m", "n")), ("tile", ("l", "m", "n")),
)  # fmt: skip
#: Shapes read without a pin, per kind, for error messages (torch broadcasting, plus (L, N) rows).
_UNPINNED_FORMS = (
    ("row", ("n",)), ("row", ("l", "n")), ("col", ("m", "1")), ("col", ("l", "m", "1")),
    ("tile", ("m", "n")), ("tile", ("l", "m", "n")),
)  # fmt: skip
_CANONICAL = {"row": ("l", "n"), "col": ("l", "m"), "tile": ("l", "m", "n")}
_MEANING = {
    "scalar": "a scalar",
    "row": "a row vector (one value per column n, broadcast along M)",
    "col": "a column vector (one value per row m, broadcast along N)",
    "tile": "a tile (one value per (m, n))",
}


def _describe_forms(kind: str, sizes: dict[str, int], pinned: bool) -> str:
    if kind == "scalar":
        return "a Python number or a 1-element tensor"
    shapes = []
    for form in (f for k, f in (_PINNED_FORMS if pinned else _UNPINNED_FORMS) if k == kind):
        symbolic = ", ".join(d.upper() for d in form) + ("," if len(form) == 1 else "")
        shapes.append(f"({symbolic}) = {tuple(sizes[d] for d in form)}")
    return " or ".join(shapes)


def declared_kind_error(name: str, declared: str, given: str, fix: str = "") -> EpilogueError:
    """An operand given as another kind than the epilogue's annotation (``scale: Scalar``) declares: passed
    to a call as another pin, or described in text (``--operand scale=row``, a spec's ``operands``)."""
    return EpilogueError(
        f"operand {name!r} is declared {PINS[declared].__name__} by the epilogue, but was passed as {given}{fix}"
    )


def _scalar(name: str, value: Any) -> OperandSpec:
    if isinstance(value, torch.Tensor):
        # A meta tensor has no value to read: only explain takes one (the plan does not depend on it).
        value = 0.0 if value.device.type == "meta" else value.item()
    try:
        number = float(value)
    except (OverflowError, TypeError) as exc:  # an int past float's range; a complex tensor's item()
        raise EpilogueError(
            f"operand {name!r} = {repr(value)[:40]} is no float32 scalar ({exc}); pass a real number within float "
            "range"
        ) from exc
    return OperandSpec(name, "scalar", "fp32", number)


#: Tensor operands resolved before: (name, declared kind, pin kind, shape, stride, dtype, m, n, l)
#: -> (kind, IR dtype, canonical view's size and stride). What a resolution decides
#: depends on nothing else, so a repeat replays the view (``as_strided``) instead.
_RESOLVED: dict[tuple, tuple] = {}
_RESOLVED_MAX = 4096


def operand_spec(name: str, value: Any, m: int, n: int, l: int = 1, declared: str | None = None) -> OperandSpec:
    """Resolve one operand against an ``L x M x N`` problem.

    ``declared`` is the kind the epilogue's annotation fixes, if any; a pin
    passed by the user must agree with it.
    """
    pin = type(value).kind if isinstance(value, Pin) else None
    tensor = value.value if pin is not None else value
    if type(tensor) is not torch.Tensor:  # numbers, and tensor subclasses (fake, functional)
        return _resolve(name, value, m, n, l, declared)
    sig = (name, declared, pin, tensor.shape, tensor.stride(), tensor.dtype, m, n, l)
    hit = _RESOLVED.get(sig)
    if hit is not None:
        kind, dtype, size, stride = hit
        return OperandSpec(name, kind, dtype, tensor.as_strided(size, stride))
    spec = _resolve(name, value, m, n, l, declared)
    if spec.kind != "scalar":  # a 1-element tensor scalar is read (.item()) per call
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[sig] = (spec.kind, spec.dtype, tuple(spec.value.shape), tuple(spec.value.stride()))
    return spec


def _resolve(name: str, value: Any, m: int, n: int, l: int, declared: str | None) -> OperandSpec:
    kind = declared
    if isinstance(value, Pin):
        if declared is not None and value.kind != declared:
            raise declared_kind_error(name, declared, type(value).__name__)
        kind, value = value.kind, value.value
    is_tensor = isinstance(value, torch.Tensor)
    if not is_tensor and not isinstance(value, numbers.Real):
        raise EpilogueError(f"operand {name!r}: expected a torch tensor or a Python number, got {type(value).__name__}")
    sizes = {"l": l, "m": m, "n": n, "1": 1}
    if kind == "scalar" or (kind is None and (not is_tensor or value.numel() == 1)):
        if is_tensor and value.numel() != 1:
            raise EpilogueError(
                f"operand {name!r} has shape {tuple(value.shape)}, but a scalar must be "
                f"{_describe_forms('scalar', sizes, pinned=True)}"
            )
        return _scalar(name, value)
    if not is_tensor:
        raise EpilogueError(f"operand {name!r} is a number, but it is pinned to {_MEANING[kind]}: pass a tensor")
    if value.dtype not in TORCH_TO_IR:
        raise EpilogueError(
            f"operand {name!r} has dtype {value.dtype}; use bf16, fp16, fp32 or fp8 (e.g. {name}.float())"
        )

    shape = tuple(value.shape)
    readings = _pinned_readings(shape, kind, sizes) if kind is not None else _broadcast_readings(shape, sizes)
    if not readings:
        kinds = [kind] if kind is not None else list(_MEANING)
        accepted = "; ".join(f"{_describe_forms(k, sizes, kind is not None)} for {_MEANING[k]}" for k in kinds)
        hint = ""
        if kind is None and shape in ((m,), (l, m)):
            hint = (
                f". A tensor's last dimension runs over N, as in torch's broadcasting: for one value per row m "
                f"pass {name}[..., None] or epicute.ColVector({name})"
            )
        raise EpilogueError(f"operand {name!r} has shape {shape}; with M={m}, N={n}, L={l} it must be {accepted}{hint}")
    if len(readings) > 1:
        kinds = list(readings.values())
        fits = " and ".join(_MEANING[k] for k in kinds)
        pins = " or ".join(f"epicute.{PINS[k].__name__}({name})" for k in kinds)
        raise EpilogueError(
            f"operand {name!r} with shape {shape} is ambiguous for M={m}, N={n}, L={l}: it fits {fits}; "
            f"say which by wrapping it: {pins}"
        )
    ((axes, kind),) = readings.items()
    return OperandSpec(name, kind, TORCH_TO_IR[value.dtype], _canonical(value, axes, kind, sizes))


def _kind_of(axes: tuple[str, ...]) -> str:
    """The narrowest kind whose canonical shape holds every axis in ``axes``."""
    if "m" in axes:
        return "tile" if "n" in axes else "col"
    return "row"  # a per-batch value with neither m nor n is a row broadcast along N


def _readings(matches, shape: tuple[int, ...]) -> dict[tuple[str, ...], str]:
    """Distinct meanings of ``(kind, form)`` matches, keyed by the problem axes the non-unit dimensions
    run over: two readings with the same axes (``(1, N)`` as a row or as an M == 1 tile) mean the same
    math, and the narrowest kind is kept."""
    readings: dict[tuple[str, ...], str] = {}
    for k, form in matches:
        readings.setdefault(tuple(d for d, size in zip(form, shape) if size != 1), k)
    return readings


def _pinned_readings(shape: tuple[int, ...], kind: str, sizes: dict[str, int]) -> dict[tuple[str, ...], str]:
    matches = [
        (k, form) for k, form in _PINNED_FORMS
        if k == kind and len(form) == len(shape) and all(sizes[d] == size for d, size in zip(form, shape))
    ]  # fmt: skip
    return _readings(matches, shape)


def _broadcast_readings(shape: tuple[int, ...], sizes: dict[str, int]) -> dict[tuple[str, ...], str]:
    """Torch's reading of ``shape`` against ``(L, M, N)``, and the per-batch row reading of ``(L, N)``."""
    matches = []
    form = ("l", "m", "n")[3 - len(shape) :] if len(shape) <= 3 else None
    if form is not None and all(size in (1, sizes[d]) for d, size in zip(form, shape)):
        axes = tuple(d for d, size in zip(form, shape) if size != 1)
        matches.append((_kind_of(axes), form))
    if len(shape) == 2 and shape == (sizes["l"], sizes["n"]):
        matches.append(("row", ("l", "n")))
    return _readings(matches, shape)


def _canonical(t: torch.Tensor, axes: tuple[str, ...], kind: str, sizes: dict[str, int]) -> torch.Tensor:
    """View ``t``, whose non-unit dimensions run over ``axes``, in ``kind``'s canonical shape."""
    view = t.reshape([s for s in t.shape if s != 1])  # dropping unit dims is always a view
    for i, d in enumerate(_CANONICAL[kind]):
        if d not in axes:
            view = view.unsqueeze(i)
    return view.expand(*(sizes[d] for d in _CANONICAL[kind]))


def resolve_operands(
    params: Sequence[str],
    values: Mapping[str, Any],
    m: int,
    n: int,
    l: int = 1,
    *,
    declared: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    epilogue: str = "epilogue",
) -> dict[str, OperandSpec]:
    """Resolve every operand of an epilogue taking ``params`` (in order) from ``values``.

    ``declared`` maps parameters to kinds fixed by their annotations, ``defaults``
    to the parameters' default values (used when not passed).
    """
    declared, defaults = declared or {}, defaults or {}
    missing = [p for p in params if p not in values and p not in defaults]
    extra = [k for k in values if k not in params]
    if missing or extra:
        problems = [f"missing {', '.join(map(repr, missing))}"] if missing else []
        problems += [f"unexpected {', '.join(map(repr, extra))}"] if extra else []
        takes = ", ".join(params) or "no operands"
        raise EpilogueError(f"epilogue {epilogue!r} takes {takes} (after acc): {'; '.join(problems)}")
    return {p: operand_spec(p, values[p] if p in values else defaults[p], m, n, l, declared.get(p)) for p in params}
