"""The attention backward's preprocess: one pass over O and dO before the main kernel.

For each query row and head it writes what the main kernel reads per step, padded to whole
query blocks (``tile_m`` rows):

- ``D = rowsum(dO * O) - dLSE`` in fp32 (the products and their sum in fp32);
- LSE in log2 units, +inf where the forward's row saw no key (LSE = -inf) and on the padding,
  so that P = exp2(s - LSE) is exactly 0 there;
- and (dense batches) zeroes the row's fp32 dQ accumulator, which the main kernel adds into.

One warp per (query row, head): each lane owns ``head_dim / 32`` consecutive columns of O and
dO, read as one vector, and the row's sum is a butterfly over the warp. A CTA takes one query
block of one head of one batch (or packed sequence) and writes every row of it, padding
included: packed sequences' LSE and D rows start at block boundaries
(:func:`~epicute.attention.backward_plan.stat_rows_start`), and a sequence's CTAs cover the rows
up to the next sequence's start, so the gaps between them are written too. In torch ops the same
work took several passes and fp32 copies of O and dO (bench/NOTES.md).
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, cute

from epicute.attention.backward_plan import stat_rows_start
from epicute.attention.key_blocks import packed_range

LOG2_E = math.log2(math.e)
#: Warps per CTA; each walks the block's rows ``warp, warp + WARPS, ...``.
WARPS = 4


class BackwardPreprocessSm90:
    """The preprocess for one (dtype, head_dim, tile_m, packed or not, with dLSE or not)."""

    def __init__(self, head_dim: int, tile_m: int, varlen: bool, has_dlse: bool):
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.varlen = varlen
        self.has_dlse = has_dlse
        self.cols_per_lane = head_dim // 32

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mD: cute.Tensor,
        mdQ: cute.Tensor,
        dlse: tuple,
        varlen: tuple,
        stream,
    ):
        """O, dO and the fp32 dQ accumulator ``(batch, seqlen_q, heads, head_dim)``; LSE (and ``dlse``'s
        one tensor, if any) fp32 ``(batch, heads, seqlen_q)``; writes ``mLSE_log2`` and ``mD`` fp32
        ``(batch, heads, rows)``, rows a multiple of tile_m. ``varlen``: ``()``, or ``(cu_seqlens_q,
        max_seqlen_q)`` with every tensor packed (batch extent 1; rows as :func:`stat_rows_start` lays
        them out), and the accumulator left alone (the host zeroes it: rows outside every sequence too)."""
        heads = cute.size(mO, mode=[2])
        blocks = cute.size(mLSE_log2, mode=[2]) // self.tile_m
        batches = cute.size(mO, mode=[0])
        if cutlass.const_expr(self.varlen):
            # A sequence's rows run to the next one's start: at most one block past its own length.
            blocks = (varlen[1] + self.tile_m - 1) // self.tile_m + 1
            batches = cute.size(varlen[0], mode=[0]) - 1
        self.kernel(mO, mdO, mLSE, mLSE_log2, mD, mdQ, dlse, varlen).launch(
            grid=(blocks, heads, batches), block=[32 * WARPS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mD: cute.Tensor,
        mdQ: cute.Tensor,
        dlse: tuple,
        varlen: tuple,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        t = self.tile_m
        seqlen = cute.size(mO, mode=[1])
        # (tensor batch, first row in O, first row in LSE/D, rows of this sequence in LSE/D)
        first, first_stat, stat_rows, tensor_batch = 0, 0, cute.size(mLSE_log2, mode=[2]), batch
        if cutlass.const_expr(self.varlen):
            first, seqlen = packed_range(varlen[0], batch, seqlen)
            first_stat = stat_rows_start(first, batch, t)
            stat_rows = stat_rows_start(first + seqlen, batch + 1, t) - first_stat
            tensor_batch = 0
        if block * t < stat_rows:
            cols = (self.cols_per_lane,)
            for i in cutlass.range(warp, t, WARPS, unroll=2):  # two rows in flight per warp
                row = block * t + i  # in the sequence
                stat_row = first_stat + row
                lse_log2, dsum = Float32.inf, Float32(0.0)
                if row < seqlen:
                    src = first + row
                    o = cute.local_tile(mO[tensor_batch, src, head, None], cols, (lane,)).load().to(Float32)
                    do = cute.local_tile(mdO[tensor_batch, src, head, None], cols, (lane,)).load().to(Float32)
                    part = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    for offset in (16, 8, 4, 2, 1):
                        part += cute.arch.shuffle_sync_bfly(part, offset)
                    dsum = part
                    lse = mLSE[tensor_batch, head, src]
                    lse_log2 = cutlass.select_(lse == -Float32.inf, Float32.inf, lse * Float32(LOG2_E))
                    if cutlass.const_expr(self.has_dlse):
                        dsum = dsum - dlse[0][tensor_batch, head, src]
                    if cutlass.const_expr(not self.varlen):
                        zeros = cute.make_rmem_tensor(cols, Float32)
                        zeros.fill(0.0)
                        cute.local_tile(mdQ[tensor_batch, src, head, None], cols, (lane,)).store(zeros.load())
                if lane == 0:
                    mLSE_log2[tensor_batch, head, stat_row] = lse_log2
                    mD[tensor_batch, head, stat_row] = dsum


__all__ = ["WARPS", "BackwardPreprocessSm90"]
