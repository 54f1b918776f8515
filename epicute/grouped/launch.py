"""Turning a validated grouped call into a launch: the compiled variant (cached per plan), D and the
aux outputs allocated, the kernel called with the offsets as they are on the GPU."""

from __future__ import annotations

import functools
import math

import torch

from epicute.epilogue.fusion import ROWS_PER_WARP
from epicute.epilogue.gated import output_columns, stored_columns
from epicute.epilogue.graph import REDUCTION_IDENTITY, UP_OUTPUT
from epicute.grouped.compile import GROUPED_CACHE, GroupedVariant
from epicute.grouped.plan import GroupedPlan
from epicute.grouped.validate import GroupedCall
from epicute.sm90.tile_grid import ceil_div, grouped_cluster_bound


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
    if p.ragged == "k" and p.block_scaled:  # fp8: K-major both
        return a.new_zeros(1, p.total_m, k), call.b.new_zeros(1, p.n, k).transpose(1, 2)
    if p.ragged == "k":
        return a.new_zeros(1, k, p.total_m).transpose(1, 2), a.new_zeros(1, k, p.n)
    b = call.b.new_zeros(p.groups, p.n, k).transpose(1, 2) if p.b_major == "k" else call.b.new_zeros(p.groups, k, p.n)
    return a.new_zeros(1, p.total_m, k), b


def _block_scales(call: GroupedCall) -> tuple:
    """The mainloop's blockwise scales as the kernel reads them, A's ``(G, total_M, KB)`` (one tensor over every
    group's rows: a zero group stride) and B's ``(G, NB, KB)`` (variable K: one over the whole K, a zero group
    stride too), or ``()``. K = 0: one block of ones each, for the one zero k-tile of :func:`_zero_k`."""
    scales = call.block_scales
    if scales is None:
        return ()
    a, b = scales.a, scales.b
    if call.problem.k == 0:
        a, b = a.new_ones(1, a.shape[1], 1), b.new_ones(b.shape[0], b.shape[1], 1)
    return a.expand(call.problem.groups, -1, -1), b.expand(call.problem.groups, -1, -1)


def tile_row_slots(plan: GroupedPlan) -> tuple[int, int]:
    """(tile rows the schedule may number, reduction slots per tile row): a grouped epilogue's column and
    whole-tile partials go to each tile row's own 16-row slots (``GroupedGemmSm90._partials_origin``); the rows
    are the grid bound's (:func:`~epicute.sm90.tile_grid.grouped_cluster_bound`) in tiles."""
    p, c = plan.problem, plan.config
    cluster_rows = grouped_cluster_bound(p.total_m, p.groups, c.tile_m * c.cluster_m, 1)
    return cluster_rows * c.cluster_m, c.tile_m // ROWS_PER_WARP


def _group_slots(plan: GroupedPlan, offsets: torch.Tensor) -> torch.Tensor:
    """``(G + 1,)`` int64: each group's reduction slots in schedule order (its tile rows, as the kernel's scheduler
    counts them from the clamped offsets), then the unused ones; computed on the GPU, so nothing syncs."""
    p, c = plan.problem, plan.config
    rows, per_row = tile_row_slots(plan)
    ends = offsets.clamp(0, p.total_m)
    starts = torch.minimum(torch.cat([ends.new_zeros(1), ends[:-1]]), ends)
    # Tile rows per group as the scheduler numbers them: a cluster's rows, or (paired tiles) each row tile once.
    block_m, rows_per_block = (c.tile_m, 1) if c.pair_tiles else (c.tile_m * c.cluster_m, c.cluster_m)
    slots = ((ends - starts + block_m - 1) // block_m * rows_per_block * per_row).long()
    return torch.cat([slots, (rows * per_row - slots.sum()).reshape(1)])


def _workspaces(plan: GroupedPlan, fusion, device) -> dict[str, torch.Tensor]:
    """Each reduction's fp32 partials. Variable K: the dense batched GEMM's. Groups of rows: row reductions
    ``(1, tiles_n, total_M)``, column and whole-tile ones the slots of every tile row, ``(1, slots, N)`` and
    ``(1, slots, tiles_n)``; the kernel gets them as ``(G, ...)`` views with a zero group stride (it indexes them
    by group; each slot has one writer)."""
    p = plan.problem
    tile_n = output_columns(plan.config.tile_n, p.gated)
    if p.ragged == "k":
        return {r.name: torch.empty(r.workspace_shape(p.groups, p.total_m, p.d_n, tile_n), dtype=torch.float32,
                                    device=device) for r in fusion.reductions}  # fmt: skip
    rows, per_row = tile_row_slots(plan)
    tiles_n = ceil_div(p.d_n, tile_n)
    shapes = {"row": (tiles_n, p.total_m), "col": (rows * per_row, p.d_n), "all": (rows * per_row, tiles_n)}
    return {r.name: torch.empty((1, *shapes[r.axis]), dtype=torch.float32, device=device)
            for r in fusion.reductions}  # fmt: skip


def _finalize(r, workspace: torch.Tensor, plan: GroupedPlan, slots: torch.Tensor | None) -> torch.Tensor:
    """Reduction ``r``'s result from its partials, in a fixed order (deterministic): rows ``(total_M,)``, columns
    ``(G, N)`` and whole tiles ``(G,)`` per group, each group's run of ``slots`` (:func:`_group_slots`) reduced
    by ``torch.segment_reduce``; variable K: the batched GEMM's."""
    p = plan.problem
    if p.ragged == "k":
        return r.finalize(workspace)
    if r.axis == "row":  # one writer per row: the sum over the tiles along N
        return r.finalize(workspace[:1])[0]
    reduce, initial = ("sum", 0.0) if r.combine == "sum" else ("max", 0.0 if r.combine == "amax" else -math.inf)
    per_group = torch.segment_reduce(workspace[0], reduce, lengths=slots, axis=0, unsafe=True, initial=initial)
    per_group = per_group[: p.groups]
    if r.axis == "all":  # then over the tiles along N (none: the identity)
        return per_group.amax(dim=1) if per_group.shape[1] else per_group.new_zeros(p.groups)
    return per_group


def run_grouped(call: GroupedCall, plan: GroupedPlan, fusion=None, epi_inputs: tuple = (), epi_scalars: tuple = (),
                aux: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Launch ``call`` with ``plan``; every output by name, ``(total_M, N)`` (``N / 2`` gated), D first, then the
    aux tiles and the reductions (see :func:`_finalize`)."""
    p = call.problem
    paired = fusion is not None and fusion.paired
    out3 = call.out
    if out3 is None:
        *lm, d_n = p.out_shape
        out3 = torch.empty((*lm, stored_columns(d_n, paired)), dtype=call.out_dtype, device=call.a.device)
    aux = dict(aux or {})
    if paired:  # the kernel stores D_up through its own view of D's tensor (kernel_sm90._paired_half)
        aux = {name: out3[:] if name == UP_OUTPUT else aux[name] for name in fusion.aux_outputs}
    workspaces = {} if fusion is None else _workspaces(plan, fusion, call.a.device)
    if p.total_m and p.n:
        if p.k == 0 and fusion is None:
            out3.zero_()
        else:
            a, b = (call.a, call.b) if p.k else _zero_k(call)
            rows_mode = p.ragged == "m"  # the kernel indexes workspaces by group: one storage for all of them
            views = tuple(w.expand(p.groups, -1, -1) if rows_mode else w for w in workspaces.values())
            epi_tensors = tuple(epi_inputs) + tuple(aux.values()) + views
            index_args = (call.offsets,) if call.a_index is None else (call.offsets, call.a_index)
            kernel_for(plan, fusion)(a, b, out3, *index_args, epi_tensors, tuple(epi_scalars), _block_scales(call),
                                     plan.max_active_clusters)  # fmt: skip
    elif workspaces:  # no rows or no columns: nothing launched, every reduction is its identity
        for r in fusion.reductions:
            workspaces[r.name].fill_(REDUCTION_IDENTITY[r.combine])
    reductions = {}
    if workspaces:
        by_group = p.ragged == "m" and any(r.axis != "row" for r in fusion.reductions)
        slots = _group_slots(plan, call.offsets) if by_group else None
        reductions = {r.name: _finalize(r, workspaces[r.name], plan, slots) for r in fusion.reductions}
    aux.pop(UP_OUTPUT, None)  # inside D
    if p.ragged == "k":
        return {"D": out3, **aux, **reductions}
    return {"D": out3[0], **{name: t[0] for name, t in aux.items()}, **reductions}


__all__ = ["kernel_for", "run_grouped", "variant_of"]
