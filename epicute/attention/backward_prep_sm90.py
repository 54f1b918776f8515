"""The attention backward's passes around its main kernel: the preprocess, one pass over O and
dO before it, and the postprocess, one pass over dQ's fp32 accumulator after it.

For each query row and head it writes what the main kernel reads per step, padded to whole
query blocks (``tile_m`` rows):

- ``D = rowsum(dO * O) - dLSE`` in fp32 (the products and their sum in fp32);
- LSE in log2 units, +inf where the forward's row saw no key (LSE = -inf) and on the padding,
  so that P = exp2(s - LSE) is exactly 0 there;
- and zeroes the row of the fp32 dQ accumulator, which the main kernel adds into: in fragment
  order its rows are LSE's, so every row is zeroed, padding and gaps between packed sequences
  included; row-major it is shaped like Q, and (dense batches) the row's query is zeroed (packed,
  the host zeroes it).

``head_dim / 8`` lanes per (query row, head): each lane owns 8 consecutive columns of O and dO, read
as one 16-byte vector, and the row's sum is a butterfly over its lanes. A CTA takes one query
block of one head of one batch (or packed sequence) and writes every row of it, padding
included: packed sequences' LSE and D rows start at block boundaries
(:func:`~epicute.attention.backward_plan.stat_rows_start`), and a sequence's CTAs cover the rows
up to the next sequence's start, so the gaps between them are written too. In torch ops the same
work took several passes and fp32 copies of O and dO (bench/NOTES.md).

The postprocess (:class:`BackwardPostprocessSm90`) writes ``dQ = accumulator * softmax_scale`` in
the input dtype. The main kernel adds dQ in its WGMMA accumulator's order
(:func:`~epicute.attention.backward_sm90.dq_fragment`), so each of the postprocess's 256 threads
reads the fragment the consumer thread of the same number left (16-byte loads, a warp's over 512
consecutive bytes), stages its values row-major in shared memory where that thread's partition of
the dQ MMA puts them (the same two functions place the values both ways), and one TMA store writes
the block's whole rows, clipped at the sequence's end.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from epicute.attention.backward_plan import MMA_WARPGROUPS, dq_split, stat_rows_start
from epicute.attention.backward_sm90 import as_vectors, dq_fragment, dq_tiled_mma
from epicute.attention.key_blocks import packed_range, ragged_rows, ragged_tensor
from epicute.attention.softmax import LOG2_E
from epicute.sm90.epilogue_emit import DSL_DTYPES
from epicute.sm90.fragments import pack_16bit, row_major_smem_layout, select_modes, stmatrix_copy, transposed_view
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP

#: Warps per CTA; each walks the block's rows ``warp, warp + WARPS, ...``.
WARPS = 4


class BackwardPreprocessSm90:
    """The preprocess for one (dtype, head_dim, tile_m, packed or not, with dLSE or not)."""

    def __init__(self, head_dim: int, tile_m: int, varlen: bool, has_dlse: bool, dq_fragment_order: bool):
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.varlen = varlen
        self.has_dlse = has_dlse
        self.dq_fragment_order = dq_fragment_order
        #: Each lane reads 16 bytes of a row of O and of dO: ``head_dim / 8`` lanes share a row.
        self.cols_per_lane = 8
        self.lanes_per_row = head_dim // self.cols_per_lane
        self.rows_per_warp = 32 // self.lanes_per_row
        #: shuffle distances of the butterfly that sums a row over its lanes
        self.butterfly = tuple(self.lanes_per_row >> k for k in range(1, self.lanes_per_row.bit_length()))

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
        """O and dO ``(batch, seqlen_q, heads, head_dim)``; LSE (and ``dlse``'s one tensor, if any) fp32
        ``(batch, heads, seqlen_q)``; writes ``mLSE_log2`` and ``mD`` fp32 ``(batch, heads, rows)``, rows a
        multiple of tile_m, and zeroes the fp32 dQ accumulator: ``(batch, heads, rows, head_dim)`` in
        fragment order, else shaped like O (and left alone when packed).
        ``varlen``: ``()``, or ``(cu_seqlens_q, max_seqlen_q)`` with every tensor packed (batch extent 1; rows
        as :func:`stat_rows_start` lays them out)."""
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
            cols, lanes = (self.cols_per_lane,), self.lanes_per_row
            col = lane % lanes  # the lane's 16 bytes of its row
            rows_per_step = WARPS * self.rows_per_warp
            for i in cutlass.range(warp * self.rows_per_warp, t, rows_per_step, unroll=2):  # two steps in flight
                row = block * t + i + lane // lanes  # in the sequence
                stat_row = first_stat + row
                lse_log2, part, dlse_row = Float32.inf, Float32(0.0), Float32(0.0)
                if row < seqlen:
                    src = first + row
                    o = cute.local_tile(mO[tensor_batch, src, head, None], cols, (col,)).load().to(Float32)
                    do = cute.local_tile(mdO[tensor_batch, src, head, None], cols, (col,)).load().to(Float32)
                    part = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    lse = mLSE[tensor_batch, head, src]
                    lse_log2 = cutlass.select_(lse == -Float32.inf, Float32.inf, lse * Float32(LOG2_E))
                    if cutlass.const_expr(self.has_dlse):
                        dlse_row = dlse[0][tensor_batch, head, src]
                    if cutlass.const_expr(not self.dq_fragment_order and not self.varlen):
                        zero_cols(mdQ[tensor_batch, src, head, None], col, cols)
                # The row's sum over its lanes: every lane shuffles (rows past the end add zeros).
                for offset in self.butterfly:
                    part += cute.arch.shuffle_sync_bfly(part, offset)
                dsum = part
                if cutlass.const_expr(self.has_dlse):
                    dsum = part - dlse_row
                if cutlass.const_expr(self.dq_fragment_order):
                    zero_cols(mdQ[tensor_batch, head, stat_row, None], col, cols)
                if col == 0:
                    mLSE_log2[tensor_batch, head, stat_row] = lse_log2
                    mD[tensor_batch, head, stat_row] = dsum


@cute.jit
def zero_cols(row: cute.Tensor, lane, cols: tuple) -> None:
    """Zero lane ``lane``'s ``cols`` consecutive values of a row of head_dim fp32 values."""
    zeros = cute.make_rmem_tensor(cols, Float32)
    zeros.fill(0.0)
    cute.local_tile(row, cols, (lane,)).store(zeros.load())


class BackwardPostprocessSm90:
    """The postprocess for one (head_dim, tile_m: the main kernel's, dtype, packed or not): see the module
    docstring."""

    def __init__(self, head_dim: int, tile_m: int, dtype: str, varlen: bool):
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.dtype = DSL_DTYPES[dtype]
        self.varlen = varlen
        #: The main kernel computed dQ^T (:func:`~epicute.attention.backward_sm90.dq_tiled_mma`).
        self.swap_ab = dq_split(tile_m) == "transposed"

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, varlen: tuple, stream):
        """``mdQaccum`` fp32 ``(batch, heads, rows, head_dim)``, rows as the preprocess laid LSE's out; writes
        ``mdQ`` ``(batch, seqlen_q, heads, head_dim)``. ``varlen``: ``()``, or ``(cu_seqlens_q, max_seqlen_q)``
        with ``mdQ`` packed (batch extent 1)."""
        t, d = self.tile_m, self.head_dim
        blocks = cute.ceil_div(cute.size(mdQ, mode=[1]), t)
        batches = cute.size(mdQ, mode=[0])
        m_dq = select_modes(mdQ, [1, 3, 2, 0])  # (seqlen, dim, heads, batch): TMA boxes are (rows, dim)
        if cutlass.const_expr(self.varlen):
            blocks = (varlen[1] + t - 1) // t
            batches = cute.size(varlen[0], mode=[0]) - 1
            m_dq = ragged_tensor(m_dq)
        s_layout = row_major_smem_layout(self.dtype, t, d)
        tma, tma_m_dq = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), m_dq, s_layout, (t, d))
        self.kernel(dq_tiled_mma(t, d, self.dtype), mdQaccum, tma, tma_m_dq, s_layout, softmax_scale, varlen).launch(
            grid=(blocks, cute.size(mdQ, mode=[2]), batches),
            block=[MMA_WARPGROUPS * THREADS_PER_WARPGROUP, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mdQaccum: cute.Tensor, tma: cute.CopyAtom, m_dq: cute.Tensor,
               s_layout: cute.ComposedLayout, softmax_scale: Float32, varlen: tuple):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        t, d = self.tile_m, self.head_dim
        seqlen = cute.size(m_dq, mode=[0])
        # (first row in dQ, the block's first row in the accumulator, tensor batch)
        first, acc_row, tensor_batch = 0, block * t, batch
        if cutlass.const_expr(self.varlen):
            first, seqlen = packed_range(varlen[0], batch, seqlen)
            acc_row = stat_rows_start(first, batch, t) + block * t
            tensor_batch = 0
        s_dq = SmemAllocator().allocate_tensor(self.dtype, s_layout.outer, byte_alignment=1024, swizzle=s_layout.inner)
        if block * t < seqlen:
            thr = tiled_mma.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((d, t) if self.swap_ab else (t, d)), Float32)
            staged = cute.domain_offset((acc_row, 0), mdQaccum[tensor_batch, head, None, None]).iterator
            cute.autovec_copy(dq_fragment(staged, t, d, tidx), as_vectors(acc))
            acc.store(acc.load() * softmax_scale)
            values = cute.make_rmem_tensor(acc.shape, self.dtype)
            pack_16bit(acc, values)
            # Staged row-major (stmatrix into the swizzled tile) for one TMA store of whole rows, which
            # clips the rows past the sequence's end (packed: through the ragged view). dQ^T's fragments are
            # stored transposed (stmatrix .trans) into the tile seen as (head_dim, rows).
            r2s = stmatrix_copy(tiled_mma, self.dtype, transpose=self.swap_ab)
            thr_r2s = r2s.get_slice(tidx)
            cute.copy(r2s, thr_r2s.retile(values), thr_r2s.partition_D(transposed_view(s_dq) if self.swap_ab else s_dq))
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if tidx // 32 == 0:
                rows = m_dq[None, None, head, tensor_batch]
                if cutlass.const_expr(self.varlen):
                    rows = ragged_rows(m_dq, head, first, seqlen)
                s_part, g_part = cpasync.tma_partition(
                    tma, 0, cute.make_layout(1), cute.group_modes(s_dq, 0, 2),
                    cute.group_modes(cute.local_tile(rows, (t, d), (block, 0)), 0, 2),
                )  # fmt: skip
                cute.copy(tma, s_part, g_part)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)


__all__ = ["WARPS", "BackwardPostprocessSm90", "BackwardPreprocessSm90"]
