"""The SM90 grouped GEMM: ``D[rows of g] = A[rows of g] @ B[g]`` for groups of rows of any length.

The dense GEMM's kernel (:class:`epicute.gemm.kernel_sm90.GemmSm90`: warp roles, rings,
mainloops, the fused epilogue) with three things changed, each one hook:

- the schedule (:meth:`GroupedGemmSm90._scheduler`): a
  :class:`~epicute.sm90.tile_scheduler.GroupedTileScheduler` reads the group offsets on the
  device, so tiles never straddle groups and nothing waits on the host;
- A (:meth:`GroupedGemmSm90._a_k_tiles`): one 2-D TMA descriptor over all ``total_M`` rows,
  each tile's loads offset to its group's first row. Rows past the group's end load the next
  group's tokens (zeros past ``total_M``): their accumulator rows are never stored or folded;
- D and aux outputs (:meth:`GroupedGemmSm90._store_view`): one *ragged* TMA descriptor that
  clips every tile's store at its group's end, with no predicates and no per-group
  descriptor. Its modes are ``(R, N, R + 1)`` with ``R = total_M``, its base moved back by
  ``R`` rows, and its third mode stepping one row too: coordinate ``(R - len + i, n, end)``
  addresses row ``end - len + i = start + i`` of D, and every row ``i >= len`` has a first
  coordinate ``>= R``, which TMA drops. Operand tiles are loaded like A (offset, not clipped).

B is ``(G, K, N)``, the group being its batch coordinate. The fused epilogue sees global rows
(``origin`` = the group's first row + the tile's offset, ``extent`` = the group's end), so its
masks already stop at the group's end; its batch index is the group (per-group row vectors
``(G, N)``; per-row vectors arrive as ``(G, total_M)`` views with a zero group stride).

:class:`RaggedKGemmSm90` is the variable-K mode (weight gradients): the groups split the reduction, each
group has its own ``(M, N)`` output, and the hooks change the k-loop instead (its docstring says how).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute
from cutlass.tensor_utils import LayoutEnum

from epicute.errors import ConfigError
from epicute.gemm.kernel_sm90 import GATHER_FIRST_WARP, GemmSm90, _paired_half, _rotate
from epicute.sm90.cp_async import CHUNK_BYTES, LINE_BYTES, arrive_when_copied, copy_chunk_zero_fill, swizzled_chunk
from epicute.sm90.pipeline import RingState
from epicute.sm90.ragged import ragged_load_view, ragged_rows
from epicute.sm90.tile_grid import ceil_div, grouped_cluster_bound
from epicute.sm90.tile_scheduler import GroupedTileScheduler, RaggedKTileScheduler


class GroupedGemmSm90(GemmSm90):
    """Compile-time description of one grouped GEMM variant (see the module docstring)."""

    @cute.jit
    def __call__(
        self,
        mA_lmk: cute.Tensor,
        mB_lkn: cute.Tensor,
        mD_lmn: cute.Tensor,
        offsets: cute.Tensor,
        epi_tensors: tuple,
        epi_scalars: tuple,
        block_scales: tuple,
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """A ``(1, total_M, K)``, B ``(G, K, N)``, D ``(1, total_M, N)``; ``offsets`` int32 ``(G,)``, each
        group's end row (``torch._grouped_mm``'s ``offs``); ``block_scales`` ``()`` or fp8 blockwise scales
        ``(A (G, total_M, KB) with a zero group stride, B (G, NB, KB))``. The launch covers the host's bound
        on the clusters (:func:`~epicute.sm90.tile_grid.grouped_cluster_bound`), at most
        ``max_active_clusters`` when persistent; the clusters with no work find none and exit."""
        self._launch_grouped(mA_lmk, mB_lkn, mD_lmn, offsets, (), epi_tensors, epi_scalars, block_scales,
                             max_active_clusters, stream)  # fmt: skip

    @cute.jit
    def _launch_grouped(self, mA_lmk, mB_lkn, mD_lmn, offsets, loader_args: tuple, epi_tensors, epi_scalars,
                        block_scales, max_active_clusters, stream):  # fmt: skip
        """:meth:`__call__`'s launch; ``loader_args`` follow the schedule's in ``sched_args`` (what the roles
        build their schedulers from, and what a gathering producer reads)."""
        cfg = self.cfg
        mA = _rotate(mA_lmk, [1, 2, 0])  # (total_M, K, 1)
        mB = _rotate(mB_lkn, [2, 1, 0])  # (N, K, G)
        mD = _rotate(mD_lmn, [1, 2, 0])  # (total_M, N, 1)
        if cutlass.const_expr(self.paired_d):  # D's half of the (total_M, 2N, 1) tensor its D_up shares
            mD = _paired_half(mD, 0)
        total_rows = cute.size(mD, mode=[0])
        num_groups = cute.size(mB, mode=[2])
        clusters_n = ceil_div(ceil_div(cute.size(mD, mode=[1]), self.out_tile_n), cfg.cluster_n)
        bound = grouped_cluster_bound(total_rows, num_groups, cfg.tile_m * cfg.cluster_m, clusters_n)
        launched = GroupedTileScheduler.grid(bound, max_active_clusters, cfg.persistent, cutlass.min)
        sched_args = (offsets, num_groups, total_rows, clusters_n, *loader_args)
        self._launch(mA, mB, mD, epi_tensors, epi_scalars, block_scales, sched_args, launched, stream)

    def _store_view(self, tensor: cute.Tensor) -> cute.Tensor:
        """``tensor`` ``(R, N, 1)`` as the ragged ``(R, N, R + 1)`` view its TMA stores clip through."""
        rows = cute.size(tensor, mode=[0])
        row_stride = tensor.stride[0]
        base = cute.domain_offset((-rows, 0, 0), tensor).iterator
        # The columns as the tensor lays them out: unit stride, or a paired half's blocks (_paired_half).
        return cute.make_tensor(
            base, cute.make_layout((rows, tensor.shape[1], rows + 1), stride=(row_stride, tensor.stride[1], row_stride))
        )

    def _scheduler(self, sched_args: tuple) -> GroupedTileScheduler:
        offsets, num_groups, total_rows, clusters_n = sched_args[:4]
        return GroupedTileScheduler(
            offsets, num_groups, total_rows, clusters_n, self.cluster_shape_mn, self.cfg.swizzle,
            self.cfg.raster_along_m, self.cfg.tile_m, self.paired,
        )  # fmt: skip

    @cute.jit
    def _tile_multicast(self, cta, coord: tuple) -> tuple:
        """Paired tiles (:attr:`~epicute.gemm.config.GemmConfig.pair_tiles`): the operand the cluster's two tiles
        share (B along M, A along N) is loaded whole by CTA 0 and multicast to both; each CTA loads its own other
        operand for itself alone."""
        if cutlass.const_expr(not self.paired):
            return GemmSm90._tile_multicast(self, cta, coord)
        rank = cutlass.Int32(cta.cluster_coord[0])
        along_n = coord[6] == 1
        both, own = cutlass.Int32(0b11), cutlass.Int32(1) << rank
        a_mask = cutlass.Int16(cutlass.select_(along_n, both, own))
        b_mask = cutlass.Int16(cutlass.select_(along_n, own, both))
        return a_mask, b_mask, (rank == 0) | (coord[6] == 0), (rank == 0) | along_n

    def _output_tiles(self, tensor: cute.Tensor) -> cute.Tensor:
        # Tiles are cut per tile from the group's rows (_subtile_partition): the tensor as it is.
        return tensor

    def _subtile_partition(self, atom, smem_staged: cute.Tensor, tiles: cute.Tensor, coord: tuple, store: bool):
        tm, tn, _, start, end = coord[:5]
        if cutlass.const_expr(store):
            rows = cute.size(tiles, mode=[0])
            view = cute.domain_offset((rows - (end - start), 0), tiles[(None, None, end)])
        else:
            view = cute.domain_offset((start, 0), tiles[(None, None, 0)])
        tile = cute.local_tile(view, (self.cfg.tile_m, self.out_tile_n), (tm, tn))
        return self._partition_subtiles(atom, smem_staged, tile)

    def _a_k_tiles(self, cta, tma_a, coord: tuple) -> cute.Tensor:
        cfg = self.cfg
        rows = cute.domain_offset((coord[3], 0, 0), cta.mA)
        gA = cute.local_tile(rows, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None))
        _, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cta.cluster_coord[1], cute.make_layout(cfg.cluster_n), cute.group_modes(cta.sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )  # fmt: skip
        return tAgA[(None, coord[0], None, 0)]

    def _epilogue_frame(self, coord: tuple, extent_mn: tuple) -> tuple:
        tm, tn, g, start, end = coord[:5]
        return (start + tm * self.cfg.tile_m, tn * self.out_tile_n), (end, extent_mn[1]), g

    def _partials_origin(self, coord: tuple):
        """Tiles of different groups may share a 16-row band of rows, so each tile row of the schedule gets its own
        slots (``coord[5] + tm``: every tile row numbered once), which the host reduces per group."""
        return (coord[5] + coord[0]) * self.cfg.tile_m


class GatheredGemmSm90(GroupedGemmSm90):
    """The grouped GEMM with gathered rows: row ``r`` of the grouped order is ``x[a_index[r]]``, so a
    mixture-of-experts layer reads its routed tokens where they are, with no permuted copy of ``x``.

    Rows picked through an index are not a TMA box: producer warps ``GATHER_FIRST_WARP``.. (64 threads)
    copy each tile's A k-tiles with 16-byte ``cp.async`` chunks into the same swizzled stages TMA would
    fill, and arrive on the stage's full barrier when their copies land; warp 0 still TMA-loads B and
    arms the barrier with B's bytes alone. A thread owns one 16-byte chunk column of every eighth row of
    the tile, so the swizzle's XOR (row % 8) is one constant per thread and its rows' indices are read
    once per tile into registers. Rows past the group's end repeat its last row (their accumulators are
    never stored), chunks past K are zero-filled by the copy itself, and indices are clamped to ``x``'s
    rows, so a bad index reads a wrong row, never outside ``x``. A is not multicast (no cluster along N),
    and each stage is fenced to the async proxy before WGMMA reads what cp.async wrote (:meth:`_fix_stage`).
    fp8 inputs' blockwise A scales are per token of ``x``, read through the same index (:meth:`_a_scale_rows`).
    """

    gather_threads = 2 * 32

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        if cfg.cluster_n != 1 or cfg.pair_tiles:
            raise ConfigError(f"gathered rows with cluster_n={cfg.cluster_n}, pair_tiles={cfg.pair_tiles}: cp.async "
                              "cannot multicast A; use cluster_n=1 and pair_tiles=False")  # fmt: skip
        if self.a_layout != LayoutEnum.ROW_MAJOR:
            raise ConfigError("gathered rows take a K-major (row-major) A")
        if cfg.tile_k * self.ab_dtype.width // 8 != LINE_BYTES:
            raise ConfigError(f"tile_k={cfg.tile_k}: a gathered k-tile is one {LINE_BYTES}-byte row")

    @cute.jit
    def __call__(
        self,
        mA_lmk: cute.Tensor,
        mB_lkn: cute.Tensor,
        mD_lmn: cute.Tensor,
        offsets: cute.Tensor,
        a_index: cute.Tensor,
        epi_tensors: tuple,
        epi_scalars: tuple,
        block_scales: tuple,
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """A ``(1, T, K)``: ``x``, the rows gathered from (the kernel's setup describes it for TMA, which never
        reads it); ``a_index`` int32 ``(total_M,)``; the rest as for :class:`GroupedGemmSm90`."""
        source = _rotate(mA_lmk, [1, 2, 0])  # (T, K, 1)
        self._launch_grouped(mA_lmk, mB_lkn, mD_lmn, offsets, (source, a_index), epi_tensors, epi_scalars,
                             block_scales, max_active_clusters, stream)  # fmt: skip

    @cute.jit
    def _gather_a(self, cta, sched_args) -> None:
        cfg = self.cfg
        x, a_index = sched_args[4], sched_args[5]
        elem_bytes = self.ab_dtype.width // 8
        chunks_per_row = LINE_BYTES // CHUNK_BYTES
        rows_per_pass = self.gather_threads // chunks_per_row
        assert rows_per_pass % 8 == 0 and cfg.tile_m % rows_per_pass == 0
        # The stage layout the offsets below assume: K-major 128-byte rows, stages back to back.
        assert cute.crd2idx((1, 0, 0), cta.sA.layout) * elem_bytes == LINE_BYTES
        stage_bytes = cute.crd2idx((0, 0, 1), cta.sA.layout) * elem_bytes
        assert stage_bytes == cfg.tile_m * LINE_BYTES
        tidx, _, _ = cute.arch.thread_idx()
        thread = tidx - GATHER_FIRST_WARP * 32
        chunk = thread % chunks_per_row
        row0 = thread // chunks_per_row  # rows row0, row0 + rows_per_pass, ...: the same row % 8
        smem = cute.recast_ptr(cta.sA.iterator, dtype=cutlass.Uint8)
        k_extent = cute.size(x, mode=[1])
        last_source_row = cute.size(x, mode=[0]) - 1
        row_stride = x.stride[0]
        passes = cfg.tile_m // rows_per_pass
        source_rows = cute.make_rmem_tensor((passes,), cutlass.Int32)
        ab_pipeline = cta.ab_pipeline
        scheduler = self._scheduler(sched_args)
        state = RingState.producer(cfg.ab_stages, tracked=True)
        work = scheduler.first()
        while scheduler.is_valid(work):
            tm, _, _, start, end, _ = scheduler.coord(work)
            for i in cutlass.range_constexpr(passes):
                row = cutlass.min(start + tm * cfg.tile_m + row0 + i * rows_per_pass, end - 1)
                source_rows[i] = source_row(a_index, row, last_source_row)
            for k_tile in range(cta.k_tiles):
                ab_pipeline.sync_object_empty.wait(state.index, state.phase)
                k = k_tile * cfg.tile_k + chunk * (CHUNK_BYTES // elem_bytes)
                in_k = k < k_extent  # K is a whole number of chunks (checked on the host)
                src_bytes = CHUNK_BYTES if in_k else 0
                k = k if in_k else 0
                stage = smem + state.index * stage_bytes
                for i in cutlass.range_constexpr(passes):
                    dst = stage + swizzled_chunk(row0 + i * rows_per_pass, chunk)
                    src = x.iterator + (cutlass.Int64(source_rows[i]) * row_stride + k)
                    copy_chunk_zero_fill(dst, src, src_bytes)
                arrive_when_copied(ab_pipeline.producer_get_barrier(state))
                state.advance()
            work = scheduler.next(work)

    @cute.jit
    def _fix_stage(self, cta, coord: tuple, k_tile, stage, mma_tidx) -> None:
        """cp.async wrote A through the generic proxy; WGMMA reads through the async proxy."""
        cute.arch.fence_proxy("async.shared", space="cta")

    def _a_scale_rows(self, rows: list, sched_args: tuple) -> list:
        """fp8: A's blockwise scales are per token of ``x``: a row's are those of the token it gathers."""
        x, a_index = sched_args[4], sched_args[5]
        return [source_row(a_index, r, cute.size(x, mode=[0]) - 1) for r in rows]


def source_row(a_index: cute.Tensor, row, last_row):
    """The row of ``x`` grouped row ``row`` reads: ``a_index[row]`` clamped to ``x``'s rows (a bad index reads a
    wrong row, never outside ``x``)."""
    return cutlass.max(cutlass.min(a_index[row], last_row), 0)


class RaggedKGemmSm90(GemmSm90):
    """The grouped GEMM's variable-K mode: ``D[g] = A[:, rows of g] @ B[rows of g, :]`` (a weight gradient
    ``dW_g = X_g^T dY_g`` over each group's tokens), one ``(M, N)`` output per group.

    The dense GEMM with the groups as its batch, except the reduction. 16-bit inputs: A ``(M, R)`` and B
    ``(R, N)`` are loaded through ragged TMA views along K (:func:`~epicute.sm90.ragged.ragged_load_view`, one
    descriptor each): each tile's loads start at its group's first K row (:meth:`_group_k_tiles`; K is the
    strided dimension of both, where a TMA box may start anywhere), a tile runs ``ceil(len_g / tile_k)`` k-tiles
    (:meth:`_k_tiles`; none for an empty group, whose D is the epilogue of zeros), and the last k-tile's rows past
    the group's end, which would be the next group's, arrive as zeros. (Zeroing them in shared memory instead
    cost 1.5-2 % at the benchmark's sizes, bench/NOTES.md.) Ping-pong: a warpgroup steps its ring over the
    other's tiles by their own groups' k-tiles (:meth:`_k_tiles_over`).

    fp8 inputs (``block_scaled``) are K-major, where no ragged view can clip K (the contiguous dimension), and
    their scales cover 128-wide blocks of K: every group starts and ends on a k-tile (``tile_k`` = 128 = a scale
    block), so a group's k-tiles are the whole descriptor's tiles ``start / 128 ..`` (:meth:`_k_first`), its
    scales the blocks of the same index, and nothing needs clipping. A group that does not (offsets the host
    could not check) gets NaN for its D (:meth:`_check_accumulator`), never another group's rows.
    """

    k_tiles_may_be_zero = True

    @cute.jit
    def __call__(
        self,
        mA_lmk: cute.Tensor,
        mB_lkn: cute.Tensor,
        mD_lmn: cute.Tensor,
        offsets: cute.Tensor,
        epi_tensors: tuple,
        epi_scalars: tuple,
        block_scales: tuple,
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """A ``(1, M, R)``, B ``(1, R, N)``, D ``(G, M, N)``; ``offsets`` int32 ``(G,)``: each group's end K
        row; ``block_scales`` ``()``, or fp8's ``(A (G, M, KB), B (G, NB, KB))`` with zero group strides (blocks
        of the whole K, which every group's k-tiles index). The groups are D's batch: the dense launch, with the
        offsets and ``R`` for the scheduler."""
        total_k = cute.size(mA_lmk, mode=[2])
        self._launch_batched(mA_lmk, mB_lkn, mD_lmn, epi_tensors, epi_scalars, block_scales, max_active_clusters,
                             stream, (offsets, total_k))  # fmt: skip

    def _scheduler(self, sched_args: tuple) -> RaggedKTileScheduler:
        offsets, total_k, clusters_m, clusters_n, num_groups = sched_args
        return RaggedKTileScheduler(
            offsets, total_k, clusters_m, clusters_n, num_groups, self.cluster_shape_mn, self.cfg.swizzle,
            self.cfg.raster_along_m,
        )  # fmt: skip

    def _load_view(self, tensor: cute.Tensor) -> cute.Tensor:
        """A and B ``(rows, R, 1)`` as ragged along K (:func:`~epicute.sm90.ragged.ragged_load_view`): a group's
        last k-tile reads zeros past its end, where the next group's rows lie. fp8: the tensor itself (groups
        end on k-tiles)."""
        if cutlass.const_expr(self.block_scaled):
            return tensor
        return ragged_load_view(tensor, 1)

    def _group_k_tiles(self, tensor, tma, smem, peer, peers: int, tile_rows: int, tile_index, coord) -> cute.Tensor:
        """``(TMA, k_tile)`` of an operand for the group at ``coord``: its K rows from the first, the rows past
        its end out of bounds (zero-filled)."""
        rows = ragged_rows(tensor, 1, coord[3], coord[4] - coord[3])[(None, None, 0)]
        tiles = cute.local_tile(rows, (tile_rows, self.cfg.tile_k), (None, None))
        _, partition = cute.nvgpu.cpasync.tma_partition(
            tma, peer, cute.make_layout(peers), cute.group_modes(smem, 0, 2), cute.group_modes(tiles, 0, 2)
        )
        return partition[(None, tile_index, None)]

    def _a_k_tiles(self, cta, tma_a, coord: tuple) -> cute.Tensor:
        if cutlass.const_expr(self.block_scaled):  # the whole K: the group's k-tiles from _k_first on
            return cta.tAgA[(None, coord[0], None, 0)]
        return self._group_k_tiles(cta.mA, tma_a, cta.sA, cta.cluster_coord[1], self.cfg.cluster_n, self.cfg.tile_m,
                                   coord[0], coord)  # fmt: skip

    def _b_k_tiles(self, cta, tma_b, coord: tuple) -> cute.Tensor:
        if cutlass.const_expr(self.block_scaled):
            return cta.tBgB[(None, coord[1], None, 0)]
        return self._group_k_tiles(cta.mB, tma_b, cta.sB, cta.cluster_coord[0], self.cfg.cluster_m, self.cfg.tile_n,
                                   coord[1], coord)  # fmt: skip

    def _k_tiles(self, cta, coord: tuple):
        return (coord[4] - coord[3] + self.cfg.tile_k - 1) // self.cfg.tile_k

    def _k_first(self, cta, coord: tuple):
        """fp8: the group's first k-tile of the whole K (its loads and its scales' blocks); 16-bit: its views start
        at the group's first row."""
        if cutlass.const_expr(self.block_scaled):
            return coord[3] // self.cfg.tile_k
        return 0

    @cute.jit
    def _check_accumulator(self, acc: cute.Tensor, coord: tuple) -> None:
        """fp8: a group that does not start and end on a k-tile was summed over whole k-tiles, its neighbours'
        rows among them: its D is NaN, not a plausible wrong value."""
        if cutlass.const_expr(self.block_scaled):  # noqa: SIM102 - compile-time guard, dynamic if
            if (coord[3] % self.cfg.tile_k != 0) | (coord[4] % self.cfg.tile_k != 0):
                acc.fill(cutlass.Float32(float("nan")))

    @cute.jit
    def _k_tiles_over(self, cta, scheduler, work, tiles):
        """The k-tiles of ``tiles`` (at most ``num_teams - 1``) schedule tiles from ``work`` on: each its group's."""
        total = Int32(0)
        for i in cutlass.range_constexpr(self.cfg.num_teams - 1):
            other = scheduler.next(work, i)
            k_tiles = Int32(0)
            if scheduler.is_valid(other):  # past the schedule's end no coordinate is read (offsets[g] out of range)
                k_tiles = self._k_tiles(cta, scheduler.coord(other))
            total += cutlass.select_(Int32(i) < tiles, k_tiles, Int32(0))
        return total


__all__ = ["GatheredGemmSm90", "GroupedGemmSm90", "RaggedKGemmSm90"]
