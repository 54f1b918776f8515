"""Register-fragment helpers shared by the SM90 kernels.

:func:`warpgroup_slice` slices a tiled WGMMA for partitioning shared-memory
operands: a WGMMA operand descriptor is the same for all 128 threads of a
warpgroup, so slicing by a warp-uniform warpgroup index (not the thread index)
lets the compiler keep descriptors in uniform registers. Sliced per thread,
they are computed in ordinary registers -- which the kernel then carries
through its mainloop -- and moved to uniform registers before every WGMMA.

:func:`pack_pairs` converts an fp32 fragment (a WGMMA accumulator) to bf16 or
fp16 two elements per instruction (``cvt.rn.bf16x2.f32``), so each pair is born
in the 32-bit register that WGMMA's A operand and ``stmatrix`` read; fp8 pairs
likewise (``cvt.rn.satfinite.e4m3x2.f32``: saturating in the same instruction). The generic
``TensorSSA.to`` conversion goes element by element for some fragment shapes
(attention's 80-key blocks, for one); the 16-bit halves are then packed by moves
placed right before the consuming WGMMA, after its ``wgmma.fence``, and ptxas has
to inject another fence there (its warning C7519).

Views and layouts the attention kernels share: :func:`acc_rows_cols` (an
accumulator as this thread's rows and columns), :func:`acc_as_operand_a` (an
accumulator as the next WGMMA's register A operand; :func:`acc_as_operand_a_8bit` for an fp8 one),
:func:`transposed_view` (a
shared-memory tile read the other way round: V^T, dO^T, K^T, dS),
:func:`row_major_smem_layout` (swizzle atoms no wider than a warpgroup's slice),
:func:`select_modes`, :func:`stmatrix_copy` (an accumulator's 16-bit copy into such a tile); and
:func:`warpgroup_gemm`, one WGMMA issue with its fence, commit and optional wait.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float8E5M2, Float16, Float32, Int16, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP

#: One instruction converts a pair of fp32 values: (PTX, the pair's word type, its inline-asm constraint).
#: The fp8 conversions saturate (``satfinite``: +-inf and out-of-range values become the largest finite
#: value, NaN stays NaN), which is the reference's rounding of an fp8 output.
_PACK_INSTR = {
    BFloat16: ("cvt.rn.bf16x2.f32", Int32, "r"),
    Float16: ("cvt.rn.f16x2.f32", Int32, "r"),
    Float8E4M3FN: ("cvt.rn.satfinite.e4m3x2.f32", Int16, "h"),
    Float8E5M2: ("cvt.rn.satfinite.e5m2x2.f32", Int16, "h"),
}


@dsl_user_op
def pack_pair(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None):
    """``lo`` and ``hi`` rounded to ``dtype`` (16-bit or fp8) in one word, ``lo`` in its low half
    (PTX puts the first source in the upper half)."""
    instr, word_type, constraint = _PACK_INSTR[dtype]
    word = llvm.inline_asm(
        T.i16() if word_type is Int16 else T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"{instr} $0, $1, $2;",
        f"={constraint},f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return word_type(word)


@cute.jit
def pack_pairs(src: cute.Tensor, dst: cute.Tensor):
    """``dst = src`` rounded to ``dst``'s type (16-bit, or fp8 saturating), two elements per
    instruction; ``dst`` is a compact register fragment (element ``k`` at offset ``k``, as
    ``make_fragment_*``/``make_rmem_tensor`` build them) with ``src``'s logical shape."""
    words = cute.recast_tensor(dst, _PACK_INSTR[dst.element_type][1])
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = pack_pair(src[2 * i], src[2 * i + 1], dst.element_type)


def pack_16bit(src: cute.Tensor, dst: cute.Tensor):
    """:func:`pack_pairs` to bf16 or fp16 (the P operand of attention's PV WGMMA)."""
    pack_pairs(src, dst)


def stmatrix_copy(tiled_mma, dtype, transpose: bool = False):
    """The copy that stores a 16-bit ``dtype`` copy of ``tiled_mma``'s fp32 accumulator (packed by
    :func:`pack_16bit`, retiled per thread) into a row-major swizzled shared-memory tile with
    ``stmatrix`` (``partition_D`` of the thread's slice), for a TMA store or another WGMMA to read;
    ``transpose``: into a column-major one (``stmatrix.trans``, e.g. a :func:`transposed_view`)."""
    layout = LayoutEnum.COL_MAJOR if transpose else LayoutEnum.ROW_MAJOR
    return cute.make_tiled_copy_C(sm90_utils.get_smem_store_op(layout, dtype, Float32), tiled_mma)


def warpgroup_slice(tiled_mma, warpgroup):
    """The slice of ``tiled_mma`` for the first thread of (warp-uniform) ``warpgroup``:
    partition shared-memory A/B operands with it; accumulators still come from a
    per-thread slice."""
    return tiled_mma.get_slice(warpgroup * THREADS_PER_WARPGROUP)


def select_modes(tensor: cute.Tensor, order: list[int]) -> cute.Tensor:
    """A view of ``tensor`` with its modes permuted (no data moves)."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=order))


def row_major_smem_layout(
    dtype, rows: int, cols: int, stages: int | None = None, major: int | None = None, row_bands: bool = False
):
    """Row-major (``cols`` contiguous) swizzled smem layout, optionally staged.

    The swizzle atom is the widest that ``major`` columns (default ``cols``) fill: a buffer one
    WGMMA reads K-major and another reads MN-major in slices of ``major`` columns per warpgroup
    needs an atom no wider than the slice, or the slice's descriptor would cut a swizzle row.
    Atoms are stacked down the rows first (a slice of ``major`` columns is contiguous), or with
    ``row_bands`` across the columns first (a band of rows is contiguous)."""
    major = cols if major is None else major
    atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major), dtype)
    order = (1, 0) if row_bands else (0, 1)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=order)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(*order, 2))


def transposed_view(tensor: cute.Tensor) -> cute.Tensor:
    """``tensor`` (rows, cols[, stages]) seen as (cols, rows[, stages]): an operand stored one way
    and read by a WGMMA the other way (e.g. V^T, dO^T), no data moved."""
    shape = (tensor.shape[1], tensor.shape[0], *tensor.shape[2:])
    order = (1, 0, *range(2, cute.rank(tensor)))
    return cute.composition(tensor, cute.make_ordered_layout(shape, order=order))


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator ``((2, 2, V), M, N)`` as ``((2, M), (2, V, N))`` = (rows, cols) of this thread."""
    shape = cute.make_layout(t.layout.shape)  # compact col-major over the accumulator's modes
    rows_cols = cute.make_layout(
        ((shape.shape[0][1], shape.shape[1]), (shape.shape[0][0], shape.shape[0][2], shape.shape[2])),
        stride=((shape.stride[0][1], shape.stride[1]), (shape.stride[0][0], shape.stride[0][2], shape.stride[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, rows_cols))


def acc_as_operand_a(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator ``((2, 2, N/8), M, 1)`` as the A fragment ``((2, 2, 2), M, N/16)`` of the next WGMMA."""
    l = cute.logical_divide(t.layout, ((None, None, 2), None, None))
    view = cute.make_layout(
        ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
        stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1], (l.stride[0][2][1], l.stride[2])),
    )
    return cute.make_tensor(t.iterator, view)


def acc_as_operand_a_8bit(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator ``((2, 2, N/8), M, 1)`` as the 8-bit A fragment ``(((2, 2), 2, 2), M, N/32)`` of the
    next WGMMA, register for register: slot ``(v0 + 2 j0, row half, j1)`` of k-block ``kb`` is column pair
    element ``v0`` of 8-column chunk ``j0 + 2 j1 + 4 kb``. The slots then carry the columns in a fixed
    permuted order within each 16 (:func:`epicute.attention.fp8.key_of_slot`), which the B operand's
    rows must follow; no lane exchanges a value."""
    c = cute.make_layout(t.layout.shape)  # compact col-major over the accumulator's modes
    (s0, s1, s2), s_m = c.stride[0], c.stride[1]
    n8 = c.shape[0][2]
    view = cute.make_layout(
        (((2, 2), 2, 2), c.shape[1], n8 // 4),
        stride=(((s0, s2), s1, 2 * s2), s_m, 4 * s2),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, view))


@cute.jit
def warpgroup_gemm(tiled_mma, acc, tA, tB, accumulate, wg_wait: cutlass.Constexpr[int]):
    """Issue one warpgroup GEMM (all k-blocks), commit it, optionally wait for all but ``wg_wait``
    of this warpgroup's GEMMs in flight (-1: no wait)."""
    warpgroup.fence()
    # A fresh atom per GEMM: its accumulate field is state we change below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)
