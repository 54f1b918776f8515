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
"""

from __future__ import annotations

import cutlass
from cutlass import cute

from epicute.gemm.kernel_sm90 import GemmSm90, _rotate
from epicute.sm90.tile_grid import ceil_div, grouped_cluster_bound
from epicute.sm90.tile_scheduler import GroupedTileScheduler


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
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """A ``(1, total_M, K)``, B ``(G, K, N)``, D ``(1, total_M, N)``; ``offsets`` int32 ``(G,)``, each
        group's end row (``torch._grouped_mm``'s ``offs``). The launch covers the host's bound on the
        clusters (:func:`~epicute.sm90.tile_grid.grouped_cluster_bound`), at most ``max_active_clusters``
        when persistent; the clusters with no work find none and exit."""
        cfg = self.cfg
        mA = _rotate(mA_lmk, [1, 2, 0])  # (total_M, K, 1)
        mB = _rotate(mB_lkn, [2, 1, 0])  # (N, K, G)
        mD = _rotate(mD_lmn, [1, 2, 0])  # (total_M, N, 1)
        total_rows = cute.size(mD, mode=[0])
        num_groups = cute.size(mB, mode=[2])
        clusters_n = ceil_div(ceil_div(cute.size(mD, mode=[1]), self.out_tile_n), cfg.cluster_n)
        bound = grouped_cluster_bound(total_rows, num_groups, cfg.tile_m * cfg.cluster_m, clusters_n)
        launched = GroupedTileScheduler.grid(bound, max_active_clusters, cfg.persistent, cutlass.min)
        self._launch(mA, mB, mD, epi_tensors, epi_scalars, (), (offsets, num_groups, total_rows, clusters_n),
                     launched, stream)  # fmt: skip

    def _store_view(self, tensor: cute.Tensor) -> cute.Tensor:
        """``tensor`` ``(R, N, 1)`` as the ragged ``(R, N, R + 1)`` view its TMA stores clip through."""
        rows = cute.size(tensor, mode=[0])
        row_stride = tensor.stride[0]
        base = cute.domain_offset((-rows, 0, 0), tensor).iterator
        return cute.make_tensor(
            base, cute.make_layout((rows, cute.size(tensor, mode=[1]), rows + 1), stride=(row_stride, 1, row_stride))
        )

    def _scheduler(self, sched_args: tuple) -> GroupedTileScheduler:
        offsets, num_groups, total_rows, clusters_n = sched_args
        return GroupedTileScheduler(
            offsets, num_groups, total_rows, clusters_n, self.cluster_shape_mn, self.cfg.swizzle,
            self.cfg.raster_along_m, self.cfg.tile_m,
        )  # fmt: skip

    def _output_tiles(self, tensor: cute.Tensor) -> cute.Tensor:
        # Tiles are cut per tile from the group's rows (_subtile_partition): the tensor as it is.
        return tensor

    def _subtile_partition(self, atom, smem_staged: cute.Tensor, tiles: cute.Tensor, coord: tuple, store: bool):
        tm, tn, _, start, end = coord
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
        tm, tn, g, start, end = coord
        return (start + tm * self.cfg.tile_m, tn * self.out_tile_n), (end, extent_mn[1]), g


__all__ = ["GroupedGemmSm90"]
