"""The elementwise ops of the epilogue language: each one declared once, here.

An :class:`OpDef` holds everything epicute knows about one IR op, and every part
that handles ops reads it from this table instead of keeping a list of its own:

- :mod:`epicute.epilogue.ops`: the public functions (generated from the entry,
  or hand-written where an op validates its arguments: ``gelu``, ``clamp``,
  ``cast``, ``quantize``), and :func:`call`, which records any op by name;
- :data:`epicute.epilogue.graph.ELEMENTWISE` (arity) and the tracer (the
  result dtype of ops that round, :attr:`OpDef.rounds`);
- :mod:`epicute.epilogue.reference`: what the op computes, in torch
  (:attr:`OpDef.reference`, the oracle the kernel is checked against);
- :data:`epicute.epilogue.schedule.OP_INSTRUCTIONS`: the instruction estimate
  that sizes the epilogue's code and its arithmetic time in the planner;
- :mod:`epicute.sm90.epilogue_emit`: the DSL code (:attr:`OpDef.emit`), which
  every kernel's epilogue chain and attention's score_mod emit;
- ``tests/gemm/epilogue_fuzz.py``: what random programs may feed the op
  (:class:`Domain`).

This module is pure Python (torch, no CuTe DSL), so ``explain`` and the CLI run
without the DSL. Emitters are therefore written over a *math namespace* ``m``
passed in at emit time (``emit=lambda m, x: x / (m.const(1.0) + m.exp(-x))``):
Python's arithmetic and comparison operators on the values, plus the primitives
of :class:`TorchMath` (``const``, ``exp``, ``exp2``, ``log``, ``log1p``,
``sqrt``, ``rsqrt``, ``tanh``, ``absf``, ``rcp_approx``, ``max``, ``min``,
``select``, ``round_to``). ``epilogue_emit.DSL_MATH`` implements them with the
DSL (one DSL call each, so an emitter is the kernel's code call for call);
:data:`TORCH_MATH` implements them on torch float32 tensors, so tests can run
an emitter on the CPU.

Adding an op is adding one entry to :data:`BUILTIN` (CONTRIBUTING.md, "Adding
an epilogue op"); :func:`register` adds one at run time (tests, experiments).
The result kind of every elementwise op is the widest of its arguments' kinds
(:func:`epicute.epilogue.proxy.join_kinds`); its dtype is fp32 unless the op
:attr:`~OpDef.rounds`. Reductions (row_sum, ..., amax) are not elementwise: they
live in :data:`epicute.epilogue.graph.REDUCTIONS`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from epicute.epilogue.dtypes import FP8_MAX, round_to
from epicute.errors import EpilogueError

Tensor = torch.Tensor
T = TypeVar("T")

#: Argument kinds of a :class:`Domain` (see there).
DOMAIN_KINDS = ("any", "stable", "condition", "positive", "nonzero", "small", "leaf")


@dataclass(frozen=True)
class Domain:
    """What the epilogue fuzzer (tests/gemm/epilogue_fuzz.py) may feed an op, and what it knows of the result.

    The fuzzer keeps every value finite and bounded, and values that feed a jump
    (a comparison, a rounding) *stable*: computed bit for bit alike by the kernel
    and the reference (its module docstring says why). Per argument, ``args``
    says what it may be:

    - ``"any"``: any value the fuzzer makes (bounded; stable where the result must be);
    - ``"stable"``: stable values only (the op jumps on its input: comparisons, roundings);
    - ``"condition"``: a 0/1 mask (an op with ``mask=True`` on stable values), sometimes any
      stable value (nonzero is true): ``where``'s first argument;
    - ``"positive"``: ``>= 1``: the fuzzer feeds ``abs(x) + 1.0`` or a constant in [1, 3] (log, sqrt);
    - ``"nonzero"``: ``|x| >= 1``: ``abs(x) + 1.0`` or a constant of either sign (divisors);
    - ``"small"``: ``|x| <= 4``: ``x`` scaled down by a power of two where needed (exp);
    - ``"leaf"``: the accumulator, an operand or a constant (quantize's scale).

    Guarded arguments (positive, nonzero, small) are not stable.
    """

    args: tuple[str, ...]
    #: A rigorous bound on ``|result|`` from bounds on ``|argument|`` (after the guards above),
    #: and the attrs as keywords.
    bound: Callable[..., float]
    #: The result is stable when the arguments are (IEEE rounded once, or exact: no contraction
    #: into an fma, no approximate function).
    stable: bool = False
    #: The result is a 0/1 mask (what ``"condition"`` arguments are made of).
    mask: bool = False
    #: Draws the op's attrs: ``random.Random -> {name: value}``.
    attrs: Callable[[random.Random], dict[str, Any]] | None = None
    #: How often the fuzzer picks the op, relative to the others.
    weight: float = 1.0


@dataclass(frozen=True)
class OpDef:
    """One elementwise op of the epilogue IR (module docstring; CONTRIBUTING.md lists the fields)."""

    #: The op's name in the IR (``Node.op``), e.g. ``"gelu_tanh"``.
    name: str
    #: Number of traced arguments (values or Python numbers, which become constants).
    arity: int
    #: What the op computes, in torch: ``reference(*args, **attrs)`` on tensors of the
    #: compute dtype (float32, or float64), broadcasting. The CPU reference runs it, and
    #: kernel results are checked against it: write the textbook formula (torch.sigmoid,
    #: F.gelu), not the kernel's approximation.
    reference: Callable[..., Tensor]
    #: The kernel's code: ``emit(m, *args, **attrs)`` over a math namespace ``m``
    #: (module docstring), on fp32 scalars; returns the result value.
    emit: Callable[..., Any]
    #: Estimated SASS instructions per element (fp32; transcendental ones with their range
    #: reduction, IEEE division and square root with their fix-up sequence).
    instructions: int
    #: What the fuzzer may feed it (:class:`Domain`).
    domain: Domain
    #: Names of its compile-time attributes (``Node.attrs``), passed to ``reference`` and
    #: ``emit`` as keywords, e.g. clamp's ``("hi", "lo")`` (either may be None).
    attrs: tuple[str, ...] = ()
    #: The op rounds to its ``dtype`` attribute: the node's dtype is that attribute (values stay
    #: fp32 in registers), a tile output ending in it is stored in it by default, and the kernel
    #: must be able to round to it. Every other op gives fp32.
    rounds: bool = False
    #: The ``epicute.ops`` function that records it; ``""``: the op's own name; None: none
    #: (a Python operator records it).
    function: str | None = ""
    #: Keywords of ``function`` that select this op, when several ops share it
    #: (``ops.gelu(x, approximate="tanh")`` records ``gelu_tanh``). Such functions are hand-written.
    variant: tuple[tuple[str, Any], ...] = ()
    #: The Python operator spelling that records it, a format string over the arguments
    #: (``"{0} + {1}"``, ``"-{0}"``, ``"abs({0})"``).
    operator: str | None = None
    #: Parameter names of the generated ``ops`` function (default: x; a, b; a, b, c).
    params: tuple[str, ...] = ()
    #: Docstring of the generated ``ops`` function.
    doc: str = ""
    #: Its forward-mode derivative (:mod:`epicute.epilogue.derivative`): ``tangent(args, tangents, out, **attrs)``
    #: gives the result's tangent from the arguments' (None where an argument's is zero), over traced values
    #: (``call`` and Python operators) or Python numbers; None: the op has no derivative rule. Most ops
    #: state their partial derivatives (:func:`_partials`). Roundings pass gradients straight through, as
    #: torch's autograd does through ``.to(dtype)``; comparisons have none.
    tangent: Callable[..., Any] | None = None

    @property
    def function_name(self) -> str | None:
        return self.name if self.function == "" else self.function

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.params or {1: ("x",), 2: ("a", "b"), 3: ("a", "b", "c")}.get(
            self.arity, tuple(f"x{i}" for i in range(self.arity))
        )


# ------------------------------------------------------------ math namespaces
class TorchMath:
    """The math namespace of emitters, on torch float32 tensors (and Python floats).

    ``epicute.sm90.epilogue_emit.DSL_MATH`` is the kernel's: same names, same
    meaning, each one DSL call. Here the approximate primitives are exact
    (``rcp_approx`` is a division, fastmath is ignored): running an emitter on
    torch shows its formula's error, not the hardware's last ulps.
    """

    @staticmethod
    def _t(x) -> Tensor:
        return x if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float32)

    @staticmethod
    def const(value: float) -> float:
        """An fp32 constant of the kernel."""
        return float(value)

    @staticmethod
    def exp(x, fastmath: bool = False):
        return torch.exp(TorchMath._t(x))

    @staticmethod
    def exp2(x, fastmath: bool = False):
        return torch.exp2(TorchMath._t(x))

    @staticmethod
    def log(x, fastmath: bool = False):
        return torch.log(TorchMath._t(x))

    @staticmethod
    def log1p(x, fastmath: bool = False):
        return torch.log1p(TorchMath._t(x))

    @staticmethod
    def sqrt(x, fastmath: bool = False):
        return torch.sqrt(TorchMath._t(x))

    @staticmethod
    def rsqrt(x, fastmath: bool = False):
        return torch.rsqrt(TorchMath._t(x))

    @staticmethod
    def tanh(x, fastmath: bool = False):
        return torch.tanh(TorchMath._t(x))

    @staticmethod
    def absf(x):
        return torch.abs(TorchMath._t(x))

    @staticmethod
    def rcp_approx(x):
        """``1 / x`` (the kernel's ``rcp.approx.ftz``: <= 1 ulp off)."""
        return torch.reciprocal(TorchMath._t(x))

    @staticmethod
    def max(a, b):
        """Elementwise maximum, NaN if either is."""
        return torch.maximum(TorchMath._t(a), TorchMath._t(b))

    @staticmethod
    def min(a, b):
        """Elementwise minimum, NaN if either is."""
        return torch.minimum(TorchMath._t(a), TorchMath._t(b))

    @staticmethod
    def select(cond, a, b):
        """``a`` where ``cond`` holds, else ``b``."""
        return torch.where(TorchMath._t(cond), TorchMath._t(a), TorchMath._t(b))

    @staticmethod
    def round_to(x, dtype: str):
        """``x`` rounded to IR ``dtype`` and back to fp32 (fp8 saturates)."""
        x = TorchMath._t(x)
        return round_to(x, dtype).to(x.dtype)


TORCH_MATH = TorchMath()
#: The primitives every math namespace provides (besides operators on its values).
MATH_PRIMITIVES = (
    "const", "exp", "exp2", "log", "log1p", "sqrt", "rsqrt", "tanh", "absf", "rcp_approx", "max", "min", "select",
    "round_to",
)  # fmt: skip


# ----------------------------------------------------------------- gelu (erf)
_SQRT1_2 = 0.7071067811865476
# erfc(z) ~ t * P(t) * exp(-z^2), t = 1 / (1 + p z), z >= 0: Abramowitz & Stegun 7.1.26,
# absolute error <= 1.5e-7 on erf.
_ERFC_P = 0.3275911
_ERFC_POLY = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
_GELU_TANH_C = 0.7978845608028654
_GELU_EXP2_SCALE = 0.8493218002880191  # s = sqrt(log2(e) / 2): exp2(-(x s)^2) = exp(-x^2 / 2)
_FLOAT32_MAX = 3.4028234663852886e38
_LOG2E = 1.4426950408889634
_INV_SQRT_2PI = 0.3989422804014327


def gelu_erf(m, x):
    """``x * Phi(x)`` through erfc of ``|x| / sqrt(2)``, over the math namespace ``m``: the
    kernel's code (``epilogue_emit.DSL_MATH``), and on torch tensors in tests (:data:`TORCH_MATH`).

    One reciprocal, one exp2 and twelve fp32 ALU instructions per element, against
    ~28 for ``0.5 x (1 + erf(x / sqrt(2)))`` with the generic erf, which evaluates
    both of its polynomial ranges and selects. The ALU count is what a fused
    epilogue pays: under ping-pong each fp32 ALU instruction per element slows
    the other warpgroup's WGMMAs, and MUFU instructions far less (bench/NOTES.md,
    'The ffn epilogue taken apart' and 'gelu in 12 ALU instructions'). So
    ``x * Phi(x)`` is written ``max(x, 0) - |x| Phi(-|x|)`` (no select), and
    ``x * s`` with ``s = sqrt(log2(e) / 2)`` feeds both the reciprocal's argument and exp2's.
    Error <= 7e-7 absolute over all fp32 inputs (torch's fp32 gelu: 1.2e-6); the
    tail ``Phi(-|x|) = erfc(|x| / sqrt(2)) / 2`` is computed directly, not as
    ``1 - ...``, so negative inputs keep their relative accuracy. ``|x|`` is capped
    at the largest float before it multiplies the tail (which is 0 there), so
    ``gelu(+inf) = inf`` and ``gelu(-inf) = 0``, the limits."""
    xs = x * m.const(_GELU_EXP2_SCALE)
    t = m.rcp_approx(m.const(1.0) + m.const(_ERFC_P * _SQRT1_2 / _GELU_EXP2_SCALE) * m.absf(xs))
    half_poly = m.const(0.5 * _ERFC_POLY[0])  # Phi = erfc / 2: the half folded into P
    for coeff in _ERFC_POLY[1:]:
        half_poly = half_poly * t + m.const(0.5 * coeff)
    tail = t * half_poly * m.exp2(-xs * xs, fastmath=True)  # Phi(-|x|)
    return m.max(x, m.const(0.0)) - m.min(m.absf(x), m.const(_FLOAT32_MAX)) * tail


def gelu_erf_grad(m, x):
    """GELU's derivative ``Phi(x) + x phi(x)``, over the math namespace ``m``, with :func:`gelu_erf`'s erfc and one
    exp2 for both terms (``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)`` is the exp2 term the tail already takes): one
    reciprocal, one exp2, one select and ~14 ALU instructions per element. The gradient graph's chain rule
    written over ``gelu_erf`` took ~40 (``Phi = gelu(x) / x``: an IEEE division with its slow path, guards at 0 and
    the accurate exp): a backward epilogue pays them per element (bench/NOTES.md, issue 57's gradient pass).
    ``x`` is capped at the largest float where it multiplies ``phi``, so the limits at +-inf are 1 and 0."""
    xs = x * m.const(_GELU_EXP2_SCALE)
    t = m.rcp_approx(m.const(1.0) + m.const(_ERFC_P * _SQRT1_2 / _GELU_EXP2_SCALE) * m.absf(xs))
    half_poly = m.const(0.5 * _ERFC_POLY[0])
    for coeff in _ERFC_POLY[1:]:
        half_poly = half_poly * t + m.const(0.5 * coeff)
    gauss = m.exp2(-xs * xs, fastmath=True)  # exp(-x^2 / 2)
    tail = t * half_poly * gauss  # Phi(-|x|)
    capped = m.max(m.min(x, m.const(_FLOAT32_MAX)), m.const(-_FLOAT32_MAX))
    cdf = m.select(x >= m.const(0.0), m.const(1.0) - tail, tail)
    return cdf + capped * gauss * m.const(_INV_SQRT_2PI)


def _gelu_erf_grad_reference(x: Tensor) -> Tensor:
    """``Phi(x) + x phi(x)``; 1 and 0 at +-inf (the limits, as the kernel computes them)."""
    exact = 0.5 * (1.0 + torch.erf(x * _SQRT1_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return torch.where(x.isinf(), (x > 0).to(x.dtype), exact)


def _exp_neg(m, x):
    """``exp(-x)`` as ``ex2.approx`` of ``-x log2(e)``: MUFU.EX2 (2 ulp) after one multiply, whose rounding
    puts the result within ``|x| * 6e-8`` relative of exp's (5e-6 at the largest finite ``exp(-x)``). The
    accurate exp spends six more ALU instructions per element on range reduction, which a fused epilogue
    pays in full (sigmoid and silu then divide approximately anyway)."""
    return m.exp2(m.const(-_LOG2E) * x, fastmath=True)


def _gelu_erf_reference(x: Tensor) -> Tensor:
    """torch's gelu, except at +-inf: the limits inf and 0, as the kernel computes them (torch gives NaN)."""
    return torch.where(x.isinf(), x.clamp(min=0.0), F.gelu(x))


# ------------------------------------------------------------ other emitters
def _gelu_tanh(m, x):
    return m.const(0.5) * x * (m.const(1.0) + m.tanh(m.const(_GELU_TANH_C) * (x + m.const(0.044715) * x * x * x)))


def _softplus(m, x):
    # torch's threshold: above 20, softplus(x) == x in fp32.
    return m.select(x > m.const(20.0), x, m.log1p(m.exp(x)))


def _clamp(m, x, *, lo, hi):
    if hi is not None:
        x = m.min(x, m.const(hi))
    if lo is not None:
        x = m.max(x, m.const(lo))
    return x


def _quantize_reference(x: Tensor, scale: Tensor, *, dtype: str) -> Tensor:
    x = x * scale
    return round_to(x, dtype).to(x.dtype)


def _mask(cond, m):
    return m.select(cond, m.const(1.0), m.const(0.0))


# ------------------------------------------------------- fuzzer's attrs/bounds
#: Relative growth of ``|x|`` when rounded to each dtype (half an ulp, generously).
_ROUNDING_GROWTH = {"fp32": 0.0, "bf16": 2.0**-8, "fp16": 2.0**-11, "fp8e4m3": 2.0**-4, "fp8e5m2": 2.0**-3}


def _rounded_bound(x: float, dtype: str) -> float:
    return (min(x, FP8_MAX[dtype]) if dtype in FP8_MAX else x) * (1 + _ROUNDING_GROWTH[dtype])


def _clamp_attrs(rng: random.Random) -> dict[str, Any]:
    lo, hi = round(rng.uniform(-2.0, 0.0), 2), round(rng.uniform(0.1, 2.0), 2)
    form = rng.choice(("both", "lo", "hi"))
    return {"lo": None if form == "hi" else lo, "hi": None if form == "lo" else hi}


def _clamp_bound(x: float, *, lo: float | None, hi: float | None) -> float:
    if lo is not None and hi is not None:
        return min(x, max(-lo, hi))
    return max(x, abs(lo if hi is None else hi))


def _quantize_attrs(rng: random.Random) -> dict[str, Any]:
    return {"dtype": "fp8e5m2" if rng.random() < 0.3 else "fp8e4m3"}


# ------------------------------------------------------------- derivatives
def _partials(partials: Callable[..., tuple]) -> Callable[..., Any]:
    """A tangent rule from the op's partial derivatives ``partials(*args, out, **attrs)``, each a traced value, a
    number or None (zero): the sum of partial x tangent over the arguments whose tangent is not zero."""

    def tangent(args: tuple, tangents: tuple, out: Any, **attrs: Any) -> Any:
        total = None
        for partial, t in zip(partials(*args, out, **attrs), tangents):
            if t is None or partial is None or (isinstance(partial, float) and partial == 0.0):
                continue
            if isinstance(partial, float) and partial == 1.0:
                term = t
            elif isinstance(t, float) and t == 1.0:
                term = partial
            else:
                term = partial * t
            total = term if total is None else total + term
        return total

    return tangent


def _sign(x):
    return call("gt", x, 0.0) - call("lt", x, 0.0)


def _where_tangent(args: tuple, tangents: tuple, out: Any) -> Any:
    """``where(c, a, b)``'s tangent picks ``a``'s or ``b``'s, so a non-finite one in the branch not taken stays out
    (as torch's autograd masks it)."""
    _, ta, tb = tangents
    if ta is None and tb is None:
        return None
    return call("where", args[0], 0.0 if ta is None else ta, 0.0 if tb is None else tb)


def _tie_split(a, b, wins: str):
    """d max(a, b) / d a (``wins="gt"``) or d min / d a (``"lt"``): 1 where a wins, 1/2 on a tie (torch's rule)."""
    return call(wins, a, b) + 0.5 * call("eq", a, b)


def _gelu_erf_partial(x, out):
    return (call("gelu_erf_grad", x),)


def _gelu_tanh_partial(x, out):
    t = call("tanh", _GELU_TANH_C * (x + 0.044715 * x * x * x))
    return (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_TANH_C * (1.0 + 3 * 0.044715 * x * x),)


def _clamp_partial(x, out, *, lo, hi):
    inside = None
    for bound, keep in ((lo, "ge"), (hi, "le")):
        if bound is not None:
            mask = call(keep, x, bound)
            inside = mask if inside is None else inside * mask
    return (1.0 if inside is None else inside,)


_NO_DERIVATIVE = _partials(lambda *args, **attrs: (None,) * (len(args) - 1))


# ---------------------------------------------------------------------- table
def _unary(name: str, reference: Callable, emit: Callable, instructions: int, domain: Domain, doc: str,
           **more: Any) -> OpDef:  # fmt: skip
    return OpDef(name, 1, reference, emit, instructions, domain, doc=doc, **more)


def _comparison(name: str, fn: Callable, emit: Callable, operator: str | None, doc: str) -> OpDef:
    return OpDef(
        name, 2, reference=lambda a, b: fn(a, b).to(a.dtype), emit=emit, instructions=2,
        domain=Domain(("stable", "stable"), lambda a, b: 1.0, stable=True, mask=True, weight=1 / 6),
        operator=operator, doc=doc, tangent=_NO_DERIVATIVE,
    )  # fmt: skip


_SAME = Domain(("any",), lambda x: x)  # |f(x)| <= |x|
_SAME_STABLE = Domain(("any",), lambda x: x, stable=True)
_UNIT = Domain(("any",), lambda x: 1.0)  # |f(x)| <= 1

#: Every built-in elementwise op. Fields: :class:`OpDef`, in order name, arity, reference
#: (torch), emit (DSL code over the math namespace ``m``), instructions, domain (fuzzer).
BUILTIN: tuple[OpDef, ...] = (
    # Arithmetic: Python's operators record these.
    OpDef("add", 2, torch.add, lambda m, a, b: a + b, 1, Domain(("any", "any"), lambda a, b: a + b),
          function=None, operator="{0} + {1}", tangent=_partials(lambda a, b, out: (1.0, 1.0))),
    OpDef("sub", 2, torch.sub, lambda m, a, b: a - b, 1, Domain(("any", "any"), lambda a, b: a + b),
          function=None, operator="{0} - {1}", tangent=_partials(lambda a, b, out: (1.0, -1.0))),
    OpDef("mul", 2, torch.mul, lambda m, a, b: a * b, 1, Domain(("any", "any"), lambda a, b: a * b, stable=True),
          function=None, operator="{0} * {1}", tangent=_partials(lambda a, b, out: (b, a))),
    OpDef("div", 2, torch.div, lambda m, a, b: a / b, 10, Domain(("any", "nonzero"), lambda a, b: a),
          function=None, operator="{0} / {1}", tangent=_partials(lambda a, b, out: (1.0 / b, -out / b))),
    _unary("neg", torch.neg, lambda m, x: -x, 1, _SAME_STABLE, "``-x``.", operator="-{0}",
           tangent=_partials(lambda x, out: (-1.0,))),
    _unary("abs", torch.abs, lambda m, x: m.absf(x), 1, _SAME_STABLE, "``|x|``.", operator="abs({0})",
           tangent=_partials(lambda x, out: (_sign(x),))),
    OpDef("minimum", 2, torch.minimum, lambda m, a, b: m.min(a, b), 1, Domain(("any", "any"), max, stable=True),
          doc="Elementwise minimum; NaN if either is NaN (like ``torch.minimum``).",
          tangent=_partials(lambda a, b, out: (_tie_split(a, b, "lt"), _tie_split(b, a, "lt")))),
    OpDef("maximum", 2, torch.maximum, lambda m, a, b: m.max(a, b), 1, Domain(("any", "any"), max, stable=True),
          doc="Elementwise maximum; NaN if either is NaN (like ``torch.maximum``).",
          tangent=_partials(lambda a, b, out: (_tie_split(a, b, "gt"), _tie_split(b, a, "gt")))),
    OpDef("fma", 3, lambda a, b, c: a * b + c, lambda m, a, b, c: a * b + c, 1,
          Domain(("any", "any", "any"), lambda a, b, c: a * b + c), doc="``a * b + c``.",
          tangent=_partials(lambda a, b, c, out: (b, a, 1.0))),
    # Transcendental functions (IEEE-accurate, not fastmath).
    _unary("exp", torch.exp, lambda m, x: m.exp(x), 8, Domain(("small",), math.exp), "``e ** x``.",
           tangent=_partials(lambda x, out: (out,))),
    _unary("exp2", torch.exp2, lambda m, x: m.exp2(x), 4, Domain(("small",), lambda x: 2.0**x), "``2 ** x``.",
           tangent=_partials(lambda x, out: (out * math.log(2.0),))),
    _unary("log", torch.log, lambda m, x: m.log(x), 12, Domain(("positive",), math.log), "Natural logarithm.",
           tangent=_partials(lambda x, out: (1.0 / x,))),
    _unary("sqrt", torch.sqrt, lambda m, x: m.sqrt(x), 8, Domain(("positive",), math.sqrt), "Square root.",
           tangent=_partials(lambda x, out: (0.5 / out,))),
    _unary("rsqrt", torch.rsqrt, lambda m, x: m.rsqrt(x), 2, Domain(("positive",), lambda x: 1.0),
           "``1 / sqrt(x)``.", tangent=_partials(lambda x, out: (-0.5 * out / x,))),
    _unary("tanh", torch.tanh, lambda m, x: m.tanh(x), 15, _UNIT, "Hyperbolic tangent.",
           tangent=_partials(lambda x, out: (1.0 - out * out,))),
    # Activations.
    # sigmoid and silu take rcp.approx (<= 1 ulp) of 1 + exp(-x) >= 1: IEEE division would add ~8
    # instructions and a slow-path branch per element, a third of a quantize epilogue's work. exp(-x) is
    # ex2.approx of -x log2(e) (_exp_neg): two instructions where the accurate exp takes eight.
    _unary("sigmoid", torch.sigmoid, lambda m, x: m.rcp_approx(m.const(1.0) + _exp_neg(m, x)), 5, _UNIT,
           "``1 / (1 + exp(-x))``.", tangent=_partials(lambda x, out: (out * (1.0 - out),))),
    _unary("relu", torch.relu, lambda m, x: m.max(x, m.const(0.0)), 1, _SAME_STABLE, "``max(x, 0)``.",
           tangent=_partials(lambda x, out: (call("gt", x, 0.0),))),
    _unary("gelu_erf", _gelu_erf_reference, gelu_erf, 14, Domain(("any",), lambda x: x, weight=0.5),
           "GELU, ``x * Phi(x)`` with erf.", function="gelu", variant=(("approximate", "none"),),
           tangent=_partials(_gelu_erf_partial)),
    _unary("gelu_erf_grad", _gelu_erf_grad_reference, gelu_erf_grad, 18, Domain(("any",), lambda x: 1.2, weight=0.25),
           "GELU's derivative, ``Phi(x) + x phi(x)`` with erf (what ``gelu``'s gradient records).",
           tangent=_partials(lambda x, out: (call("exp", -0.5 * x * x) * _INV_SQRT_2PI * (2.0 - x * x),))),
    _unary("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh, 21,
           Domain(("any",), lambda x: x, weight=0.5), "GELU, the tanh approximation.",
           function="gelu", variant=(("approximate", "tanh"),), tangent=_partials(_gelu_tanh_partial)),
    _unary("silu", F.silu, lambda m, x: x * m.rcp_approx(m.const(1.0) + _exp_neg(m, x)), 6, _SAME,
           "``x * sigmoid(x)``.",
           tangent=_partials(lambda x, out: ((lambda s: s * (1.0 + x * (1.0 - s)))(call("sigmoid", x)),))),
    _unary("softplus", F.softplus, _softplus, 25, Domain(("any",), lambda x: x + math.log(2.0)),
           "``log(1 + exp(x))`` (``x`` itself above 20, like ``torch.nn.functional.softplus``).",
           tangent=_partials(lambda x, out: (call("where", call("gt", x, 20.0), 1.0, call("sigmoid", x)),))),
    _unary("clamp", lambda x, *, lo, hi: torch.clamp(x, lo, hi), _clamp, 2,
           Domain(("any",), _clamp_bound, stable=True, attrs=_clamp_attrs),
           "``min(max(x, lo), hi)`` with constant bounds.", attrs=("hi", "lo"), tangent=_partials(_clamp_partial)),
    # Comparisons give 0/1 masks; == and != are not traced (Python needs them to give bools).
    _comparison("lt", torch.lt, lambda m, a, b: _mask(a < b, m), "{0} < {1}", "``a < b`` as a 0/1 mask."),
    _comparison("le", torch.le, lambda m, a, b: _mask(a <= b, m), "{0} <= {1}", "``a <= b`` as a 0/1 mask."),
    _comparison("gt", torch.gt, lambda m, a, b: _mask(a > b, m), "{0} > {1}", "``a > b`` as a 0/1 mask."),
    _comparison("ge", torch.ge, lambda m, a, b: _mask(a >= b, m), "{0} >= {1}", "``a >= b`` as a 0/1 mask."),
    _comparison("eq", torch.eq, lambda m, a, b: _mask(a == b, m), None,
                "``a == b`` as a 0/1 mask (``==`` itself is not traced)."),
    _comparison("ne", torch.ne, lambda m, a, b: _mask(a != b, m), None,
                "``a != b`` as a 0/1 mask (``!=`` itself is not traced)."),
    OpDef("where", 3, lambda c, a, b: torch.where(c != 0, a, b), lambda m, c, a, b: m.select(c != m.const(0.0), a, b),
          2, Domain(("condition", "any", "any"), lambda c, a, b: max(a, b), stable=True), params=("cond", "a", "b"),
          doc="``a`` where ``cond`` is nonzero, else ``b`` (``cond`` is usually a comparison).",
          tangent=_where_tangent),
    # Roundings: the node's dtype is the ``dtype`` attr; the value goes on in fp32.
    _unary("cast", lambda x, *, dtype: round_to(x, dtype).to(x.dtype), lambda m, x, *, dtype: m.round_to(x, dtype),
           2, Domain(("stable",), _rounded_bound, stable=True,
                     attrs=lambda rng: {"dtype": rng.choice(("bf16", "fp16", "fp8e4m3"))}),
           "Round ``x`` to ``dtype``.", attrs=("dtype",), rounds=True,
           tangent=_partials(lambda x, out, *, dtype: (1.0,))),
    OpDef("quantize", 2, _quantize_reference, lambda m, x, s, *, dtype: m.round_to(x * s, dtype), 4,
          Domain(("stable", "leaf"), lambda x, s, *, dtype: _rounded_bound(x * s, dtype), stable=True,
                 attrs=_quantize_attrs),
          attrs=("dtype",), rounds=True,
          doc="``x * scale`` rounded to an fp8 ``dtype``, saturating.",
          tangent=_partials(lambda x, s, out, *, dtype: (s, x))),
)  # fmt: skip

_BUILTIN_NAMES = frozenset(op.name for op in BUILTIN)
_OPS: dict[str, OpDef] = {op.name: op for op in BUILTIN}


# -------------------------------------------------------------------- lookups
def find(name: str) -> OpDef | None:
    """The elementwise op ``name``, or None (leaves, reductions and unknown names)."""
    return _OPS.get(name)


def get(name: str) -> OpDef:
    """The elementwise op ``name``; an :class:`EpilogueError` naming the known ones if there is none."""
    op = _OPS.get(name)
    if op is None:
        raise EpilogueError(f"unknown elementwise epilogue op {name!r}; the ops are: {', '.join(_OPS)}")
    return op


def all_ops() -> tuple[OpDef, ...]:
    """Every op: the built-in ones, then the registered ones, in registration order."""
    return tuple(_OPS.values())


def rounds(name: str) -> bool:
    """Whether op ``name`` rounds to its ``dtype`` attribute (cast, quantize; False for non-elementwise ops)."""
    op = _OPS.get(name)
    return op is not None and op.rounds


def is_builtin(name: str) -> bool:
    return name in _BUILTIN_NAMES


class _View(Mapping[str, T]):
    """A live, read-only ``{op name: field}`` over the table (registered ops included)."""

    def __init__(self, field: Callable[[OpDef], T], what: str) -> None:
        self._field, self._what = field, what

    def __getitem__(self, name: str) -> T:
        return self._field(_OPS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(list(_OPS))

    def __len__(self) -> int:
        return len(_OPS)

    def __repr__(self) -> str:
        return f"<{self._what} of the epilogue op table: {dict(self)}>"


def view(field: Callable[[OpDef], T], what: str = "view") -> Mapping[str, T]:
    """``{op name: field(op)}``, kept current as ops are registered (``graph.ELEMENTWISE``: the arities)."""
    return _View(field, what)


# ---------------------------------------------------------------- recording
def call(name: str, *args: Any, **attrs: Any):
    """Record op ``name`` on traced values (or Python numbers) while an epilogue is traced: what
    the ``epicute.ops`` functions do, for any op of the table (``call("exp", x)`` is ``ops.exp(x)``).

    ``attrs`` are the op's compile-time attributes, all of them (None where absent).
    """
    from epicute.epilogue.proxy import record  # the tracer imports the graph, which imports this table

    op = get(name)
    if len(args) != op.arity:
        raise EpilogueError(f"{name}: takes {op.arity} argument(s) ({', '.join(op.param_names)}), got {len(args)}")
    if set(attrs) != set(op.attrs):
        raise EpilogueError(f"{name}: takes the attributes {sorted(op.attrs) or 'none'}, got {sorted(attrs) or 'none'}")
    return record(name, args, tuple(sorted(attrs.items())))


# -------------------------------------------------------------- registration
def _check(op: OpDef) -> None:
    from epicute.epilogue.graph import LEAVES, REDUCTIONS

    where = f"op {op.name!r}"
    if not op.name.isidentifier() or op.name in LEAVES or op.name in REDUCTIONS:
        raise EpilogueError(f"{where}: the name must be an identifier and not a leaf or reduction")
    if op.name in _OPS:
        raise EpilogueError(f"{where} is already in the table")
    if op.arity < 1 or len(op.param_names) != op.arity or len(op.domain.args) != op.arity:
        raise EpilogueError(f"{where}: arity {op.arity}, but params {op.param_names} and domain {op.domain.args}")
    unknown = set(op.domain.args) - set(DOMAIN_KINDS)
    if unknown:
        raise EpilogueError(f"{where}: domain kinds {sorted(unknown)} are not among {DOMAIN_KINDS}")
    if not isinstance(op.instructions, int) or op.instructions < 1:
        raise EpilogueError(f"{where}: instructions must be a positive int (SASS per element)")
    if op.rounds and "dtype" not in op.attrs:
        raise EpilogueError(f"{where}: an op that rounds takes a 'dtype' attribute")
    fn = op.function_name
    if fn is not None:
        from epicute.epilogue import ops

        taken = {o.function_name for o in _OPS.values() if not (o.variant and op.variant)}
        if not fn.isidentifier() or fn.startswith("_") or fn in taken or fn in vars(ops):
            raise EpilogueError(f"{where}: epicute.ops.{fn} is taken (or not a public name); choose another function")


def register(op: OpDef) -> OpDef:
    """Add ``op`` to the table: from now on it traces (``call``, and ``epicute.ops.<function>``),
    runs on the CPU reference, plans and compiles like a built-in op. Refuses a name in use."""
    _check(op)
    _OPS[op.name] = op
    return op


def unregister(name: str) -> None:
    """Remove a registered op (built-in ones stay)."""
    if name in _BUILTIN_NAMES:
        raise EpilogueError(f"op {name!r} is built in; only registered ops can be removed")
    if _OPS.pop(name, None) is None:
        raise EpilogueError(f"op {name!r} is not registered")


@contextmanager
def registered(op: OpDef) -> Iterator[OpDef]:
    """``with registered(op): ...``: ``op`` is in the table inside the block only."""
    register(op)
    try:
        yield op
    finally:
        unregister(op.name)


# -------------------------------------------------------------- fingerprint
def _code_digest(fn: Any, h: Any) -> None:
    code = getattr(fn, "__code__", None)
    if code is None:  # a builtin or torch function: its name says what it is
        h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}".encode())
        return

    def walk(c) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for k in c.co_consts:
            if hasattr(k, "co_code"):
                walk(k)
            else:
                h.update(repr(k).encode())

    walk(code)
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value):
            _code_digest(value, h)
        else:
            h.update(repr(value).encode())


def fingerprint(name: str) -> str | None:
    """None for a built-in op (``hashing.IR_VERSION`` covers those); for a registered op, a digest
    of its definition (arity, attrs, code of emit and reference), so the semantic hash of a graph
    using it, the compile-cache key, changes when the definition does."""
    if name in _BUILTIN_NAMES or name not in _OPS:
        return None
    op = _OPS[name]
    h = hashlib.sha256(repr((op.name, op.arity, op.attrs, op.rounds, op.instructions)).encode())
    _code_digest(op.emit, h)
    _code_digest(op.reference, h)
    return h.hexdigest()[:16]


__all__ = [
    "BUILTIN",
    "DOMAIN_KINDS",
    "MATH_PRIMITIVES",
    "TORCH_MATH",
    "Domain",
    "OpDef",
    "TorchMath",
    "all_ops",
    "call",
    "find",
    "fingerprint",
    "gelu_erf",
    "get",
    "is_builtin",
    "register",
    "registered",
    "rounds",
    "unregister",
    "view",
]
