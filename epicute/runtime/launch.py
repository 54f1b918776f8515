"""Turning a validated call into a kernel launch.

Per call: look up the plan (cached per problem), look up the compiled variant
(cached per variant), launch. Problem sizes are dynamic in the compiled kernel,
so a new shape costs a plan, never a compile, unless it picks a new variant.
"""

from __future__ import annotations

import functools

import torch

from epicute.plan import GemmPlan, GemmProblem, plan_gemm
from epicute.runtime.compile import GEMM_CACHE, GemmVariant
from epicute.runtime.validate import GemmCall


@functools.lru_cache(maxsize=4096)
def cached_plan(problem: GemmProblem, overrides: tuple = ()) -> GemmPlan:
    return plan_gemm(problem, **dict(overrides))


def variant_of(plan: GemmPlan, fusion=None) -> GemmVariant:
    p = plan.problem
    return GemmVariant(
        plan.config, p.ab_dtype, p.d_dtype, p.a_major, p.b_major, plan.max_active_clusters, fusion=fusion
    )


def launch_gemm(
    call: GemmCall, plan: GemmPlan, fusion=None, epi_tensors: tuple = (), epi_scalars: tuple = ()
) -> torch.Tensor:
    """Run ``call`` with ``plan`` (and the fused epilogue, if any); returns D in the caller's rank."""
    p = call.problem
    out3 = call.out
    if out3 is None:
        out3 = torch.empty((p.l, p.m, p.n), dtype=call.out_dtype, device=call.a.device)
    if p.m and p.n:
        if p.k == 0 and fusion is None:
            out3.zero_()
        else:
            # K = 0 with an epilogue still runs the kernel: no k-tiles, acc stays zero.
            kernel = GEMM_CACHE.get(variant_of(plan, fusion))
            kernel(call.a, call.b, out3, epi_tensors, epi_scalars)
    if call.out is not None:  # validation made its rank match the operands'
        return call.out
    return out3 if call.batched else out3[0]
