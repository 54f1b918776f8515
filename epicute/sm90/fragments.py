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
"""

from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float8E5M2, Float16, Float32, Int16, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

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


def warpgroup_slice(tiled_mma, warpgroup):
    """The slice of ``tiled_mma`` for the first thread of (warp-uniform) ``warpgroup``:
    partition shared-memory A/B operands with it; accumulators still come from a
    per-thread slice."""
    return tiled_mma.get_slice(warpgroup * THREADS_PER_WARPGROUP)
