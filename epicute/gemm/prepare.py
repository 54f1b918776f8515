"""One path from a GEMM call to its kernel: :func:`prepare`.

Every entry point (``epicute.gemm`` with either backend, ``prepare_gemm``, ``explain``,
``tune``, ``epicute compile``, ``epicute explain gemm`` and the torch fake implementation)
describes its call as a :class:`GemmRequest` (no tensors: shapes, dtypes,
majors, the epilogue and its operands' kinds and dtypes, output dtypes, config
pins) and gets everything the launch uses from :func:`prepare`: the traced
graph with every output's stored dtype settled, the fusion the kernel runs, and
the plan. So what ``explain`` prints is the plan, chain and shared memory of the
kernel that runs, by construction.

:func:`lower_epilogue` is the first half, without planning: the torch fake
implementation needs output dtypes for symbolic sizes, which cannot be planned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from epicute.epilogue.dtypes import IR_TO_TORCH, ir_dtype
from epicute.epilogue.fusion import EpilogueFusion
from epicute.epilogue.gated import output_columns
from epicute.epilogue.graph import Graph
from epicute.errors import AlignmentError
from epicute.gemm import GemmPlan, GemmProblem
from epicute.gemm.smem import NO_EPILOGUE
from epicute.runtime.checks import TMA_ALIGN_BYTES
from epicute.runtime.target import Target, resolve_target

if TYPE_CHECKING:
    from epicute.epilogue.tracer import Epilogue
    from epicute.gemm.compile import GemmVariant


@dataclass(frozen=True)
class GemmRequest:
    """What a GEMM call asks for, with no tensors in it.

    ``problem.d_dtype`` is D's requested dtype (``a``'s when nothing asked);
    ``d_explicit`` says whether the caller fixed it (``out``, ``out_dtype`` or
    ``out_dtypes["D"]``) or an epilogue's own final cast may choose it.
    ``operands`` is ``(name, kind, IR dtype)`` per epilogue operand in parameter
    order; ``out_dtypes`` and ``outs_dtypes`` (preallocated aux tiles) map output
    names to IR dtypes; ``overrides`` are sorted ``(field, value)`` config pins;
    ``target`` is the GPU to plan for (None, the default: the current one, i.e. the visible
    GPU, else an H100 SXM; see :func:`epicute.runtime.target.current_target`).
    """

    problem: GemmProblem
    epilogue: Epilogue | None = None
    operands: tuple[tuple[str, str, str], ...] = ()
    d_explicit: bool = False
    out_dtypes: tuple[tuple[str, str], ...] = ()
    outs_dtypes: tuple[tuple[str, str], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()
    target: Target | None = None

    def signature(self) -> tuple:
        """Every field but the epilogue object, whose identity changes from call to call (a caller that
        memoizes keys the epilogue by what its trace depends on instead)."""
        return tuple(getattr(self, name) for name in _SIGNATURE_FIELDS)


_SIGNATURE_FIELDS = tuple(f.name for f in fields(GemmRequest) if f.name != "epilogue")


@dataclass(frozen=True)
class LoweredEpilogue:
    """An epilogue traced for one request: its graph and the fusion the kernel runs."""

    graph: Graph
    fusion: EpilogueFusion

    @property
    def d_dtype(self) -> str:
        return self.fusion.output_dtypes["D"]

    @property
    def aux_outputs(self) -> tuple[str, ...]:
        return self.fusion.aux_outputs


@dataclass(frozen=True)
class PreparedGemm:
    """Everything the launch of one request uses; ``plan.problem.d_dtype`` is D's stored dtype."""

    plan: GemmPlan
    #: the traced graph (the caller's view) and the fusion the kernel runs (over D^T under ``swap_ab``)
    epilogue: LoweredEpilogue | None = None

    @property
    def fusion(self) -> EpilogueFusion | None:
        return None if self.epilogue is None else self.epilogue.fusion

    @property
    def d_torch_dtype(self):
        return IR_TO_TORCH[self.plan.problem.d_dtype]

    @property
    def output_dtypes(self) -> dict[str, str]:
        """Every output's stored IR dtype, D first."""
        if self.epilogue is None:
            return {"D": self.plan.problem.d_dtype}
        return self.epilogue.fusion.output_dtypes

    def variant(self) -> GemmVariant:
        """The compiled kernel this request runs (its cache key names it)."""
        from epicute.gemm.launch import variant_of

        return variant_of(self.plan, self.fusion)


def lower_epilogue(request: GemmRequest) -> LoweredEpilogue:
    """Trace ``request.epilogue`` with every output's stored dtype settled (see ``trace_for_gemm``)."""
    from epicute.epilogue.tracer import trace_for_gemm

    kinds = {name: _Operand(kind, dtype) for name, kind, dtype in request.operands}
    graph = trace_for_gemm(
        request.epilogue, kinds, request.problem.d_dtype, request.d_explicit,
        dict(request.out_dtypes), dict(request.outs_dtypes),
    )  # fmt: skip
    return LoweredEpilogue(graph, EpilogueFusion(graph, request.operands))


def prepare(request: GemmRequest) -> PreparedGemm:
    """The epilogue lowered, D's stored dtype settled, the outputs checked, the problem planned."""
    from epicute.gemm.launch import cached_plan

    target = resolve_target(request.target)
    if request.epilogue is None:
        return _prepare_plain(request.problem, request.overrides, target)
    lowered = lower_epilogue(request)
    problem = replace(request.problem, d_dtype=lowered.d_dtype)
    _check_aux_rows(lowered, output_columns(problem.n, lowered.fusion.gated))
    plan = cached_plan(problem, request.overrides, lowered.fusion.buffers(), target)
    if plan.config.swap_ab:  # the kernel computes D^T: its epilogue runs over the transposed tile
        lowered = replace(lowered, fusion=lowered.fusion.transposed)
    return PreparedGemm(plan, lowered)


@functools.lru_cache(maxsize=4096)
def _prepare_plain(problem: GemmProblem, overrides: tuple, target: Target) -> PreparedGemm:
    """A plain GEMM's preparation: its plan (one object per argument set, so its kernel lookup is cheap)."""
    from epicute.gemm.launch import cached_plan

    return PreparedGemm(cached_plan(problem, overrides, NO_EPILOGUE, target))


def _check_aux_rows(lowered: LoweredEpilogue, n: int) -> None:
    """Aux tiles are stored by TMA like D: each row must be a whole number of 16-byte units."""
    if not n:
        return
    for name in lowered.aux_outputs:
        dtype = lowered.fusion.output_dtypes[name]
        step = TMA_ALIGN_BYTES // IR_TO_TORCH[dtype].itemsize
        if n % step:
            raise AlignmentError(
                f"aux output {name!r} is {IR_TO_TORCH[dtype]}: TMA stores its rows only if N={n} is a multiple of "
                f"{step}; pad N, or store it in a wider dtype (out_dtypes={{{name!r}: torch.bfloat16}})"
            )


@dataclass(frozen=True)
class _Operand:
    """An operand as tracing sees it: kind and dtype, no value."""

    kind: str
    dtype: str


def ir_items(dtypes: dict | None, what: str) -> tuple[tuple[str, str], ...]:
    """``{name: torch dtype or IR name}`` as sorted ``(name, IR dtype)`` pairs (a request field)."""
    return tuple(sorted((name, ir_dtype(dtype, f"{what}[{name!r}]")) for name, dtype in (dtypes or {}).items()))


__all__ = ["GemmRequest", "LoweredEpilogue", "PreparedGemm", "ir_items", "lower_epilogue", "prepare"]
