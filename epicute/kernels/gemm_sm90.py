"""The warp-specialized, persistent SM90 GEMM with a TMA-store epilogue.

``D[l] = A[l] @ B[l]``. One CTA = one producer warpgroup + ``num_mma_warpgroups``
consumer warpgroups (cooperative: two warpgroups split a 128-row tile, 64 rows
each):

- producer (warp 0 of warpgroup 0, registers lowered to ``producer_regs``):
  walks the tile schedule and streams A/B k-tiles into an ``ab_stages``-deep
  shared-memory ring with TMA (multicast across the cluster when it has 2 CTAs);
- consumers (registers raised to ``consumer_regs``): wait on the ring's full
  barriers, issue WGMMA with fp32 accumulators, release stages once the WGMMA
  that read them retired, then run the epilogue for that tile;
- epilogue (all consumer threads): for each ``epi_tile`` subtile in row-major
  order, copy its accumulators out, cast, ``stmatrix`` into one of
  ``num_epi_stages`` staging buffers and publish it with a TMA store
  (:class:`~epicute.kernels.pipeline.TmaStoreEpilogue`).

Host tensors arrive in torch order -- A ``(L, M, K)``, B ``(L, K, N)``, D
``(L, M, N)`` with any of the supported majors -- and are rotated to CuTe's
``(M, K, L)`` / ``(N, K, L)`` / ``(M, N, L)`` at trace time, which is free.
Problem sizes and strides are dynamic: one compiled kernel serves every shape.
Ragged edges need no code: TMA zero-fills out-of-bounds loads (so partial
k-tiles add zeros) and clips out-of-bounds stores.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.utils import LayoutEnum

from epicute.kernels.epilogue_emit import EpilogueFusion
from epicute.kernels.pipeline import TmaStoreEpilogue, make_tma_load_pipeline, stage_of
from epicute.kernels.tile_scheduler import TileScheduler
from epicute.plan.config import THREADS_PER_WARPGROUP, GemmConfig

CUTLASS_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}

#: WGMMA M of one warpgroup's atom.
WGMMA_M = 64


def _rotate(tensor: cute.Tensor, order: list[int]) -> cute.Tensor:
    """A view of ``tensor`` with its modes permuted (no data moves)."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=order))


class GemmSm90:
    """Compile-time description of one GEMM kernel variant (see module docstring)."""

    def __init__(
        self,
        cfg: GemmConfig,
        ab_dtype: str,
        d_dtype: str,
        a_major: str,
        b_major: str,
        max_active_clusters: int,
        fusion: EpilogueFusion | None = None,
    ):
        cfg.validate()
        self.fusion = fusion
        self.cfg = cfg
        self.ab_dtype = CUTLASS_DTYPES[ab_dtype]
        self.d_dtype = CUTLASS_DTYPES[d_dtype]
        self.acc_dtype = cutlass.Float32
        # (M, K) with K contiguous is row-major; (N, K) with K contiguous too.
        self.a_layout = LayoutEnum.ROW_MAJOR if a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.ROW_MAJOR
        self.tile_shape_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.cluster_shape_mn = (cfg.cluster_m, cfg.cluster_n)
        # An A tile is shared by the CTAs of one cluster row (same M, other N);
        # a B tile by the CTAs of one cluster column.
        self.a_mcast_ctas = cfg.cluster_n
        self.b_mcast_ctas = cfg.cluster_m
        self.max_active_clusters = max_active_clusters
        self.load_warp = 0
        # First warp of the first consumer warpgroup issues the TMA stores.
        self.store_warp = THREADS_PER_WARPGROUP // 32

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mA_lmk: cute.Tensor,
        mB_lkn: cute.Tensor,
        mD_lmn: cute.Tensor,
        epi_tensors: tuple,
        epi_scalars: tuple,
        stream,
    ):
        """``epi_tensors``/``epi_scalars``: the fused epilogue's operands (see epilogue_emit)."""
        cfg = self.cfg
        mA = _rotate(mA_lmk, [1, 2, 0])  # (M, K, L)
        mB = _rotate(mB_lkn, [2, 1, 0])  # (N, K, L)
        mD = _rotate(mD_lmn, [1, 2, 0])  # (M, N, L)
        # Operands arrive batch-first like A/B/D; the kernel indexes them batch-last.
        epi_tensors = tuple(_rotate(t, [1, 0] if cute.rank(t) == 2 else [1, 2, 0]) for t in epi_tensors)

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (cfg.num_mma_warpgroups, 1, 1),
            tiler_mn=(WGMMA_M, cfg.tile_n),
        )
        a_smem_staged = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_shape_mnk, self.ab_dtype, cfg.ab_stages)
        b_smem_staged = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_shape_mnk, self.ab_dtype, cfg.ab_stages)
        d_smem_staged = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, cfg.epi_tile, cfg.num_epi_stages)

        tma_a, tma_mA = self._make_tma_load(mA, a_smem_staged, (cfg.tile_m, cfg.tile_k), self.a_mcast_ctas)
        tma_b, tma_mB = self._make_tma_load(mB, b_smem_staged, (cfg.tile_n, cfg.tile_k), self.b_mcast_ctas)
        tma_d, tma_mD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mD,
            cute.slice_(d_smem_staged, (None, None, 0)),
            cfg.epi_tile,
        )

        tiles_m = cute.ceil_div(cute.size(mD, mode=[0]), cfg.tile_m)
        tiles_n = cute.ceil_div(cute.size(mD, mode=[1]), cfg.tile_n)
        num_batches = cute.size(mD, mode=[2])
        clusters_m, clusters_n, total_clusters = TileScheduler.num_clusters(
            tiles_m, tiles_n, num_batches, self.cluster_shape_mn
        )
        launched = total_clusters
        if cutlass.const_expr(cfg.persistent):
            launched = cutlass.min(total_clusters, Int32(self.max_active_clusters))

        d_staging_elems = 0 if cfg.epi_reuses_ab_smem else cute.cosize(d_smem_staged)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, 2 * cfg.ab_stages]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_staged)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, d_staging_elems], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_d, tma_mD,
            a_smem_staged, b_smem_staged, d_smem_staged,
            clusters_m, clusters_n, num_batches, epi_tensors, epi_scalars,
        ).launch(
            grid=(cfg.cluster_m, cfg.cluster_n, launched),
            block=[cfg.num_threads, 1, 1],
            cluster=(cfg.cluster_m, cfg.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    @staticmethod
    def _make_tma_load(tensor, smem_staged, smem_tile, mcast_ctas: int):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if mcast_ctas > 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), smem_tile, num_multicast=mcast_ctas
        )

    def _scheduler(self, clusters_m, clusters_n, num_batches) -> TileScheduler:
        # Each role builds its own (the DSL cannot carry Python objects across a
        # runtime branch); the schedule is static, so they agree tile for tile.
        return TileScheduler(
            clusters_m, clusters_n, num_batches, self.cluster_shape_mn, self.cfg.swizzle, self.cfg.raster_along_m
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD: cute.Tensor,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
        clusters_m: Int32,
        clusters_n: Int32,
        num_batches: Int32,
        epi_tensors: tuple,
        epi_scalars: tuple,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)

        if warp_idx == self.load_warp:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

        # Position inside the cluster, and which peers our multicasts reach.
        cta_layout_mnk = cute.make_layout((cfg.cluster_m, cfg.cluster_n, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mcast_mask = a_mcast_mask if self.a_mcast_ctas > 1 else 0
        b_mcast_mask = b_mcast_mask if self.b_mcast_ctas > 1 else 0

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0))) + cute.size_in_bytes(
            self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0))
        )
        ab_pipeline = make_tma_load_pipeline(
            storage.ab_barriers.data_ptr(),
            cfg.ab_stages,
            tx_bytes,
            num_consumer_warps=cfg.num_mma_threads // 32,
            cluster_shape_mn=self.cluster_shape_mn,
            mcast_ctas=self.a_mcast_ctas + self.b_mcast_ctas - 1,
        )
        # Peers must see our initialized barriers before any multicast lands.
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_arrive_relaxed()

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        if cutlass.const_expr(cfg.epi_reuses_ab_smem):
            # Non-persistent: the A ring is idle once the only mainloop is done.
            d_ptr = cute.recast_ptr(storage.sA.data_ptr(), d_smem_staged.inner, dtype=self.d_dtype)
            sD = cute.make_tensor(d_ptr, d_smem_staged.outer)
        else:
            sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)

        # Global tiles: (bM, bK, RestM, RestK, L) etc.
        gA = cute.local_tile(mA, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            cluster_coord[1],
            cute.make_layout(cfg.cluster_n),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            cluster_coord[0],
            cute.make_layout(cfg.cluster_m),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        if warpgroup_idx == 0:
            # ---------------- producer warpgroup
            cute.arch.warpgroup_reg_dealloc(cfg.producer_regs)
            if warp_idx == self.load_warp:
                scheduler = self._scheduler(clusters_m, clusters_n, num_batches)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.ab_stages)
                work = scheduler.first()
                while scheduler.is_valid(work):
                    tm, tn, tl = scheduler.tile_coord(work)
                    tAgA_tile = tAgA[(None, tm, None, tl)]
                    tBgB_tile = tBgB[(None, tn, None, tl)]
                    for k_tile in range(k_tiles):
                        ab_pipeline.producer_acquire(state)
                        barrier = ab_pipeline.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA_tile[(None, k_tile)], tAsA[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=a_mcast_mask)  # fmt: skip
                        cute.copy(tma_b, tBgB_tile[(None, k_tile)], tBsB[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=b_mcast_mask)  # fmt: skip
                        ab_pipeline.producer_commit(state)  # no-op for TMA: bytes arm the barrier
                        state.advance()
                    work += scheduler.stride()
                # Stay alive until consumers (ours and peers') released every
                # stage, so no remote arrive targets an exited CTA.
                ab_pipeline.producer_tail(state)
        else:
            # ---------------- consumer warpgroups: MMA, then epilogue
            cute.arch.warpgroup_reg_alloc(cfg.consumer_regs)
            mma_tidx = tidx - THREADS_PER_WARPGROUP
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc_shape = thr_mma.partition_shape_C(cute.slice_(self.tile_shape_mnk, (None, None, 0)))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            k_blocks = cute.size(tCrA, mode=[2])

            # Register -> smem copy of D (stmatrix for 16-bit outputs).
            copy_atom_r2s = sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, self.acc_dtype)
            stmatrix_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), self.d_dtype
            )
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(stmatrix_atom, tiled_mma))
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, stage)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            subtile_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
            tRS_rD = cute.make_rmem_tensor(subtile_shape, self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(subtile_shape, self.d_dtype)
            subtile_size = cute.size(tRS_rD)

            store = TmaStoreEpilogue(cfg.num_epi_stages, cfg.num_mma_threads)
            is_store_warp = warp_idx == self.store_warp
            n_subtiles_n = cfg.tile_n // cfg.epi_tile[1]
            # Subtiles are visited row-major: (tile_m/epi_m, tile_n/epi_n).
            epi_tile_layout = cute.make_layout((cfg.tile_m // cfg.epi_tile[0], n_subtiles_n), stride=(n_subtiles_n, 1))
            if cutlass.const_expr(self.fusion is not None):
                # Global (m, n, l) of every accumulator element, in tRS_rAcc's order.
                extent_mn = (cute.size(mD, mode=[0]), cute.size(mD, mode=[1]))
                gcD = cute.local_tile(
                    cute.make_identity_tensor(mD.shape),
                    cute.slice_(self.tile_shape_mnk, (None, None, 0)),
                    (None, None, None),
                )

            scheduler = self._scheduler(clusters_m, clusters_n, num_batches)
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.ab_stages)
            tiles_done = Int32(0)
            work = scheduler.first()
            while scheduler.is_valid(work):
                tm, tn, tl = scheduler.tile_coord(work)

                # ---- mainloop: keep one WGMMA batch in flight, release a stage
                # only after the WGMMA that read it has retired.
                acc.fill(0.0)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                for k_tile in range(k_tiles):
                    ab_pipeline.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k_tile > 0:
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                    read_state.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                if k_tiles > 0:  # K == 0: nothing was read, acc stays zero for the epilogue
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()

                # ---- epilogue
                if cutlass.const_expr(cfg.epi_reuses_ab_smem):
                    # The other warpgroup may still be reading the A ring.
                    store.sync()
                if cutlass.const_expr(self.fusion is not None):
                    tRS_cD = tiled_copy_r2s.retile(thr_mma.partition_C(gcD[(None, None, tm, tn, tl)]))
                gD_subtiles = cute.zipped_divide(gD[(None, None, tm, tn, tl)], cfg.epi_tile)
                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                    tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_subtiles
                )
                for epi_idx in cutlass.range_constexpr(cfg.num_epi_subtiles):
                    for v in cutlass.range_constexpr(subtile_size):
                        tRS_rD[v] = tRS_rAcc[epi_idx * subtile_size + v]
                    if cutlass.const_expr(self.fusion is not None):
                        for v in cutlass.range_constexpr(subtile_size):
                            m, n, l = tRS_cD[epi_idx * subtile_size + v]
                            tRS_rD[v] = self.fusion.apply(tRS_rD[v], m, n, l, extent_mn, epi_tensors, epi_scalars)
                    tRS_rD_out.store(tRS_rD.load().to(self.d_dtype))
                    buf = stage_of(tiles_done * cfg.num_epi_subtiles + epi_idx, cfg.num_epi_stages)
                    cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
                    store.publish(
                        is_store_warp,
                        tma_d,
                        bSG_sD[(None, buf)],
                        bSG_gD[(None, epi_tile_layout.get_hier_coord(epi_idx))],
                    )
                tiles_done += 1
                work += scheduler.stride()
            store.drain(is_store_warp)
