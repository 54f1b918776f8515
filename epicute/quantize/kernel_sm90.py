"""The group quantizer: each row of ``x`` cut into groups of 128 columns (or of a whole row of up to 1024: the
``rowwise`` recipe of short rows), each group's fp8 values and scale.

A memory-bound kernel with no shared memory. A group's lanes (``128 / values_per_lane`` consecutive lanes of a
warp) each take ``values_per_lane`` consecutive values (16-byte loads), fold their magnitudes, combine them by
butterfly shuffles (a fixed order: the same bits every run), and store their values times the group's reciprocal
scale as fp8 (two per saturating ``cvt``, 8 or 16 bytes a store); the group's first lane stores the scale. A
thread may take ``groups_per_lane`` groups, issuing every load before the first shuffle: loads in flight, not
occupancy, set an HBM-bound kernel's speed. Groups are numbered row by row, so a warp's loads and stores are
contiguous runs of a row. The math is :mod:`epicute.epilogue.group_quant`'s, operation for operation (the GEMM
epilogue's ``quantize_groups`` runs the same emitters).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute

from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.group_quant import AMAX_FLOOR, GROUP_N
from epicute.sm90 import epilogue_emit as emit
from epicute.sm90.fragments import pack_pairs

THREADS = 256


@cute.jit
def scale_of(amax, fp8_max: float, ue8m0: bool):
    """The scale of values whose largest magnitude is ``amax``: ``max(amax, AMAX_FLOOR) / fp8_max``, rounded up to
    a power of two for UE8M0 (``group_quant.group_scales``, operation for operation)."""
    scale = cutlass.max(amax, Float32(AMAX_FLOOR)) / Float32(fp8_max)
    if cutlass.const_expr(ue8m0):
        scale = emit.ceil_pow2(scale)
    return scale


@cute.jit
def store_scaled(values: cute.Tensor, scale, dst: cute.Tensor):
    """``dst = values * (1 / scale)`` in ``dst``'s fp8 type (saturating, two values a ``cvt``), one vector store:
    ``values`` a compact fp32 register fragment of ``dst``'s size, overwritten."""
    values.store(values.load() * (Float32(1.0) / scale))
    packed = cute.make_rmem_tensor(cute.size(values), dst.element_type)
    pack_pairs(values, packed)
    dst.store(packed.load())


class GroupQuantizeSm90:
    """The kernel for one (input dtype, fp8 dtype, UE8M0 or not) and one split of the work among lanes."""

    def __init__(self, fp8_name: str, ue8m0: bool, groups_per_lane: int, values_per_lane: int,
                 group_n: int = GROUP_N):  # fmt: skip
        self.groups_per_lane = groups_per_lane
        self.values_per_lane = values_per_lane
        #: values one scale covers along a row: 128, or a whole short row (``rowwise``: up to a warp's lanes)
        self.group_n = group_n
        # A group's lanes are consecutive lanes of one warp: butterfly masks 1, 2, ... lanes_per_group / 2.
        self.lanes_per_group = group_n // values_per_lane
        self.lane_masks = tuple(1 << i for i in range(self.lanes_per_group.bit_length() - 1))
        self.fp8_max = FP8_MAX[fp8_name]
        self.ue8m0 = ue8m0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor, stream):
        """``mX`` ``(M, K)`` row-major 16-bit, ``mQ`` ``(M, K)`` fp8 row-major, ``mScales`` fp32 ``(K / group_n, M)``
        (M contiguous: the ``(M, K / 128)`` M-major scales a blockwise GEMM takes, transposed)."""
        lanes = cute.size(mX, mode=[0]) * cute.ceil_div(cute.size(mX, mode=[1]), self.group_n) * self.lanes_per_group
        ctas = cute.ceil_div(lanes, THREADS * self.groups_per_lane)
        self.kernel(mX, mQ, mScales).launch(grid=(ctas, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m, k = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        groups, chunks = cute.ceil_div(k, self.group_n), k // self.values_per_lane
        places, loaded = [], []
        for j in cutlass.range_constexpr(self.groups_per_lane):
            lane = (bidx * self.groups_per_lane + j) * THREADS + tidx
            group_id = lane // self.lanes_per_group
            row, group = group_id // groups, group_id % groups
            chunk = group * self.lanes_per_group + lane % self.lanes_per_group  # K's chunk `chunk`: this lane's values
            # K is a multiple of 16 (checked on the host): a lane's 8 or 16 values lie in K or past it, never across.
            valid = (row < m) & (chunk < chunks)
            places.append((row, group, chunk, valid, lane % self.lanes_per_group == 0))
            # Unconditional loads from a clamped address (a lane past the problem reads a value it then ignores):
            # a branch around each load would keep the compiler from issuing them together.
            source = cute.local_tile(mX[cutlass.min(row, m - 1), None], (self.values_per_lane,),
                                     (cutlass.min(chunk, chunks - 1),))  # fmt: skip
            values = cute.make_rmem_tensor((self.values_per_lane,), Float32)
            values.store(source.load().to(Float32))
            loaded.append(values)
        for (row, group, chunk, valid, leads), values in zip(places, loaded):
            amax = emit.identity("amax")
            for i in cutlass.range_constexpr(self.values_per_lane):
                amax = emit.fold_element("amax", amax, values[i], valid)
            # Every lane takes part in the shuffles (lanes past the problem bring the identity).
            amax = emit.butterfly("amax", amax, self.lane_masks)
            scale = scale_of(amax, self.fp8_max, self.ue8m0)
            if valid:
                store_scaled(values, scale, cute.local_tile(mQ[row, None], (self.values_per_lane,), (chunk,)))
            if leads & (row < m):
                mScales[group, row] = scale


__all__ = ["THREADS", "GroupQuantizeSm90", "scale_of", "store_scaled"]
