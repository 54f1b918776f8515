"""Turning a validated grouped call into a launch: the compiled variant (cached per plan), D and the
aux outputs allocated, the kernel called with the offsets as they are on the GPU."""

from __future__ import annotations

import functools

import torch

from epicute.grouped.compile import GROUPED_CACHE, GroupedVariant
from epicute.grouped.plan import GroupedPlan
from epicute.grouped.validate import GroupedCall


def variant_of(plan: GroupedPlan, fusion=None) -> GroupedVariant:
    p = plan.problem
    return GroupedVariant(plan.config, p.ab_dtype, p.d_dtype, p.a_major, p.b_major, plan.target.arch, fusion,
                          p.b_dtype, p.block_scaled, ragged_k=p.ragged == "k", gathered=p.gathered)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def kernel_for(plan: GroupedPlan, fusion=None):
    """The compiled kernel of ``plan`` (and fusion): memory, disk or a compile, once per process."""
    return GROUPED_CACHE.get(variant_of(plan, fusion))


def _zero_k(call: GroupedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """K = 0: zero A and B one 16-byte K row long (a TMA descriptor cannot describe an empty K), so an
    epilogue sees a zero accumulator (variable K: in its majors; every group is empty, so nothing is read)."""
    p, a = call.problem, call.a
    k = 16 // a.element_size()
    if p.ragged == "k":
        return a.new_zeros(1, k, p.total_m).transpose(1, 2), a.new_zeros(1, k, p.n)
    b = call.b.new_zeros(p.groups, p.n, k).transpose(1, 2) if p.b_major == "k" else call.b.new_zeros(p.groups, k, p.n)
    return a.new_zeros(1, p.total_m, k), b


def _block_scales(call: GroupedCall) -> tuple:
    """The mainloop's blockwise scales as the kernel reads them, A's ``(G, total_M, KB)`` (one tensor over every
    group's rows: a zero group stride) and B's ``(G, NB, KB)``, or ``()``. K = 0: one block of ones each, for
    the one zero k-tile of :func:`_zero_k`."""
    scales = call.block_scales
    if scales is None:
        return ()
    a, b = scales.a, scales.b
    if call.problem.k == 0:
        a, b = a.new_ones(1, a.shape[1], 1), b.new_ones(b.shape[0], b.shape[1], 1)
    return a.expand(call.problem.groups, -1, -1), b


def run_grouped(call: GroupedCall, plan: GroupedPlan, fusion=None, epi_inputs: tuple = (), epi_scalars: tuple = (),
                aux: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Launch ``call`` with ``plan``; every output by name, ``(total_M, N)`` (``N / 2`` gated), D first."""
    p = call.problem
    out3 = call.out
    if out3 is None:
        out3 = torch.empty(p.out_shape, dtype=call.out_dtype, device=call.a.device)
    aux = dict(aux or {})
    if p.total_m and p.n:
        if p.k == 0 and fusion is None:
            out3.zero_()
        else:
            a, b = (call.a, call.b) if p.k else _zero_k(call)
            epi_tensors = tuple(epi_inputs) + tuple(aux.values())
            index_args = (call.offsets,) if call.a_index is None else (call.offsets, call.a_index)
            kernel_for(plan, fusion)(a, b, out3, *index_args, epi_tensors, tuple(epi_scalars), _block_scales(call),
                                     plan.max_active_clusters)  # fmt: skip
    if p.ragged == "k":
        return {"D": out3, **aux}
    return {"D": out3[0], **{name: t[0] for name, t in aux.items()}}


__all__ = ["kernel_for", "run_grouped", "variant_of"]
