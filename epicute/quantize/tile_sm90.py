"""The tile quantizer: a 2-D ``x`` ``(R, C)`` quantized along its rows, along its columns (``x.t()``'s rows,
written transposed), or both from one read: what an fp8 GEMM's forward, data gradient and weight gradient take
of one activation or weight (a weight gradient's K is the tokens, so it needs the transpose).

A CTA takes a 128 x 128 tile (256 threads). *Rows*: each thread loads 16 consecutive values of a row (two
16-byte loads, every load of the thread in flight before the first use), eight lanes a row; a row's group of 128
is reduced by butterfly shuffles over those lanes (``"groups"``) or the whole tile by the warps' partials in shared
memory (``"blocks"``), and written as fp8 with one 16-byte store. *Columns*: the tile's raw values also go to
shared memory, a row of 64 words with its 16-byte quads XOR-swizzled by the row's sixteenth (so that the reads
below hit 32 banks); then each lane reads one word (two adjacent columns) from each of 16 consecutive rows, a
column's eight lanes reduce its group of 128 rows (or take the tile's scale), and each column's 16 values go out
as one 16-byte store of the transposed output. Rows past ``R`` read as zeros: the transposed output's rows are
padded with zeros to a multiple of 16 (a GEMM's K alignment), which add nothing to the products it feeds.

Scales: rows, groups ``(C / 128, R)`` (``x``'s M-major ``(R, C / 128)``, transposed); rows, blocks
``(R / 128, C / 128)``; columns, groups ``(R / 128, C)``; columns, blocks ``(C / 128, R / 128)`` (divisions
rounded up). The math is :mod:`epicute.epilogue.group_quant`'s, as in :mod:`epicute.quantize.kernel_sm90`.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Uint32, cute
from cutlass.utils import SmemAllocator

from epicute.epilogue.dtypes import FP8_MAX
from epicute.epilogue.group_quant import GROUP_N
from epicute.quantize.kernel_sm90 import scale_of, store_scaled
from epicute.sm90 import epilogue_emit as emit

TILE = GROUP_N
THREADS = 256
WARPS = THREADS // 32
#: Values a lane takes of a row (two 16-byte loads, one 16-byte fp8 store), and of a column (16 rows).
RUN = 16
LANES_PER_ROW = TILE // RUN
ROWS_PER_PASS = THREADS // LANES_PER_ROW
#: The tile in shared memory: 32-bit words (two 16-bit values), 16-byte quads of 4 words.
WORDS = TILE // 2
QUADS = WORDS // 4
#: A column lane reads words of its column pair (4 pairs a warp) from 16 rows (8 runs a warp), so a column's
#: 8 lanes differ in lane bits 2-4.
COLUMN_PAIRS_PER_WARP = 4
COLUMN_LANE_MASKS = (4, 8, 16)
ROW_LANE_MASKS = (1, 2, 4)


def _quad(row, quad):
    """The swizzled quad of ``(row, quad)``: quads XOR the row's sixteenth (mod 8), so that the 32 lanes of a
    column read (8 runs of 16 rows x 4 words of one quad) fall in 32 distinct banks."""
    return quad ^ ((row // RUN) % 8)


@cute.jit
def _fold_amax(values: cute.Tensor, partial):
    """``partial`` with the magnitudes of a register fragment folded in (NaN propagates)."""
    for i in cutlass.range_constexpr(cute.size(values)):
        partial = emit.combine("amax", partial, cute.math.absf(values[i]))
    return partial


class TileQuantizeSm90:
    """The kernel for one input dtype, fp8 dtype, scale format, and rows and columns recipes (``"groups"``,
    ``"blocks"`` or ``None``: that output not written)."""

    def __init__(self, in_dtype, fp8_name: str, ue8m0: bool, rows: str | None, columns: str | None):
        self.in_dtype = in_dtype
        self.fp8_max = FP8_MAX[fp8_name]
        self.ue8m0 = ue8m0
        self.rows = rows
        self.columns = columns
        self.blocks = "blocks" in (rows, columns)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor, mQt: cute.Tensor,
                 mScalesT: cute.Tensor, stream):  # fmt: skip
        """``mX`` ``(R, C)`` 16-bit row-major; ``mQ`` ``(R, C)`` and ``mQt`` ``(C, pad16(R))`` fp8 row-major;
        the scales fp32 as in the module docstring (an output whose recipe is ``None`` is not touched)."""
        grid = (cute.ceil_div(cute.size(mX, mode=[1]), TILE), cute.ceil_div(cute.size(mX, mode=[0]), TILE), 1)
        self.kernel(mX, mQ, mScales, mQt, mScalesT).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScales: cute.Tensor, mQt: cute.Tensor,
               mScalesT: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        tile_c, tile_r, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        r_count, c_count = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        chunks = c_count // RUN  # C is a multiple of 16 (checked on the host)
        smem = SmemAllocator()
        sTile = None
        if cutlass.const_expr(self.columns is not None):
            sTile = smem.allocate_tensor(Uint32, cute.make_layout((TILE, WORDS), stride=(WORDS, 1)), 16)
        sWarpAmax = None
        if cutlass.const_expr(self.blocks):
            sWarpAmax = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 4)

        # Rows: every load first (from clamped addresses: a branch around each would keep them from issuing
        # together), then zeros for what lies past the problem.
        chunk_in_tile = tidx % LANES_PER_ROW
        chunk = tile_c * LANES_PER_ROW + chunk_in_tile
        raws, places = [], []
        for p in cutlass.range_constexpr(TILE // ROWS_PER_PASS):
            row_in_tile = tidx // LANES_PER_ROW + p * ROWS_PER_PASS
            row = tile_r * TILE + row_in_tile
            source = cute.local_tile(mX[cutlass.min(row, r_count - 1), None], (RUN,),
                                     (cutlass.min(chunk, chunks - 1),))  # fmt: skip
            raw = cute.make_rmem_tensor((RUN,), mX.element_type)
            raw.store(source.load())
            raws.append(raw)
            places.append((row_in_tile, row, (row < r_count) & (chunk < chunks)))
        values, thread_amax = [], emit.identity("amax")
        for raw, (row_in_tile, row, valid) in zip(raws, places):
            if (row >= r_count) | (chunk >= chunks):
                raw.fill(0)
            v = cute.make_rmem_tensor((RUN,), Float32)
            v.store(raw.load().to(Float32))
            values.append(v)
            if cutlass.const_expr(self.columns is not None):
                words = cute.recast_tensor(raw, Uint32)
                for half in cutlass.range_constexpr(2):
                    quad = _quad(row_in_tile, chunk_in_tile * 2 + half)
                    cute.local_tile(sTile[row_in_tile, None], (4,), (quad,)).store(
                        cute.local_tile(words, (4,), (half,)).load()
                    )
            if cutlass.const_expr(self.blocks):
                thread_amax = _fold_amax(v, thread_amax)
            if cutlass.const_expr(self.rows == "groups"):
                amax = emit.butterfly("amax", _fold_amax(v, emit.identity("amax")), ROW_LANE_MASKS)
                scale = scale_of(amax, self.fp8_max, self.ue8m0)
                if valid:
                    store_scaled(v, scale, cute.local_tile(mQ[row, None], (RUN,), (chunk,)))
                if (chunk_in_tile == 0) & (row < r_count):
                    mScales[tile_c, row] = scale

        block_scale = Float32(0.0)
        if cutlass.const_expr(self.blocks):
            warp_amax = emit.butterfly("amax", thread_amax, (1, 2, 4, 8, 16))
            if lane == 0:
                sWarpAmax[warp] = warp_amax
        cute.arch.sync_threads()
        if cutlass.const_expr(self.blocks):
            amax = sWarpAmax[0]
            for w in cutlass.range_constexpr(1, WARPS):
                amax = emit.combine("amax", amax, sWarpAmax[w])
            block_scale = scale_of(amax, self.fp8_max, self.ue8m0)
        if cutlass.const_expr(self.rows == "blocks"):
            for v, (_, row, valid) in zip(values, places):
                if valid:
                    store_scaled(v, block_scale, cute.local_tile(mQ[row, None], (RUN,), (chunk,)))
            if tidx == 0:
                mScales[tile_r, tile_c] = block_scale

        if cutlass.const_expr(self.columns is not None):
            self.columns_out(sTile, mQt, mScalesT, block_scale, tile_r, tile_c, lane, warp, r_count, c_count)

    @cute.jit
    def columns_out(self, sTile, mQt: cute.Tensor, mScalesT: cute.Tensor, block_scale, tile_r, tile_c, lane, warp,
                    r_count, c_count):  # fmt: skip
        """The transposed output: lane ``4 run + pair`` of warp ``w`` takes columns ``2 (4 w + pair)`` and
        ``+ 1`` of each 64 (two passes) and rows ``16 run`` to ``+ 15`` of the tile."""
        run, pair = lane // COLUMN_PAIRS_PER_WARP, lane % COLUMN_PAIRS_PER_WARP
        padded = (r_count + RUN - 1) // RUN * RUN
        first_row = tile_r * TILE + run * RUN
        for p in cutlass.range_constexpr(WORDS // (COLUMN_PAIRS_PER_WARP * WARPS)):
            word = p * COLUMN_PAIRS_PER_WARP * WARPS + warp * COLUMN_PAIRS_PER_WARP + pair
            words = cute.make_rmem_tensor((RUN,), Uint32)
            for i in cutlass.range_constexpr(RUN):
                row_in_tile = run * RUN + i
                words[i] = sTile[row_in_tile, _quad(row_in_tile, word // 4) * 4 + word % 4]
            pairs = cute.make_rmem_tensor((2 * RUN,), Float32)
            pairs.store(cute.recast_tensor(words, self.in_dtype).load().to(Float32))
            for j in cutlass.range_constexpr(2):
                column = tile_c * TILE + 2 * word + j
                v = cute.make_rmem_tensor((RUN,), Float32)
                for i in cutlass.range_constexpr(RUN):
                    v[i] = pairs[2 * i + j]
                scale = block_scale
                if cutlass.const_expr(self.columns == "groups"):
                    amax = emit.butterfly("amax", _fold_amax(v, emit.identity("amax")), COLUMN_LANE_MASKS)
                    scale = scale_of(amax, self.fp8_max, self.ue8m0)
                    if (run == 0) & (column < c_count):
                        mScalesT[tile_r, column] = scale
                if (column < c_count) & (first_row < padded):
                    store_scaled(v, scale, cute.local_tile(mQt[column, None], (RUN,), (first_row // RUN,)))
        if cutlass.const_expr(self.columns == "blocks"):  # noqa: SIM102 - a compile-time branch around a runtime one
            if (warp == 0) & (lane == 0):
                mScalesT[tile_c, tile_r] = block_scale


__all__ = ["THREADS", "TILE", "TileQuantizeSm90"]
