"""Turning a validated call into a kernel launch.

:func:`bind_gemm` looks up the compiled variant of a plan (cached per variant),
allocates D and the workspaces, and returns a :class:`GemmLaunch`, whose ``run``
launches and collects the results. Problem sizes are dynamic in the compiled
kernel, so a new shape costs a plan, never a compile, unless it picks a new
variant. A problem of one batch (L = 1) runs a kernel compiled for 2-D A, B and D
(``GemmVariant.batched``), so an unbatched call hands it its own tensors. A repeat
call skips even the binding: it replays a recorded launch (:mod:`epicute.gemm.prepared`).
"""

from __future__ import annotations

import functools

import torch

from epicute.epilogue.gated import stored_columns
from epicute.epilogue.graph import UP_OUTPUT
from epicute.gemm import GemmPlan, GemmProblem, plan_gemm
from epicute.gemm.compile import GEMM_CACHE, GemmVariant
from epicute.gemm.config import b_scale_chunks
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.gemm.validate import GemmCall
from epicute.runtime.buffers import keep, keeping, stream_key
from epicute.runtime.checks import with_aligned_unit_dims
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
    which reaches the kernel at launch as ``plan.max_active_clusters``), 2-D where it has one batch."""
    p = plan.problem
    b_dtype = p.b_dtype if p.b_dtype != p.ab_dtype else ""
    return GemmVariant(plan.config, p.ab_dtype, p.d_dtype, p.a_major, p.b_major, plan.target.arch, fusion, b_dtype,
                       p.block_scaled, batched=p.l != 1, a_scales_tma=p.a_scales_tma,
                       b_scales_bulk=p.b_scales_bulk and b_scale_chunks(plan.config.tile_n) == 1)  # fmt: skip


def launcher(kernel):
    """The TVM-FFI function under a compiled kernel's Python wrapper (which only maps keyword arguments;
    the launch takes positional ones), or ``kernel`` itself (a loaded one is already bare, a test's stub
    has none). The caller keeps ``kernel`` alive: the bare function does not own its module."""
    unwrap = getattr(kernel, "__tvm_ffi_object__", None)
    bare = unwrap() if unwrap is not None else None
    return kernel if bare is None else bare


def _zero_k_operands(call: GemmCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero A and B with K = one 16-byte row, in the call's majors: K = 0 with an epilogue is the
    epilogue of a zero accumulator, and a TMA descriptor cannot describe an empty K."""
    p, a = call.problem, call.a
    k = 16 // a.element_size()

    def zeros(rows: int, contiguous: int) -> torch.Tensor:  # (L, rows, contiguous), row strides 16-byte aligned
        padded = -(-contiguous // k) * k
        return _cached_zeros(p.l, rows, padded, a.dtype, a.device)[:, :, :contiguous]

    a0 = zeros(p.m, k) if p.a_major == "k" else zeros(k, p.m).transpose(1, 2)
    b0 = zeros(k, p.n) if p.b_major == "n" else zeros(p.n, k).transpose(1, 2)
    return a0, b0


_ZEROS: dict[tuple, torch.Tensor] = {}


def _cached_zeros(l: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros only ever read (the K = 0 operands), kept: a backward's gradient pass makes the same call every step,
    and a launch over the same constant tensors can be recorded and replayed (:class:`GemmLaunch`'s ``constant``)."""
    key = (l, rows, cols, dtype, device)
    zeros = _ZEROS.get(key)
    if zeros is None:
        if len(_ZEROS) >= 16:  # a few shapes per model: forget the oldest
            del _ZEROS[next(iter(_ZEROS))]
        zeros = keep(_ZEROS, key, torch.zeros(l, rows, cols, dtype=dtype, device=device))
    return zeros


def _block_scales(call: GemmCall) -> tuple:
    """The mainloop's blockwise scales, ``(A (L, M, KB), B (L, NB, KB))``, or ``()``. With K = 0 the zero
    operands of :func:`_zero_k_operands` are one k-tile long, so each gets a block of ones."""
    scales = call.block_scales
    if scales is None:
        return ()
    p = call.problem
    if p.k == 0:  # one block of ones each, in the layouts the variant reads (aligned for TMA and bulk copies)
        a, b = scales.a, scales.b
        rows = -(-a.shape[1] // 4) * 4
        a1 = a.new_ones(a.shape[0], 1, rows).transpose(1, 2)[:, : a.shape[1]] if p.a_scales_tma else a.new_ones(
            *a.shape[:-1], 1)  # fmt: skip
        b1 = b.new_ones(*b.shape[:-1], 4)[..., :1] if p.b_scales_bulk else b.new_ones(*b.shape[:-1], 1)
        return a1, b1
    return (with_aligned_unit_dims(scales.a, 1) if p.a_scales_tma else scales.a), scales.b


class GemmLaunch:
    """One kernel launch: the compiled kernel, every tensor and scalar it takes, and how the caller's
    results come out of them (see :meth:`run`).

    ``a``, ``b`` and ``d`` are in the kernel's rank: 2-D for a problem of one batch (an unbatched call's
    own tensors), else ``(L, ., .)``; the epilogue's tensors are always batch-first. ``fresh`` holds the
    ids of the tensors allocated empty for it (outputs and workspaces), ``constant`` those it may take again as
    they are (read-only zeros standing in for K = 0, where kept), ``filled`` (id -> value) those allocated for
    this launch alone holding one value (the same zeros where buffers are not kept, K = 0's blockwise scales of
    ones): with the caller's tensors and views of them, they are all a
    :class:`epicute.gemm.prepared.PreparedGemmCall` needs to repeat the launch for new tensors of the same
    signature.
    """

    __slots__ = (
        "a",
        "aux",
        "b",
        "batched",
        "block_scales",
        "constant",
        "d",
        "filled",
        "fresh",
        "fusion",
        "group_scales",
        "inputs",
        "kernel",
        "plan",
        "scalars",
        "workspaces",
    )  # fmt: skip

    def __init__(self, kernel, plan, fusion, batched, a, b, d, inputs, aux, workspaces, group_scales, scalars,
                 block_scales, fresh=frozenset(), constant=frozenset(), filled=None):  # fmt: skip
        self.kernel, self.plan, self.fusion, self.batched = kernel, plan, fusion, batched
        self.constant, self.filled = constant, filled or {}
        self.a, self.b, self.d, self.inputs = a, b, d, inputs
        self.aux, self.workspaces, self.group_scales = aux, workspaces, group_scales
        self.scalars, self.block_scales, self.fresh = scalars, block_scales, fresh

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the launch, in the order :meth:`with_tensors` takes them."""
        return (self.a, self.b, self.d, *self.epi_tensors(), *self.block_scales)

    def epi_tensors(self) -> tuple[torch.Tensor, ...]:
        """The fused epilogue's tensors as the kernel takes them: operands, aux outputs, workspaces, group scales."""
        extra = () if self.group_scales is None else (self.group_scales,)
        return (*self.inputs, *self.aux.values(), *self.workspaces.values(), *extra)

    def with_tensors(self, tensors: list, scalars: tuple) -> GemmLaunch:
        """The same launch over other tensors (same shapes, dtypes and order as :meth:`tensors`)."""
        i = 3 + len(self.inputs)
        j = i + len(self.aux)
        k = j + len(self.workspaces)
        aux = dict(zip(self.aux, tensors[i:j]))
        workspaces = dict(zip(self.workspaces, tensors[j:k]))
        group_scales = None if self.group_scales is None else tensors[k]
        block_scales = tuple(tensors[k + (group_scales is not None) :])
        return GemmLaunch(self.kernel, self.plan, self.fusion, self.batched, tensors[0], tensors[1], tensors[2],
                          tuple(tensors[3:i]), aux, workspaces, group_scales, scalars, block_scales)  # fmt: skip

    def launch(self) -> None:
        """Launch the kernel (or, for K = 0 without an epilogue, zero D; nothing for an empty D)."""
        p, d = self.plan.problem, self.d
        if p.m and p.n:
            if p.k == 0 and self.fusion is None:
                d.zero_()
            else:
                self.kernel(
                    self.a, self.b, d, self.epi_tensors(), self.scalars, self.block_scales,
                    split_workspace(self.plan, d.device), self.plan.max_active_clusters,
                )  # fmt: skip

    def run(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """Launch, and return D in the caller's rank; with an epilogue that has more outputs, a dict of
        all of them (aux tiles, reductions finalized here, group scales)."""
        self.launch()
        return self.results()

    def caller_d(self, d: torch.Tensor) -> torch.Tensor:
        """``d``, the kernel's D, in the caller's rank."""
        if d.dim() != 3:
            return d.unsqueeze(0) if self.batched else d  # a batch of one, through the 2-D kernel
        return d if self.batched else d[0]

    def results(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """:meth:`run`'s results, once launched."""
        return launch_results(self.fusion, self.batched, self.caller_d(self.d), self.aux, self.workspaces,
                              self.group_scales)  # fmt: skip


def launch_results(fusion, batched: bool, d: torch.Tensor, aux: dict, workspaces: dict, group_scales):
    """A launch's results from its output tensors (``d`` in the caller's rank): D, or with an epilogue that has more
    outputs a dict of all of them (aux tiles, reductions finalized here, group scales)."""
    if fusion is None or set(fusion.returned_outputs) == {"D"}:
        return d
    results = {"D": d}
    for name, t in aux.items():
        if not (fusion.paired and name == UP_OUTPUT):  # inside D
            results[name] = t if batched else t[0]
    for r in fusion.reductions:
        value = r.finalize(workspaces[r.name])
        results[r.name] = value if batched or r.axis == "all" else value[0]
    if group_scales is not None:
        scales = group_scales.transpose(1, 2)
        results[fusion.group_quant.scales] = scales if batched else scales[0]
    return results


#: Split-K workspaces by (device, stream): launches on one stream run one after another, so they share one;
#: the counters start zero and each launch leaves them zero.
_SPLIT_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(plan, device: torch.device) -> tuple:
    """``()``, or for a split-K plan its ``(partials, counters)`` on ``device``'s current stream (grown on need).
    A workspace the cache lacks may be a CUDA graph's own, not kept (:mod:`epicute.runtime.buffers`)."""
    if plan.config.split_k == 1:
        return ()
    partial_count, counter_count = plan.split_workspace_shape
    key = stream_key(device)
    partials, counters = _SPLIT_WORKSPACES.get(key, (None, None))
    if partials is not None and partials.numel() >= partial_count and counters.numel() >= counter_count:
        return partials, counters
    partials = torch.empty(max(partial_count, 0 if partials is None else partials.numel()), dtype=torch.float32,
                           device=device)  # fmt: skip
    counters = torch.zeros(max(counter_count, 0 if counters is None else counters.numel()), dtype=torch.int32,
                           device=device)  # fmt: skip
    return keep(_SPLIT_WORKSPACES, key, (partials, counters))


def bind_gemm(
    call: GemmCall,
    plan: GemmPlan,
    fusion=None,
    epi_inputs: tuple = (),
    epi_scalars: tuple = (),
    aux: dict[str, torch.Tensor] | None = None,
    fresh_aux: frozenset = frozenset(),
) -> GemmLaunch:
    """``call``'s launch with ``plan`` (and the fused epilogue, if any): D, workspaces and scales
    allocated, K = 0 stood in for (``fresh_aux``: ids of the aux outputs allocated for the call).
    A problem of one batch hands the kernel 2-D A, B and D (see :func:`variant_of`)."""
    p, device = call.problem, call.a.device
    fresh = set(fresh_aux)
    d_n = plan.d_n
    flat = p.l == 1
    paired = fusion is not None and fusion.paired
    d = call.out
    if d is None:
        stored_n = stored_columns(d_n, paired)
        d = torch.empty((p.m, stored_n) if flat else (p.l, p.m, stored_n), dtype=call.out_dtype, device=device)
        fresh.add(id(d))
    elif flat:
        d = d[0]
    if paired:  # the kernel stores D_up through its own view of D's tensor (kernel_sm90._paired_half)
        d3 = d.unsqueeze(0) if d.dim() == 2 else d[:]  # a view, never D itself: a prepared call re-derives it
        aux = {name: d3 if name == UP_OUTPUT else aux[name] for name in fusion.aux_outputs}
    workspaces, group_scales = {}, None
    if fusion is not None:
        tile_n = plan.out_tile_n
        workspaces = {
            r.name: torch.empty(r.workspace_shape(p.l, p.m, d_n, tile_n), dtype=torch.float32, device=device)
            for r in fusion.reductions
        }
        if fusion.group_quant is not None:  # (L, groups, M): M-major scales, handed out as (L, M, groups)
            shape = fusion.group_quant.scales_shape(p.l, p.m, d_n)
            group_scales = torch.empty(shape, dtype=torch.float32, device=device)
            fresh.add(id(group_scales))
        fresh.update(id(t) for t in workspaces.values())
    runs = p.m and p.n and (p.k or fusion is not None)
    zero_k = runs and not p.k
    a, b = _zero_k_operands(call) if zero_k else (call.a, call.b)
    if flat:
        a, b = a[0], b[0]
    kernel = kernel_for(plan, fusion) if runs else None
    # Zero operands are constants a prepared call may take again where they are kept; elsewhere (a compiled graph's
    # call) each replay allocates its own, as this call did.
    kept = zero_k and keeping()
    constant = frozenset((id(a), id(b)) if kept else ())
    filled = {id(a): 0.0, id(b): 0.0} if zero_k and not kept else {}
    block_scales = _block_scales(call)
    if p.k == 0:
        filled.update((id(s), 1.0) for s in block_scales)
    return GemmLaunch(kernel, plan, fusion, call.batched, a, b, d, tuple(epi_inputs), dict(aux or {}), workspaces,
                      group_scales, tuple(epi_scalars), block_scales, frozenset(fresh), constant, filled)  # fmt: skip
