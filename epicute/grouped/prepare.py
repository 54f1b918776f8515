"""One path from a grouped GEMM call to its kernel: :func:`prepare` (the call, ``explain_grouped`` and
the reference backend all go through it), as :mod:`epicute.gemm.prepare` is for the dense GEMM, whose
epilogue lowering it shares."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.epilogue.tracer import TraceMemo
from epicute.errors import EpilogueError
from epicute.gemm.prepare import GemmRequest, LoweredEpilogue, _check_aux_rows, lower_epilogue
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.grouped.plan import GroupedPlan, GroupedProblem, plan_grouped
from epicute.runtime.target import Target, resolve_target

if TYPE_CHECKING:
    from epicute.epilogue.tracer import Epilogue
    from epicute.grouped.compile import GroupedVariant


@dataclass(frozen=True)
class GroupedRequest:
    """What a grouped GEMM call asks for, with no tensors in it (fields as in
    :class:`~epicute.gemm.prepare.GemmRequest`)."""

    problem: GroupedProblem
    epilogue: Epilogue | None = None
    operands: tuple[tuple[str, str, str], ...] = ()
    d_explicit: bool = False
    out_dtypes: tuple[tuple[str, str], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()
    target: Target | None = None

    def signature(self) -> tuple:
        """Every field but the epilogue object (see :meth:`epicute.gemm.prepare.GemmRequest.signature`)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "epilogue")


@dataclass(frozen=True)
class PreparedGrouped:
    """Everything the launch of one grouped request uses; ``plan.problem.d_dtype`` is D's stored dtype."""

    plan: GroupedPlan
    epilogue: LoweredEpilogue | None = None

    @property
    def fusion(self):
        return None if self.epilogue is None else self.epilogue.fusion

    @property
    def d_torch_dtype(self):
        return IR_TO_TORCH[self.plan.problem.d_dtype]

    def variant(self) -> GroupedVariant:
        from epicute.grouped.launch import variant_of

        return variant_of(self.plan, self.fusion)


#: Prepared epilogue calls (see TraceMemo): a repeat call neither traces nor plans.
_PREPARED = TraceMemo()


def prepare(request: GroupedRequest) -> PreparedGrouped:
    """The epilogue lowered (through the dense GEMM's tracing), D's dtype settled, the problem planned; once per
    epilogue trace and request signature."""
    if request.epilogue is None:
        return _prepare(request)  # a plan-cache hit
    return _PREPARED.get(request.epilogue, request.signature(), lambda: _prepare(request))


def _prepare(request: GroupedRequest) -> PreparedGrouped:
    target = resolve_target(request.target)
    problem = request.problem
    if request.epilogue is None:
        return PreparedGrouped(_plan(problem, request.overrides, NO_EPILOGUE, target))
    lowered = lower_epilogue(GemmRequest(
        problem.mean_group(), request.epilogue, request.operands, request.d_explicit, request.out_dtypes,
    ))  # fmt: skip
    fusion = lowered.fusion
    if fusion.group_quant is not None:
        raise EpilogueError(
            "quantize_groups in a grouped GEMM's epilogue is not supported yet: quantize the returned tile with "
            "epicute.gemm's epilogue or torch"
        )
    problem = replace(problem, d_dtype=lowered.d_dtype)
    _check_aux_rows(lowered, problem.d_n)
    return PreparedGrouped(_plan(problem, request.overrides, fusion.buffers(), target), lowered)


@functools.lru_cache(maxsize=4096)
def _plan(problem: GroupedProblem, overrides: tuple, epilogue: EpilogueBuffers, target: Target) -> GroupedPlan:
    return plan_grouped(problem, target, epilogue, **dict(overrides))


__all__ = ["GroupedRequest", "PreparedGrouped", "prepare"]
