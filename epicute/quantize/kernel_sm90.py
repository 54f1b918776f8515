"""The group quantizer: each row of ``x`` cut into groups of 128 columns, each group's fp8 values and scale.

A memory-bound kernel with no shared memory: 16 lanes own a group (a lane, 8 consecutive values: one 16-byte
load), fold their values' magnitudes, combine them across the 16 lanes by butterfly shuffles (a fixed order:
the same bits every run), and each lane stores its 8 values times the group's reciprocal scale as 8 fp8 bytes
(two per saturating ``cvt``); the group's first lane stores the scale. A warp covers two groups, a CTA of
:data:`THREADS` threads 16; groups are numbered row by row, so a warp's loads and stores are contiguous runs
of a row. The math is :mod:`epicute.epilogue.group_quant`'s, operation for operation (the GEMM epilogue's
``quantize_groups`` runs the same emitters).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute

from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.group_quant import AMAX_FLOOR, GROUP_N
from epicute.sm90 import epilogue_emit as emit
from epicute.sm90.fragments import pack_pairs

#: Values per lane: one 16-byte load of 16-bit inputs.
VALUES_PER_LANE = 8
#: Lanes per group of :data:`GROUP_N` columns (consecutive lanes of one warp: butterfly masks 1, 2, 4, 8).
LANES_PER_GROUP = GROUP_N // VALUES_PER_LANE
THREADS = 256


class GroupQuantizeSm90:
    """The kernel for one (input dtype, fp8 dtype, UE8M0 or not)."""

    def __init__(self, out_dtype, fp8_name: str, ue8m0: bool):
        self.out_dtype = out_dtype
        self.fp8_max = FP8_MAX[fp8_name]
        self.ue8m0 = ue8m0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor, stream):
        """``mX`` ``(M, K)`` row-major 16-bit, ``mQ`` ``(M, K)`` fp8 row-major, ``mScales`` fp32 ``(K / 128, M)``
        (M contiguous: the ``(M, K / 128)`` M-major scales a blockwise GEMM takes, transposed)."""
        lanes = cute.size(mX, mode=[0]) * cute.ceil_div(cute.size(mX, mode=[1]), GROUP_N) * LANES_PER_GROUP
        self.kernel(mX, mQ, mScales).launch(grid=(cute.ceil_div(lanes, THREADS), 1, 1), block=[THREADS, 1, 1],
                                            stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m, k = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        groups = cute.ceil_div(k, GROUP_N)
        lane = bidx * THREADS + tidx
        group_id = lane // LANES_PER_GROUP
        row, group = group_id // groups, group_id % groups
        chunk = group * LANES_PER_GROUP + lane % LANES_PER_GROUP  # this lane's 8 values: K's chunk `chunk`
        # K is a multiple of 16 (checked on the host): a lane's 8 values lie in K or past it, never across.
        valid = (row < m) & (chunk * VALUES_PER_LANE < k)
        values = cute.make_rmem_tensor((VALUES_PER_LANE,), Float32)
        values.fill(0.0)
        if valid:
            values.store(cute.local_tile(mX[row, None], (VALUES_PER_LANE,), (chunk,)).load().to(Float32))
        amax = emit.identity("amax")
        for i in cutlass.range_constexpr(VALUES_PER_LANE):
            amax = emit.fold_element("amax", amax, values[i], valid)
        # Every lane takes part in the shuffles (lanes past the problem bring the identity).
        amax = emit.butterfly("amax", amax, (1, 2, 4, 8))
        scale = cutlass.max(amax, Float32(AMAX_FLOOR)) / Float32(self.fp8_max)
        if cutlass.const_expr(self.ue8m0):
            scale = emit.ceil_pow2(scale)
        reciprocal = Float32(1.0) / scale
        if valid:
            values.store(values.load() * reciprocal)
            packed = cute.make_rmem_tensor((VALUES_PER_LANE,), self.out_dtype)
            pack_pairs(values, packed)
            cute.local_tile(mQ[row, None], (VALUES_PER_LANE,), (chunk,)).store(packed.load())
        if (lane % LANES_PER_GROUP == 0) & (row < m):
            mScales[group, row] = scale


__all__ = ["LANES_PER_GROUP", "THREADS", "VALUES_PER_LANE", "GroupQuantizeSm90"]
