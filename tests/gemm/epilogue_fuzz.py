"""Random epilogues: a fuzzer for the fused-epilogue GEMM, checked against the CPU reference.

A *program* (:func:`random_program`) is a random epilogue written out as Python
source over ``epicute.ops``, up to :data:`MAX_DEPTH` random ops deep, on the
accumulator and on operands of random kinds (scalar, row, col, tile) and dtypes
(bf16, fp16, fp32). Its outputs are D (bf16, fp16, fp32 or fp8 e4m3), sometimes
aux tiles (bf16 or fp32, returned or written into NaN-poisoned ``outs=``) and
reductions (row/col sum, max, amax and the whole-problem amax). Each program
also pins a kernel configuration (tile_n, persistence, cluster, raster) so all
shapes it runs on share one compiled kernel. A *case* (:func:`run_case`) runs a
program on the shape and data drawn from a case seed; a failure names both
seeds and prints the program, and
``python -m tests.gemm.epilogue_fuzz PROGRAM_SEED CASE_SEED`` reruns it.

Depth counts the random ops on the longest path from an operand to an output; a
guard that keeps an op tame (``abs(x) + 1`` under log, the rescaling below, the
``+ acc`` that makes D a tile) is part of the op it guards.

Keeping the comparison meaningful
---------------------------------
The kernel and the reference both compute in fp32 but not bit for bit alike:
the kernel's compiler may contract ``a * b + c`` into one fma, and exp, log,
tanh, erf... differ in their last ulps. Smooth ops keep such a difference at a
few ulps; ops that jump (a comparison feeding ``where``, ``cast``, ``quantize``)
would turn it into a full jump at the rare element that sits on the edge. So:

1. **acc is exact.** ``a`` holds multiples of 1/8 in [-1, 1] and ``b`` the same
   times a power of two, so every product and partial sum is exact in fp32 and
   acc is the same bits whatever the order of summation (and ``|acc| <= 4``).
2. **Jumps only see stable values**: values both sides compute bit for bit --
   acc, operands, constants, and what the ops whose table entry says so make of
   stable values (neg, abs, relu, clamp, minimum, maximum, mul: IEEE, rounded
   once; where, comparisons, cast, quantize). add/sub/div/fma and the
   transcendentals are not stable.
3. **Values are bounded.** Operands lie in [-3, 3]; every node carries a
   rigorous bound on ``|value|``; each op is fed what its domain allows
   (log/sqrt/rsqrt and divisors take ``abs(x) + 1``, exp/exp2 inputs are scaled
   by a power of two to ``|x| <= 4``), and a node whose bound passes 256 is
   scaled down by an exact power of two. No inf, NaN or fp16 overflow can appear.

Which ops exist and what each may be fed (its :class:`~epicute.epilogue.optable.Domain`:
argument kinds, result bound, stability, attrs, weight) come from the op table,
:mod:`epicute.epilogue.optable`: an op added there is fuzzed without a change here.

Tolerances (``rel_err`` of tests/conftest.py, per output)
---------------------------------------------------------
bf16/fp16 tiles ``< 1e-2``, fp32 tiles ``< 1e-4``, reductions ``< 1e-4``
(fp32 sums in another order), and reductions must be bitwise equal across two
kernel runs.

fp8 (e4m3) outputs are not checked by ``rel_err``. e4m3 keeps 3 mantissa bits:
neighbouring values are 2^-4 to 2^-3 apart relative to their size. The two
sides round fp32 values that differ by a relative ``d`` (about 1e-6 after a
chain of transcendental ops), so an element lands on the neighbouring fp8 value
only when it lies within ``d`` of a rounding midpoint: a fraction of about
``2d / 2^-4``, ~3e-5 of the elements. One such flip moves ``rel_err`` by up to
``2^-3 / sqrt(numel)`` (0.03 for a 16-element output, 1e-4 for 10^6), so no
single ``rel_err`` bound both tolerates one flip in a small output and catches
a real error in a large one. The check is instead: every element equals the
reference's or its fp8 neighbour (``|diff| <=`` one e4m3 step at that
magnitude), and at most ``max(2, 0.1%)`` of the elements differ -- 30x the
expected flip rate, while a systematic error (a wrong scale, double rounding
through fp16, which flips ~1/128 of the elements, a missed saturation) moves
far more elements or moves them further.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

import epicute
from epicute import ops
from epicute.epilogue import optable
from epicute.epilogue.dtypes import IR_TO_TORCH
from tests.conftest import rel_err

MAX_DEPTH = 6
#: Bound on |acc| and on every operand value (see :func:`make_inputs`).
LEAF_BOUND = 4.0
#: A node whose bound passes this is scaled down by a power of two.
RESCALE_ABOVE = 256.0
FP8 = torch.float8_e4m3fn
#: fp8 input dtypes: multiples of 1/8 in [-1, 1] (and their power-of-two multiples) are exact in both
FP8_INPUTS = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Relative tolerance of rel_err per stored dtype, and for reductions.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
REDUCTION_TOLERANCE = 1e-4
#: Largest fraction of an fp8 output allowed one rounding step off (module docstring).
FP8_FLIP_FRACTION = 1e-3

OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCTION_OPS = ("row_sum", "row_max", "row_amax", "col_sum", "col_max", "col_amax", "amax")
#: Argument kinds (``Domain.args``) a Python constant may stand in for, and the ones that keep
#: a stable value stable (the others add a guard).
CONSTANT_KINDS = ("any", "stable", "positive", "nonzero")
UNGUARDED_KINDS = ("any", "stable", "condition", "leaf")
_SCALAR_FORMS = ("float", "0-d", "1-element", "pinned")


@dataclass(frozen=True)
class Family:
    """What a kernel family's epilogues may hold: operand kinds, stored dtypes, preallocated outputs."""

    name: str
    operand_kinds: tuple[str, ...]
    d_dtypes: tuple[torch.dtype, ...]
    d_weights: tuple[int, ...]
    aux_dtypes: tuple[torch.dtype, ...]
    outs: bool


GEMM = Family("gemm", ("scalar", "row", "col"), (torch.bfloat16, torch.float16, torch.float32, FP8), (4, 2, 2, 2),
              (torch.bfloat16, torch.float32), outs=True)  # fmt: skip


@dataclass(frozen=True)
class Operand:
    """One epilogue operand: ``kind`` and the ``dtype`` of its tensor (``None`` for scalars)."""

    name: str
    kind: str
    dtype: torch.dtype | None


@dataclass(frozen=True)
class Output:
    """One returned output. ``role``: "D", "aux" (a tile) or a reduction op; ``outs``: preallocated.

    ``bound``: the generator's bound on ``|value|`` of the tile (for a reduction: of its argument).
    """

    name: str
    role: str
    dtype: torch.dtype
    bound: float
    outs: bool = False


@dataclass(frozen=True)
class Program:
    """A random epilogue and how to call it (see the module docstring)."""

    seed: int
    source: str
    operands: tuple[Operand, ...]
    outputs: tuple[Output, ...]
    depth: int
    config: tuple[tuple[str, object], ...]
    ab_dtype: torch.dtype
    b_major: str
    family: str = "gemm"

    @cached_property
    def fn(self):
        namespace = {"ops": ops, "optable": optable, "torch": torch}
        # The program is source text so that a failure can print it; exec turns it into the epilogue.
        exec(compile(self.source, f"<fuzz program {self.seed}>", "exec"), namespace)
        return namespace[f"fuzz_{self.seed}"]

    @property
    def d_dtype(self) -> torch.dtype:
        return self.outputs[0].dtype

    @property
    def fp8(self) -> bool:
        """fp8 inputs: a K-major pair of e4m3/e5m2 operands with their scales (a_scale, b_scale)."""
        return self.ab_dtype in FP8_INPUTS

    def out_dtypes(self, with_outs: bool = True) -> dict[str, torch.dtype]:
        """D's and the aux tiles' dtypes (leaving out the preallocated ones unless ``with_outs``)."""
        return {o.name: o.dtype for o in self.outputs if o.role in ("D", "aux") and (with_outs or not o.outs)}


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    l: int
    batched: bool


@dataclass(frozen=True)
class _Expr:
    """A generated value: the variable holding it and what the generator knows about it."""

    code: str
    kind: str
    bound: float
    stable: bool
    depth: int
    uses_acc: bool


_ACC = _Expr("acc", "tile", LEAF_BOUND, True, 0, True)


def _join(*kinds: str) -> str:
    """The kind of an elementwise op's result (broadcasting scalar < row/col < tile)."""
    found = set(kinds) - {"scalar"}
    if not found:
        return "scalar"
    return found.pop() if len(found) == 1 else "tile"


def _pow2_at_most(x: float) -> float:
    """The largest power of two <= x (x > 0): scaling by it is exact."""
    return 2.0 ** math.floor(math.log2(x))


def fuzzed_ops(stable: bool = False) -> list[optable.OpDef]:
    """The ops of the table programs draw from; ``stable``: those giving stable values from stable ones."""
    return [
        op for op in optable.all_ops()
        if not stable or (op.domain.stable and all(kind in UNGUARDED_KINDS for kind in op.domain.args))
    ]  # fmt: skip


def _atom(code: str) -> str:
    """``code`` as an operand of a Python operator (parenthesized unless a name or a non-negative number)."""
    return code if code.isidentifier() or code.replace(".", "", 1).isdigit() else f"({code})"


def _literal(name: str, value) -> str:
    """An attr's value in source: ``dtype`` attrs (IR names) as torch dtypes."""
    return f"torch.{str(IR_TO_TORCH[value]).removeprefix('torch.')}" if name == "dtype" else repr(value)


class _Builder:
    """Writes one program's body, one ``vN = ...`` line per op."""

    def __init__(self, rng: random.Random, family: Family = GEMM) -> None:
        self.rng = rng
        self.family = family
        self.lines: list[str] = []
        self.pool: list[_Expr] = []
        self.operands: list[Operand] = []

    # --------------------------------------------------------------- plumbing
    def emit(self, code: str, args: list[_Expr], bound: float, stable: bool, *, guard: bool = False,
             reusable: bool = True) -> _Expr:  # fmt: skip
        """Assign ``code`` to a new variable; a ``guard`` belongs to its argument's op (no extra depth).

        A ``reusable=False`` value is an output only: kept out of the pool and never rescaled.
        """
        kind = _join(*(a.kind for a in args))
        if bound > RESCALE_ABOVE and reusable:
            scale = 1.0 / _pow2_at_most(bound / (RESCALE_ABOVE / 4))
            code, bound = f"({code}) * {scale!r}", bound * scale
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = {code}")
        depth = (0 if guard else 1) + max((a.depth for a in args), default=0)
        expr = _Expr(name, kind, bound, stable, depth, any(a.uses_acc for a in args))
        if reusable:
            self.pool.append(expr)
        return expr

    def const(self, lo: float = 0.25, hi: float = 3.0) -> float:
        return round(self.rng.choice((-1, 1)) * self.rng.uniform(lo, hi), 3)

    def operand(self) -> _Expr:
        rng = self.rng
        if self.operands and (len(self.operands) >= 5 or rng.random() < 0.4):
            op = rng.choice(self.operands)
        else:
            tiles = sum(o.kind == "tile" for o in self.operands)
            kind = rng.choice(self.family.operand_kinds + (("tile",) if tiles < 2 else ()))
            dtype = None if kind == "scalar" else rng.choice(OPERAND_DTYPES)
            op = Operand(f"p{len(self.operands)}", kind, dtype)
            self.operands.append(op)
        return _Expr(op.name, op.kind, LEAF_BOUND, True, 0, False)

    def leaf(self) -> _Expr:
        return _ACC if self.rng.random() < 0.4 else self.operand()

    def gen(self, depth: int, stable: bool = False) -> _Expr:
        """A value at most ``depth`` ops deep; ``stable``: computed bit for bit alike by both sides."""
        rng = self.rng
        if depth <= 0 or (depth < MAX_DEPTH - 1 and rng.random() < 0.3):
            return self.leaf()
        reusable = [e for e in self.pool if e.depth <= depth and (e.stable or not stable)]
        if reusable and rng.random() < 0.2:
            return rng.choice(reusable)
        code, args, bound, is_stable = self.expression(self.pick(fuzzed_ops(stable)), depth - 1, stable)
        return self.emit(code, args, bound, is_stable)

    def pick(self, candidates: list[optable.OpDef]) -> optable.OpDef:
        return self.rng.choices(candidates, weights=[op.domain.weight for op in candidates])[0]

    # ------------------------------------------------------- ops of the table
    def expression(self, op: optable.OpDef, d: int, stable: bool) -> tuple[str, list[_Expr], float, bool]:
        """``op`` on fresh arguments at most ``d`` ops deep, as source (not yet assigned to a variable):
        the code, the values it reads, the bound on ``|result|``, whether the result is stable."""
        rng, dom = self.rng, op.domain
        attrs = dom.attrs(rng) if dom.attrs else {}
        slots = [i for i, kind in enumerate(dom.args) if kind in CONSTANT_KINDS]
        constant = rng.choice(slots) if len(dom.args) > 1 and slots and rng.random() < 0.3 else None
        codes, bounds, read, all_stable = [], [], [], True
        for i, kind in enumerate(dom.args):
            code, bound, used, arg_stable = self.argument(kind, d, stable, constant=i == constant)
            codes.append(code)
            bounds.append(bound)
            read += used
            all_stable &= arg_stable
        return self.spell(op, codes, attrs), read, dom.bound(*bounds, **attrs), dom.stable and all_stable

    def argument(self, kind: str, d: int, stable: bool, constant: bool) -> tuple[str, float, list[_Expr], bool]:
        """One argument of a ``Domain.args`` kind: its code, bound, the values it reads, whether it is stable."""
        rng = self.rng
        if constant:
            c = {
                "any": lambda: self.const(),
                "stable": lambda: rng.choice((0.0, self.const(0.0, 2.0))),  # stable values are often 0
                "positive": lambda: abs(self.const(1.0, 3.0)),
                "nonzero": lambda: self.const(1.0, 3.0),
            }[kind]()
            return repr(c), abs(c), [], True
        if kind == "leaf":
            if rng.random() < 0.4:
                c = self.const(0.5, 4.0)
                return repr(c), abs(c), [], True
            s = self.operand() if rng.random() < 0.7 else _ACC
            return s.code, s.bound, [s], True
        if kind == "condition":
            if rng.random() < 0.15:  # a stable value itself: nonzero is true
                x = self.gen(d, stable=True)
                return x.code, x.bound, [x], True
            mask = self.pick([op for op in fuzzed_ops(True) if op.domain.mask])  # a comparison
            code, read, bound, _ = self.expression(mask, d, True)
            return code, bound, read, True
        x = self.gen(d, stable=stable or kind == "stable")
        if kind in ("positive", "nonzero"):
            return f"abs({x.code}) + 1.0", x.bound + 1.0, [x], False
        if kind == "small":
            scale = 1.0 if x.bound <= 4.0 else 1.0 / _pow2_at_most(x.bound / 2.0)
            return (x.code if scale == 1.0 else f"{x.code} * {scale!r}"), x.bound * scale, [x], False
        return x.code, x.bound, [x], x.stable

    def spell(self, op: optable.OpDef, codes: list[str], attrs: dict) -> str:
        """``op`` on ``codes`` as a user writes it: its operator or its ``ops`` function, at random."""
        keywords = [f"{k}={_literal(k, v)}" for k, v in (*op.variant, *attrs.items())]
        forms = []
        if op.operator is not None:
            forms.append(op.operator.format(*(_atom(c) for c in codes)))
        if op.function_name is not None:
            forms.append(f"ops.{op.function_name}({', '.join(codes + keywords)})")
        return self.rng.choice(forms) if forms else f"optable.call({op.name!r}, {', '.join(codes + keywords)})"

    # --------------------------------------------------------------- outputs
    def tile(self, depth: int, *, need_acc: bool = False) -> _Expr:
        """A tile value (D and aux outputs must be tiles), reused from the pool or new."""
        rng = self.rng
        tiles = [e for e in self.pool if e.kind == "tile" and (e.uses_acc or not need_acc)]
        x = rng.choice(tiles) if tiles and rng.random() < 0.5 else self.gen(depth)
        if x.kind != "tile" or (need_acc and not x.uses_acc):
            x = self.emit(f"{x.code} + acc", [x, _ACC], x.bound + LEAF_BOUND, False, guard=True)
        return x


def random_program(seed: int, family: Family = GEMM) -> Program:
    """The random program of ``seed`` (the same program for the same seed, on any machine) for
    ``family``'s kernel."""
    rng = random.Random(seed)
    b = _Builder(rng, family)
    d_dtype = rng.choices(family.d_dtypes, weights=family.d_weights)[0]
    quantize_d = d_dtype is FP8 and rng.random() < 0.5
    d = b.tile(MAX_DEPTH - quantize_d, need_acc=True)
    if quantize_d:
        # Quantizing an unstable value is fine here (D's own rounding is what the fp8 check
        # tolerates) but not upstream of anything else: keep it out of the reuse pool.
        d = b.emit(f"ops.quantize({d.code}, {b.const(0.5, 4.0)})", [d], 448.0 * (1 + 2.0**-4), False, reusable=False)
    returned = {"D": d.code}
    outputs = [Output("D", "D", d_dtype, d.bound)]
    for i in range(rng.choices((0, 1, 2), weights=(5, 3, 2))[0]):
        x = b.tile(rng.randint(1, 4))
        returned[f"aux{i}"] = x.code
        dtype = rng.choice(family.aux_dtypes)
        outputs.append(Output(f"aux{i}", "aux", dtype, x.bound, outs=family.outs and rng.random() < 0.5))
    for i in range(rng.choices((0, 1, 2, 3), weights=(4, 3, 2, 1))[0]):
        op = rng.choice(REDUCTION_OPS)
        x = b.tile(rng.randint(0, 4))
        returned[f"{op}{i}"] = f"ops.{op}({x.code})"
        outputs.append(Output(f"{op}{i}", op, torch.float32, x.bound))

    params = ", ".join(("acc", *(o.name for o in b.operands)))
    body = "\n".join(b.lines)
    ret = ", ".join(f"{k!r}: {v}" for k, v in returned.items())
    source = f"def fuzz_{seed}({params}):\n{body}\n    return {{{ret}}}\n"
    depth = max(e.depth for e in b.pool) if b.pool else 0
    if family is not GEMM:
        return Program(seed=seed, source=source, operands=tuple(b.operands), outputs=tuple(outputs), depth=depth,
                       config=(), ab_dtype=rng.choice((torch.bfloat16, torch.float16)), b_major="",
                       family=family.name)  # fmt: skip
    config = {
        "tile_n": rng.choice((64, 128, 128, 256)),
        "persistent": rng.random() < 0.6,
        "cluster_m": rng.choice((1, 1, 2)),
        "raster_along_m": rng.random() < 0.5,
        "schedule": rng.choice(("cooperative", "pingpong")),
    }
    if config["schedule"] == "pingpong":
        config["persistent"] = True  # its warpgroups take alternate tiles of a persistent CTA
    program = Program(
        seed=seed, source=source, operands=tuple(b.operands), outputs=tuple(outputs), depth=depth,
        config=tuple(sorted(config.items())), ab_dtype=rng.choice((torch.bfloat16, torch.float16) * 2 + FP8_INPUTS),
        b_major=rng.choice(("n", "k")),
    )  # fmt: skip
    if program.fp8:
        program = replace(program, b_major="k")  # WGMMA reads 8-bit operands K-major
    return _fit_tile_n(program)


def _fit_tile_n(program: Program) -> Program:
    """``program`` with its pinned tile_n narrowed until the epilogue's buffers fit in shared memory."""
    from epicute.epilogue.dtypes import TORCH_TO_IR
    from epicute.epilogue.fusion import EpilogueFusion
    from epicute.epilogue.tracer import as_epilogue
    from epicute.errors import ConfigError
    from epicute.gemm import GemmProblem
    from epicute.gemm.heuristics import choose_config

    dtypes = {o.name: "fp32" if o.dtype is None else TORCH_TO_IR[o.dtype] for o in program.operands}
    kinds = {o.name: o.kind for o in program.operands}
    graph = as_epilogue(program.fn).trace(kinds, dtypes, program.out_dtypes(), d_dtype=program.d_dtype)
    fusion = EpilogueFusion(graph, tuple((o.name, o.kind, dtypes[o.name]) for o in program.operands))
    problem = GemmProblem(1001, 1000, 64, ab_dtype=TORCH_TO_IR[program.ab_dtype], d_dtype=TORCH_TO_IR[program.d_dtype],
                          a_major="k", b_major=program.b_major or "n")  # fmt: skip
    config = dict(program.config)
    while True:
        try:
            choose_config(problem, epilogue=fusion.buffers(), **config)
            return replace(program, config=tuple(sorted(config.items())))
        except ConfigError:
            if config["tile_n"] == 64:
                raise
            config["tile_n"] //= 2


def random_shape(program: Program, case_seed: int) -> Shape:
    """Ragged M (odd), N a multiple of 8 (16 when D is fp8), small K, L in 1..3."""
    rng = random.Random(case_seed)
    step = 16 if program.d_dtype is FP8 else 8
    m = rng.choice((1, 17, 129, 255, 1001, rng.randrange(1, 1100, 2)))
    n = rng.choice((step, 3 * step, 17 * step, 33 * step, 1000 // step * step, rng.randrange(step, 1100, step)))
    # fp8: K a multiple of 16 (16-byte TMA rows) and at most 64, so the exact sums need at most 12 bits
    # of the fp8 WGMMA's reduced-precision accumulator.
    k = rng.choice((16, 32, 48, 64) if program.fp8 else (8, 16, 24, 40, 64, 136, 256))
    l = 1 if m * n > 400_000 else rng.choice((1, 1, 2, 3))
    return Shape(m, n, k, l, batched=l > 1 or rng.random() < 0.3)


@dataclass
class Inputs:
    a: torch.Tensor
    b: torch.Tensor
    operands: dict[str, object]
    out: torch.Tensor | None
    outs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: fp8 inputs' a_scale and b_scale (powers of two: the scaled accumulator stays exact, |acc| <= 4)
    scales: dict[str, object] = field(default_factory=dict)


def _grid(gen: torch.Generator, shape, dtype, scale: float = 1.0) -> torch.Tensor:
    """Multiples of 1/8 in [-1, 1] (times ``scale``, a power of two): exact products and sums."""
    return (torch.randint(-8, 9, shape, generator=gen) * (scale / 8)).to(dtype)


def make_inputs(program: Program, shape: Shape, case_seed: int, device: str) -> Inputs:
    """Fresh random a, b and operands for one case (values in [-3, 3]), poisoned outputs."""
    gen = torch.Generator().manual_seed(case_seed)
    rng = random.Random(case_seed ^ 0x5EED)
    m, n, k, l = shape.m, shape.n, shape.k, shape.l
    lead = (l,) if shape.batched else ()
    a = _grid(gen, lead + (m, k), program.ab_dtype).to(device)
    # |acc| <= K * 1 * b_scale <= LEAF_BOUND.
    b_scale = 2.0 ** -max(0, math.ceil(math.log2(k)) - 2)
    if program.b_major == "n":
        b = _grid(gen, lead + (k, n), program.ab_dtype, b_scale).to(device)
    else:
        b = _grid(gen, lead + (n, k), program.ab_dtype, b_scale).to(device).transpose(-1, -2)

    def values(*dims, dtype):
        return torch.randn(dims, generator=gen).clamp(-3.0, 3.0).to(device=device, dtype=dtype)

    operands: dict[str, object] = {}
    for op in program.operands:
        if op.kind == "scalar":
            v = round(rng.choice((-1, 1)) * rng.uniform(0.25, 3.0), 4)
            form = rng.choice(_SCALAR_FORMS)
            operands[op.name] = {
                "float": v,
                "0-d": torch.tensor(v, device=device),
                "1-element": torch.tensor([v], device=device),
                "pinned": epicute.Scalar(v),
            }[form]
            continue
        per_batch = shape.batched and rng.random() < 0.7
        if op.kind == "tile":
            t = values(l, m, n, dtype=op.dtype) if per_batch else values(m, n, dtype=op.dtype)
            # (M, N) reads as a row vector (L, N) when M == L, and (1, N) narrows to one.
            operands[op.name] = epicute.Tile(t) if rng.random() < 0.5 or m in (1, l) else t
            continue
        extent = n if op.kind == "row" else m
        if rng.random() < 0.25:  # vectors are read element by element: any strides work
            t = values(*((l,) if per_batch else ()), 2 * extent, dtype=op.dtype)[..., ::2]
        else:
            t = values(*((l,) if per_batch else ()), extent, dtype=op.dtype)
        if op.kind == "col" and rng.random() < 0.3:
            t = t.unsqueeze(-1)  # (M, 1) / (L, M, 1)
        operands[op.name] = (epicute.RowVector if op.kind == "row" else epicute.ColVector)(t)

    nan = float("nan")
    out = torch.full(lead + (m, n), nan, device=device, dtype=program.d_dtype) if rng.random() < 0.7 else None
    outs = {
        o.name: torch.full(lead + (m, n), nan, device=device, dtype=o.dtype) for o in program.outputs if o.outs
    }  # fmt: skip
    scales = {}
    if program.fp8:

        def scale(extent: int):
            form = rng.choice(("float", "tensor", "vector"))
            if form == "vector":  # rowwise: one power of two per row of A / column of B
                return torch.tensor([rng.choice((0.5, 1.0)) for _ in range(extent)], device=device)
            value = rng.choice((0.5, 1.0))
            return value if form == "float" else torch.tensor(value, device=device)

        scales = {"a_scale": scale(m), "b_scale": scale(n)}
        if isinstance(scales["a_scale"], torch.Tensor) and scales["a_scale"].dim() and shape.batched:
            scales["a_scale"] = scales["a_scale"].expand(l, m).contiguous()
        if isinstance(scales["b_scale"], torch.Tensor) and scales["b_scale"].dim() and shape.batched:
            scales["b_scale"] = scales["b_scale"].expand(l, n).contiguous()
    return Inputs(a, b, operands, out, outs, scales)


def expected_shape(role: str, shape: Shape) -> tuple[int, ...]:
    lead = (shape.l,) if shape.batched else ()
    if role in ("D", "aux"):
        return lead + (shape.m, shape.n)
    if role == "amax":
        return ()
    return lead + ((shape.m,) if role.startswith("row_") else (shape.n,))


def fp8_mismatch(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why fp8 e4m3 ``got`` is not ``ref`` up to rare one-step rounding flips (module docstring), or None."""
    g, r = got.cpu().double(), ref.cpu().double()
    if not torch.isfinite(g).all():
        return f"{int((~torch.isfinite(g)).sum())} non-finite elements"
    # One e4m3 step at a magnitude: 2^(e - 3) for normal values 2^e..., 2^-9 below 2^-6 (subnormals).
    magnitude = torch.maximum(g.abs(), r.abs()).clamp_min(2.0**-6)
    step = torch.exp2(torch.floor(torch.log2(magnitude)) - 3)
    off = (g - r).abs()
    if (off > step).any():
        i = int(torch.argmax(off / step))
        return f"element {i} is {g.flatten()[i].item()} but the reference has {r.flatten()[i].item()} (> one fp8 step)"
    flips, allowed = int((off > 0).sum()), max(2, math.ceil(FP8_FLIP_FRACTION * g.numel()))
    if flips > allowed:
        return f"{flips} of {g.numel()} elements are one fp8 step off (allowed: {allowed})"
    return None


def check_output(out: Output, got: torch.Tensor, ref: torch.Tensor, shape: Shape) -> str | None:
    """Why ``got`` (the kernel's output ``out``) does not match ``ref``, or None."""
    expected = expected_shape(out.role, shape)
    if tuple(got.shape) != expected or got.dtype != out.dtype:
        return f"{out.name}: {tuple(got.shape)} {got.dtype}, expected {expected} {out.dtype}"
    if out.dtype is FP8:
        why = fp8_mismatch(got, ref)
        return f"{out.name}: {why}" if why else None
    tol = TOLERANCE[out.dtype] if out.role in ("D", "aux") else REDUCTION_TOLERANCE
    err = rel_err(got.float().cpu(), ref.float().cpu())
    return f"{out.name}: rel err {err:.3e} > {tol:.0e}" if not err < tol else None


def _as_dict(result) -> dict[str, torch.Tensor]:
    return result if isinstance(result, dict) else {"D": result}


def run_case(program: Program, case_seed: int, device: str = "cuda", backend: str = "kernel") -> list[str]:
    """Run one case through ``backend`` and the reference; the problems found (empty: it passed)."""
    shape = random_shape(program, case_seed)
    inp = make_inputs(program, shape, case_seed, device)
    config = dict(program.config)

    def run():
        return _as_dict(epicute.gemm(
            inp.a, inp.b, epilogue=program.fn, out=inp.out, outs=inp.outs, out_dtypes=program.out_dtypes(False),
            backend=backend, config=config, **inp.scales, **inp.operands,
        ))  # fmt: skip

    got = run()
    ref = _as_dict(epicute.gemm(inp.a, inp.b, epilogue=program.fn, out_dtypes=program.out_dtypes(), backend="reference",
                                **inp.scales, **inp.operands))  # fmt: skip
    names = [o.name for o in program.outputs]
    if sorted(got) != sorted(names) or sorted(ref) != sorted(names):
        return [f"outputs: got {sorted(got)}, reference {sorted(ref)}, the program returns {sorted(names)}"]
    problems = []
    targets = {"D": inp.out, **inp.outs}
    for o in program.outputs:
        target = targets.get(o.name)
        if target is not None and got[o.name].data_ptr() != target.data_ptr():
            problems.append(f"{o.name}: not written into the preallocated tensor")
        why = check_output(o, got[o.name], ref[o.name], shape)
        if why:
            problems.append(why)
    reductions = [o.name for o in program.outputs if o.role in REDUCTION_OPS]
    if reductions:
        again = run()
        problems += [f"{r}: differs bitwise between two runs" for r in reductions if not torch.equal(again[r], got[r])]
    return problems


def describe(program: Program, case_seed: int, problems: list[str]) -> str:
    """A failure report: seeds, shape, configuration, the program's source and the problems."""
    shape = random_shape(program, case_seed)
    operands = ", ".join(f"{o.name}: {o.kind} {o.dtype}" for o in program.operands) or "none"
    return (
        f"program seed {program.seed}, case seed {case_seed} "
        f"(rerun: python -m tests.gemm.epilogue_fuzz {program.seed} {case_seed})\n"
        f"shape {shape}, a/b {program.ab_dtype} b_major={program.b_major}, config {dict(program.config)}"
        + (" (fp8: a_scale, b_scale powers of two)" if program.fp8 else "")
        + "\n"
        f"operands {operands}; outputs {[(o.name, str(o.dtype), 'outs' if o.outs else '') for o in program.outputs]}\n"
        f"{program.source}" + "\n".join(f"  - {p}" for p in problems)
    )


def cases(count: int, base_seed: int, shapes_per_program: int = 3, make_program=None) -> list[tuple[Program, int]]:
    """``count`` (program, case seed) pairs: each program (one kernel compile) runs on several shapes.
    ``make_program(seed)`` draws a program (default: a GEMM's, :func:`random_program`)."""
    make_program = make_program or random_program
    rng = random.Random(base_seed)
    result: list[tuple[Program, int]] = []
    while len(result) < count:
        program = make_program(rng.getrandbits(32))
        result += [(program, rng.getrandbits(32)) for _ in range(min(shapes_per_program, count - len(result)))]
    return result


def fuzz_from_env(label: str, default_cases: int, cases, run_case, describe) -> tuple[str, list[str]]:
    """A GPU fuzz run: ``EPICUTE_FUZZ_CASES`` cases (``default_cases``) of ``cases(count, seed)``,
    seeded by ``EPICUTE_FUZZ_SEED`` (fresh by default); the summary line and the failure reports."""
    count = int(os.environ.get("EPICUTE_FUZZ_CASES", str(default_cases)))
    base_seed = int(os.environ.get("EPICUTE_FUZZ_SEED") or random.SystemRandom().getrandbits(32))
    pairs = cases(count, base_seed)
    failures = run_fuzz(pairs, run_case, describe)
    return f"{label}: {len(pairs)} cases, {len(failures)} failures (EPICUTE_FUZZ_SEED={base_seed})", failures


def run_fuzz(pairs: list[tuple[Program, int]], run_case, describe) -> list[str]:
    """Every case of ``pairs`` through ``run_case``; the failure reports (``describe``). A case that
    raises fails alone: the others still run."""
    failures = []
    for program, case_seed in pairs:
        try:
            problems = run_case(program, case_seed)
        except Exception as e:  # noqa: BLE001 -- a crash fails this case; the others still run
            problems = [f"raised {type(e).__name__}: {e}"]
        if problems:
            failures.append(describe(program, case_seed, problems))
    return failures


def rerun(argv: list[str], make_program, run_case, describe) -> None:
    """``python -m <fuzz module> PROGRAM_SEED CASE_SEED``: one case again, reported."""
    program_seed, case_seed = int(argv[1]), int(argv[2])
    program = make_program(program_seed)
    found = run_case(program, case_seed)
    print(describe(program, case_seed, found) if found else f"ok: program {program_seed}, case {case_seed}")


if __name__ == "__main__":
    rerun(sys.argv, random_program, run_case, describe)
