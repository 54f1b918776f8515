"""Register-fragment helpers shared by the SM90 kernels.

:func:`warpgroup_slice` slices a tiled WGMMA for partitioning shared-memory
operands: a WGMMA operand descriptor is the same for all 128 threads of a
warpgroup, so slicing by a warp-uniform warpgroup index (not the thread index)
lets the compiler keep descriptors in uniform registers. Sliced per thread,
they are computed in ordinary registers -- which the kernel then carries
through its mainloop -- and moved to uniform registers before every WGMMA.

:func:`pack_16bit` converts an fp32 fragment (a WGMMA accumulator) to bf16 or
fp16 two elements per instruction (``cvt.rn.bf16x2.f32``), so each pair is born
in the 32-bit register that WGMMA's A operand and ``stmatrix`` read. The generic
``TensorSSA.to`` conversion goes element by element for some fragment shapes
(attention's 80-key blocks, for one); the 16-bit halves are then packed by moves
placed right before the consuming WGMMA, after its ``wgmma.fence``, and ptxas has
to inject another fence there (its warning C7519).
"""

from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from epicute.gemm.config import THREADS_PER_WARPGROUP

_PACK_INSTR = {BFloat16: "cvt.rn.bf16x2.f32", Float16: "cvt.rn.f16x2.f32"}


@dsl_user_op
def _pack_pair(lo: Float32, hi: Float32, instr: str, *, loc=None, ip=None) -> Int32:
    """``lo`` in the low 16 bits, ``hi`` in the high ones (PTX puts the first source in the upper half)."""
    word = llvm.inline_asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"{instr} $0, $1, $2;",
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(word)


@cute.jit
def pack_16bit(src: cute.Tensor, dst: cute.Tensor):
    """``dst = src`` rounded to ``dst``'s 16-bit type; ``dst`` is a compact register fragment
    (element ``k`` at offset ``k``, as ``make_fragment_*``/``make_rmem_tensor`` build them) with
    ``src``'s logical shape."""
    instr = _PACK_INSTR[dst.element_type]
    words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _pack_pair(src[2 * i], src[2 * i + 1], instr)


def warpgroup_slice(tiled_mma, warpgroup):
    """The slice of ``tiled_mma`` for the first thread of (warp-uniform) ``warpgroup``:
    partition shared-memory A/B operands with it; accumulators still come from a
    per-thread slice."""
    return tiled_mma.get_slice(warpgroup * THREADS_PER_WARPGROUP)
