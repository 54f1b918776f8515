"""Turning a validated call into a kernel launch.

Per call: look up the plan (cached per problem), look up the compiled variant
(cached per variant), launch. Problem sizes are dynamic in the compiled kernel,
so a new shape costs a plan, never a compile, unless it picks a new variant.

Both lookups are ``lru_cache`` hits keyed on small frozen dataclasses, so a
cached call costs a few microseconds of Python before the TVM-FFI launch
(``bench/runtime.py`` measures it).
"""

from __future__ import annotations

import functools

import torch

from epicute.gemm import GemmPlan, GemmProblem, plan_gemm
from epicute.gemm.compile import GEMM_CACHE, GemmVariant
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.gemm.validate import GemmCall
from epicute.runtime.target import Target


@functools.lru_cache(maxsize=4096)
def cached_plan(
    problem: GemmProblem, overrides: tuple = (), epilogue: EpilogueBuffers = NO_EPILOGUE, target: Target | None = None
) -> GemmPlan:
    """:func:`plan_gemm` for ``target`` (None: the current one), once per argument set."""
    return plan_gemm(problem, target, epilogue=epilogue, **dict(overrides))


@functools.lru_cache(maxsize=4096)
def kernel_for(plan: GemmPlan, fusion=None):
    """The compiled kernel of ``plan`` (and fusion): memory, disk or a compile, once per process."""
    return GEMM_CACHE.get(variant_of(plan, fusion))


def variant_of(plan: GemmPlan, fusion=None) -> GemmVariant:
    """What ``plan`` compiles: its config, dtypes and majors for its target's arch (not its SM count,
    which reaches the kernel at launch as ``plan.max_active_clusters``)."""
    p = plan.problem
    b_dtype = p.b_dtype if p.b_dtype != p.ab_dtype else ""
    return GemmVariant(
        plan.config, p.ab_dtype, p.d_dtype, p.a_major, p.b_major, plan.target.arch, fusion, b_dtype, p.block_scaled
    )


def _zero_k_operands(call: GemmCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero A and B with K = one 16-byte row, in the call's majors: K = 0 with an epilogue is the
    epilogue of a zero accumulator, and a TMA descriptor cannot describe an empty K."""
    p, a = call.problem, call.a
    k = 16 // a.element_size()

    def zeros(rows: int, contiguous: int) -> torch.Tensor:  # (L, rows, contiguous), row strides 16-byte aligned
        padded = -(-contiguous // k) * k
        return torch.zeros(p.l, rows, padded, dtype=a.dtype, device=a.device)[:, :, :contiguous]

    a0 = zeros(p.m, k) if p.a_major == "k" else zeros(k, p.m).transpose(1, 2)
    b0 = zeros(k, p.n) if p.b_major == "n" else zeros(p.n, k).transpose(1, 2)
    return a0, b0


def _block_scales(call: GemmCall) -> tuple:
    """The mainloop's blockwise scales, ``(A (L, M, KB), B (L, NB, KB))``, or ``()``. With K = 0 the zero
    operands of :func:`_zero_k_operands` are one k-tile long, so each gets a block of ones."""
    scales = call.block_scales
    if scales is None:
        return ()
    if call.problem.k == 0:
        return tuple(s.new_ones(*s.shape[:-1], 1) for s in (scales.a, scales.b))
    return scales.a, scales.b


def launch_gemm(
    call: GemmCall,
    plan: GemmPlan,
    fusion=None,
    epi_inputs: tuple = (),
    epi_scalars: tuple = (),
    aux: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Run ``call`` with ``plan`` (and the fused epilogue, if any).

    Returns D in the caller's rank; with an epilogue that has more outputs, a
    dict of all of them (aux tiles from ``aux``, reductions finalized here).
    """
    p = call.problem
    out3 = call.out
    if out3 is None:
        out3 = torch.empty((p.l, p.m, p.n), dtype=call.out_dtype, device=call.a.device)
    aux = aux or {}
    workspaces = {}
    group_scales = None
    if fusion is not None:
        workspaces = {
            r.name: torch.empty(r.workspace_shape(p.l, p.m, p.n, plan.config.tile_n), dtype=torch.float32,
                                device=call.a.device)
            for r in fusion.reductions
        }  # fmt: skip
        if fusion.group_quant is not None:  # (L, groups, M): M-major scales, handed out as (L, M, groups)
            group_scales = torch.empty(fusion.group_quant.scales_shape(p.l, p.m, p.n), dtype=torch.float32,
                                       device=call.a.device)  # fmt: skip
    if p.m and p.n:
        if p.k == 0 and fusion is None:
            out3.zero_()
        else:
            a, b = (call.a, call.b) if p.k else _zero_k_operands(call)
            kernel = kernel_for(plan, fusion)
            epi_tensors = epi_inputs + tuple(aux.values()) + tuple(workspaces.values())
            epi_tensors += () if group_scales is None else (group_scales,)
            kernel(a, b, out3, epi_tensors, epi_scalars, _block_scales(call), plan.max_active_clusters)
    d = out3 if call.batched else out3[0]  # out3 is the caller's out (viewed 3-D) when given
    if fusion is None or set(fusion.output_dtypes) == {"D"}:
        return d
    results = {"D": d}
    for name, t in aux.items():
        results[name] = t if call.batched else t[0]
    for r in fusion.reductions:
        value = r.finalize(workspaces[r.name])
        results[r.name] = value if call.batched or r.axis == "all" else value[0]
    if group_scales is not None:
        scales = group_scales.transpose(1, 2)
        results[fusion.group_quant.scales] = scales if call.batched else scales[0]
    return results
