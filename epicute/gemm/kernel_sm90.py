"""The warp-specialized, persistent SM90 GEMM with a TMA-store epilogue.

``D[l] = A[l] @ B[l]``. One CTA = one producer warpgroup + two consumer
warpgroups. Under the *cooperative* schedule both consumers split one 128-row
tile (64 rows each); under *ping-pong* each consumer owns alternate tiles of the
CTA's schedule, and two ``WarpgroupTurns`` order them: mainloops take turns at
the tensor cores, epilogues take turns at the staging buffers, so one
warpgroup's epilogue runs under the other's mainloop. Consumers working on
one tile form a *team* (both warpgroups, or one).

- producer (:meth:`GemmSm90._load_ab`: warp 0 of warpgroup 0, registers
  lowered to ``producer_regs``): walks the tile schedule and streams A/B
  k-tiles into an ``ab_stages``-deep shared-memory ring with TMA (multicast
  across the cluster when it has 2 CTAs); a kernel whose A rows are gathered
  through an index (``gather_threads``) has warps 2-3 copy A with cp.async
  instead (:meth:`GemmSm90._gather_a`) and warp 0 load B alone; with blockwise
  fp8 scales, warp 0's lanes also copy each k-tile's scales into its stage;
- consumers (:meth:`GemmSm90._consume`: registers raised to ``consumer_regs``):
  wait on the ring's full barriers, issue WGMMA with fp32 accumulators, release
  stages once the WGMMA that read them retired, then run the epilogue for that
  tile; a ping-pong warpgroup steps its ring positions over the other's tiles;
- epilogue (:meth:`GemmSm90._epilogue`: the team's threads): for each
  ``epi_tile`` subtile in row-major order, copy its accumulators out, cast,
  ``stmatrix`` into one of ``num_epi_stages`` staging buffers and publish it
  with a TMA store (:class:`~epicute.sm90.pipeline.TmaStoreEpilogue`);
- fused epilogue (optional, :mod:`epicute.sm90.epilogue_emit`): warp 1 of the
  producer warpgroup (:meth:`GemmSm90._load_epi_tiles`) TMA-loads the full-tile
  operands one subtile ahead into a ``num_c_stages`` ring; consumers fetch this
  tile's row/column vector slices before the mainloop and park them in shared
  memory after it; per element they compute the graph in fp32; aux tile
  outputs are staged and stored with D in one bulk group; reductions leave
  per-tile partials in fp32 workspaces;
- gated epilogue (optional, :mod:`epicute.epilogue.gated`): B interleaves gate and
  up columns in blocks of 8, the output tile is ``out_tile_n = tile_n / 2`` wide and
  laid out as a half-width WGMMA's accumulators, and each output value reads its gate
  and up registers from a static table (:func:`gate_up_positions`);
- split-K (optional, ``split_k``): a tile's K runs on consecutive work ids; each split
  stores its fp32 partial and the last to finish sums them in split order and runs
  the epilogue (:meth:`GemmSm90._reduce_splits`);
- swap-AB (optional, ``swap_ab``, decode GEMMs): the kernel computes D^T = B^T A^T -- the caller's B is its A,
  the caller's A its B, and D is viewed ``(N, M, L)`` and stored column-major (transposing ``stmatrix``, the TMA
  box along N); the fused epilogue it is given is the transposed one (``EpilogueFusion.transposed``).

Host tensors arrive in torch order -- A ``(L, M, K)``, B ``(L, K, N)``, D
``(L, M, N)`` with any of the supported majors, or 2-D without L in a kernel
compiled for one batch -- and are rotated to CuTe's
``(M, K, L)`` / ``(N, K, L)`` / ``(M, N, L)`` at trace time, which is free.
Problem sizes and strides are dynamic: one compiled kernel serves every shape.
Ragged edges need no code: TMA zero-fills out-of-bounds loads (so partial
k-tiles add zeros) and clips out-of-bounds stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, cute
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from epicute.epilogue.fusion import EpilogueFusion
from epicute.epilogue.gated import GATE_BLOCK
from epicute.epilogue.graph import UP_OUTPUT
from epicute.epilogue.scales import BLOCK_K
from epicute.epilogue.schedule import delay_stores, plain_graph, schedule
from epicute.errors import ConfigError
from epicute.gemm.config import (
    B_SCALE_SLOT,
    GemmConfig,
    b_scale_chunks,
    promote_chunks,
    promote_partials,
    validate_block_scaled,
)
from epicute.gemm.smem import NO_EPILOGUE, gemm_smem_layout
from epicute.sm90 import epilogue_emit as emit
from epicute.sm90.cp_async import arrive_when_copied, bulk_copy, copy_word
from epicute.sm90.epilogue_chain import EpilogueRun, StagedOutput, chain_passes, run_chain
from epicute.sm90.epilogue_emit import DSL_DTYPES
from epicute.sm90.fragments import warpgroup_slice
from epicute.sm90.l2_hints import evict_first_if
from epicute.sm90.pipeline import (
    NamedBarriers,
    RingState,
    TmaStoreEpilogue,
    WarpgroupTurns,
    make_local_tma_load_pipeline,
    make_tma_load_pipeline,
    release_if,
)
from epicute.sm90.tile_grid import cluster_counts
from epicute.sm90.tile_scheduler import ClusterTileScheduler, SplitKTileScheduler
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP

CUTLASS_DTYPES = DSL_DTYPES

#: WGMMA M of one warpgroup's atom.
WGMMA_M = 64
#: Producer warps from this one on gather A's rows where a kernel gathers them (warp 0 loads B, warp 1 the
#: epilogue's operand tiles).
GATHER_FIRST_WARP = 2


def _first_modes(t: cute.Tensor, modes: int) -> cute.Tensor:
    """``t``'s first ``modes`` modes, any further ones fixed at 0 (``t`` itself when it has no more)."""
    extra = cute.rank(t) - modes
    return t if extra == 0 else t[(*(None,) * modes, *(0,) * extra)]


def _rotate(tensor: cute.Tensor, order: list[int]) -> cute.Tensor:
    """A view of ``tensor`` with its modes permuted (no data moves)."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=order))


def _paired_half(tensor: cute.Tensor, half: int) -> cute.Tensor:
    """The ``(M, N, L)`` view of one half of a paired D ``(M, 2N, L)`` (:attr:`Graph.paired`): its blocks of
    ``GATE_BLOCK`` columns alternate, ``half`` 0 (D) first, then 1 (``D_up``). A TMA store through the view writes
    each subtile's blocks straight into their places (a 3-D box), so nothing interleaves them after the kernel."""
    blocks = cute.size(tensor, mode=[1]) // (2 * GATE_BLOCK)
    layout = cute.make_layout(
        (tensor.shape[0], (GATE_BLOCK, blocks), tensor.shape[2]),
        stride=(tensor.stride[0], (1, 2 * GATE_BLOCK), tensor.stride[2]),
    )
    return cute.make_tensor(tensor.iterator + half * GATE_BLOCK, layout)


def _batch_last(tensor: cute.Tensor, order: list[int]) -> cute.Tensor:
    """A host tensor in torch order, ``(L, X, Y)`` or an unbatched kernel's ``(X, Y)``, as CuTe's batch-last
    view ``order`` picks (``[1, 2, 0]``: ``(X, Y, L)``). A 2-D tensor becomes a batch of one: a trailing
    static mode of one element, which no index ever steps along (so the caller's own 2-D tensors reach the
    kernel as they are, with no 3-D view made per call)."""
    if cutlass.const_expr(cute.rank(tensor) == 2):
        flat = cute.select(tensor.layout, mode=[i - 1 for i in order[:2]])
        return cute.make_tensor(tensor.iterator, cute.append(flat, cute.make_layout(1)))
    return _rotate(tensor, order)


@dataclass
class CtaShared:
    """What :meth:`GemmSm90._setup` builds before the warp roles split, and they share."""

    ab_pipeline: object  # the A/B ring (``ab_stages`` deep, cluster-wide empty barriers)
    c_pipeline: object  # the epilogue-operand ring (CTA-local); None without tile operands
    sA: cute.Tensor
    sB: cute.Tensor
    sD: cute.Tensor  # D's staging buffers (the A ring's bytes when ``epi_reuses_ab_smem``)
    sC: list  # the fused epilogue's operand-tile, aux-output and vector buffers
    sAux: list
    sVec: list
    gD: cute.Tensor  # D as (tile_m, out_tile_n, tiles_m, tiles_n, L)
    k_tiles: Int32
    tAsA: cute.Tensor  # the A/B TMA partitions (smem stages, gmem k-tiles)
    tAgA: cute.Tensor
    tBsB: cute.Tensor
    tBgB: cute.Tensor
    a_mcast_mask: object  # the cluster peers our A/B loads multicast to (0: none)
    b_mcast_mask: object
    mA: cute.Tensor  # A's and B's TMA coordinates ((M, K, L), (N, K, L)) and this CTA's place in its
    mB: cute.Tensor  # cluster: grouped GEMMs partition them per tile (GroupedGemmSm90._a_k_tiles)
    cluster_coord: tuple
    sScaleA: cute.Tensor | None  # blockwise fp8: each stage's A scales (tile_m, ab_stages), B's (chunks, ab_stages)
    sScaleB: cute.Tensor | None
    sSplitArrival: cute.Tensor | None  # split-K: how many splits of the tile had finished before ours


@dataclass
class EpilogueCopies:
    """A consumer thread's epilogue copies and registers, built once (:meth:`GemmSm90._epilogue_copies`)."""

    outputs: dict  # name -> GemmOutput: D first, then the aux tiles
    tRS_rAcc: cute.Tensor  # the accumulators in the r2s copy's value order (subtiles are slices of it)
    subtile_size: int
    store: TmaStoreEpilogue
    is_store_warp: object  # the team's first warp issues its TMA stores
    epi_tile_layout: object  # subtile index -> (m, n) subtile coordinate, row-major
    # Fused epilogue only (None / empty otherwise):
    extent_mn: tuple | None  # the problem's (M, N)
    lane: object
    tRS_cT: cute.Tensor | None  # tile coordinates of this thread's values, and of thread 0's
    tRS_cT0: cute.Tensor | None
    c_s2r: dict  # per operand tile: (tiled copy, smem view, registers, retiled registers)
    # Gated only: per output value (r2s order), the positions of its gate and up values in tRS_rAcc,
    # which is then the accumulator fragment itself (static: see gate_up_positions).
    gate_up: tuple | None = None

    def acc_position(self, i: int) -> int:
        """Where output value ``i`` (r2s order over the tile) keeps its accumulator: its gate's when gated."""
        return i if self.gate_up is None else self.gate_up[0][i]


class GemmSm90:
    """Compile-time description of one GEMM kernel variant (see module docstring)."""

    #: Producer threads that gather A's rows with cp.async (:meth:`_gather_a`); 0: A arrives by TMA.
    gather_threads = 0
    #: Whether a tile may have no k-tiles where K is not zero (a variable-K grouped GEMM's empty group).
    k_tiles_may_be_zero = False

    def __init__(
        self,
        cfg: GemmConfig,
        ab_dtype: str,
        d_dtype: str,
        a_major: str,
        b_major: str,
        fusion: EpilogueFusion | None = None,
        b_dtype: str = "",
        block_scaled: bool = False,
        a_scales_tma: bool = False,
        b_scales_bulk: bool = False,
    ):
        cfg.validate()
        if block_scaled:
            validate_block_scaled(cfg)
        if (a_scales_tma or b_scales_bulk) and (not block_scaled or type(self)._scheduler is not GemmSm90._scheduler):
            raise ConfigError(f"a_scales_tma or b_scales_bulk with {type(self).__name__}: only the dense GEMM's "
                              "blockwise scales arrive by TMA or bulk copy (a grouped tile's rows are its group's); "
                              "use a_scales_tma=b_scales_bulk=False")  # fmt: skip
        if b_scales_bulk and b_scale_chunks(cfg.tile_n) != 1:
            raise ConfigError(f"b_scales_bulk with tile_n={cfg.tile_n}: a tile whose columns straddle blocks of N "
                              "reads a B scale per chunk (cp.async); use b_scales_bulk=False")  # fmt: skip
        if cfg.split_k > 1 and type(self)._scheduler is not GemmSm90._scheduler:
            raise ConfigError(f"split_k={cfg.split_k}: {type(self).__name__} schedules its own tiles and does not "
                              "split K; use split_k=1")  # fmt: skip
        if cfg.swap_ab and (type(self)._scheduler is not GemmSm90._scheduler or block_scaled):
            with_scales = " and blockwise scales" if block_scaled else ""
            raise ConfigError(f"swap_ab with {type(self).__name__}{with_scales}: only the dense GEMM without "
                              "blockwise scales swaps A and B; use swap_ab=False")  # fmt: skip
        if cfg.swap_ab and fusion is not None and fusion.buffers().transposed() is None:
            raise ConfigError("swap_ab with an epilogue that has tile operands, aux tiles, reductions, group "
                              "quantization or gating: its D^T form stores only D; use swap_ab=False")  # fmt: skip
        if cfg.split_k > 1 and fusion is not None and fusion.buffers().loads_tiles:
            raise ConfigError(f"split_k={cfg.split_k} with an epilogue that reads full-tile operands: they stream "
                              "in ahead of the tile, before it is known which split runs the epilogue; use "
                              "split_k=1")  # fmt: skip
        self.block_scaled = block_scaled
        self.a_scales_tma = a_scales_tma
        self.b_scales_bulk = b_scales_bulk
        self.fusion = fusion
        self.cfg = cfg
        # Swap-AB: the kernel's A is the caller's B^T, its B the caller's A^T, its D the caller's D^T (column-major).
        if cfg.swap_ab:
            ab_dtype, b_dtype = b_dtype or ab_dtype, ab_dtype if b_dtype else ""
            a_major, b_major = ("k" if b_major == "k" else "m"), ("k" if a_major == "k" else "n")
        self.ab_dtype = CUTLASS_DTYPES[ab_dtype]  # A's (and B's, unless b_dtype names B's: fp8 may mix)
        self.b_dtype = CUTLASS_DTYPES[b_dtype or ab_dtype]
        self.d_dtype = CUTLASS_DTYPES[d_dtype]
        self.ab_dtype_name = ab_dtype
        self.d_dtype_name = d_dtype
        self.acc_dtype = cutlass.Float32
        # (M, K) with K contiguous is row-major; (N, K) with K contiguous too.
        self.a_layout = LayoutEnum.ROW_MAJOR if a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.COL_MAJOR if cfg.swap_ab else LayoutEnum.ROW_MAJOR
        self.tile_shape_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.cluster_shape_mn = (cfg.cluster_m, cfg.cluster_n)
        # An A tile is shared by the CTAs of one cluster row (same M, other N);
        # a B tile by the CTAs of one cluster column.
        self.a_mcast_ctas = cfg.cluster_n
        self.b_mcast_ctas = cfg.cluster_m
        #: Paired tiles (grouped): no operand is split between the peers; whichever the tile shares, one CTA loads
        #: it whole and multicasts it to both (:meth:`_tile_multicast`), so both atoms are multicast ones.
        self.paired = cfg.pair_tiles
        if self.paired:
            self.a_mcast_ctas = self.b_mcast_ctas = 1
        #: The CTAs whose loads write into a CTA's ring stage (its consumers release the stage to each).
        self.ring_peers = cfg.cluster_size if self.paired else self.a_mcast_ctas + self.b_mcast_ctas - 1
        self.load_warp = 0
        # A second producer warp streams the epilogue's operand tiles, so the
        # mainloop's loads never wait behind them.
        self.epi_load_warp = 1
        self.epi_buffers = fusion.buffers() if fusion is not None else NO_EPILOGUE
        # A gated epilogue pairs each output column's gate and up accumulators: the output tile (what the
        # epilogue, its operands and the stores see) has half the accumulator tile's columns.
        self.gated = self.epi_buffers.gated
        #: D and ``D_up`` store interleaved into one D of twice the output's columns (:func:`_paired_half`).
        self.paired_d = fusion is not None and fusion.paired
        self.out_tile_n = self.epi_buffers.out_tile_n(cfg.tile_n)
        if self.out_tile_n % cfg.epi_tile[1]:
            raise ConfigError(
                f"epi_tile={cfg.epi_tile} with a gated epilogue: its N must divide the output tile's "
                f"{self.out_tile_n} columns (tile_n={cfg.tile_n} / 2)"
            )
        self.num_epi_subtiles = (cfg.tile_m // cfg.epi_tile[0]) * (self.out_tile_n // cfg.epi_tile[1])
        #: The epilogue the kernel runs: the fusion's chain, or the plain one (cast and store D).
        self.chain = fusion.stages if fusion is not None else schedule(plain_graph(d_dtype)).stages
        if cfg.delay_tma_store:
            self.chain = delay_stores(self.chain)
        #: D's staging slots: its own ring's, or (ReuseSmemC) the operand ring's, whose slot a subtile's operand
        #: arrived in and its D leaves from
        self.d_stages = cfg.num_c_stages if cfg.reuse_smem_c else cfg.num_epi_stages
        self.smem = gemm_smem_layout(cfg, ab_dtype, d_dtype, self.epi_buffers, b_dtype, block_scaled)
        # Blockwise scales ride in the A/B ring: the load warp copies each k-tile's into the stage, A's by one TMA
        # copy and B's by one bulk copy where their layouts allow, else A's a word per row per lane and B's by
        # lane 0 with cp.async (then every lane arrives on the stage's barrier once its copies landed).
        self.scale_copy_threads = 32 if block_scaled and not (a_scales_tma and b_scales_bulk) else 0
        self.b_scale_chunks = b_scale_chunks(cfg.tile_n) if block_scaled else 0

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mA_lmk: cute.Tensor,
        mB_lkn: cute.Tensor,
        mD_lmn: cute.Tensor,
        epi_tensors: tuple,
        epi_scalars: tuple,
        block_scales: tuple,
        split_workspace: tuple,
        max_active_clusters: Int32,
        stream,
    ):
        """``epi_tensors``/``epi_scalars``: the fused epilogue's operands (see epilogue_emit).
        ``block_scales``: ``()``, or blockwise fp8 scales ``(A (L, M, KB), B (L, NB, KB))`` fp32, copied into
        the A/B ring by the load warp (:meth:`_copy_block_scales`): A's by TMA (``a_scales_tma``: M-major, 16-byte
        aligned strides) or element by element, of any strides; B's by a bulk copy (``b_scales_bulk``: K-major,
        16-byte aligned rows) or element by element.
        ``max_active_clusters``: a persistent grid's cluster budget on this GPU (the host's
        ``GemmPlan.max_active_clusters``: SMs // cluster size), a runtime value so that one
        compiled kernel serves every SM count; one-tile-per-CTA variants ignore it.
        ``split_workspace``: ``()``, or with ``split_k`` > 1 the fp32 partial tiles and int32 arrival counters
        of :meth:`_reduce_splits` (flat; the counters zero, and left zero)."""
        self._launch_batched(mA_lmk, mB_lkn, mD_lmn, epi_tensors, epi_scalars, block_scales, max_active_clusters,
                             stream, split_workspace)  # fmt: skip

    @cute.jit
    def _launch_batched(self, mA_lmk, mB_lkn, mD_lmn, epi_tensors, epi_scalars, block_scales, max_active_clusters,
                        stream, sched_prefix: tuple = ()):  # fmt: skip
        """:meth:`__call__`'s launch over D's ``(M, N)`` tiles of every batch; ``sched_args`` are ``sched_prefix``
        (what the scheduler reads besides: split-K's workspace, variable K's offsets) then the cluster counts."""
        mA = _batch_last(mA_lmk, [1, 2, 0])  # (M, K, L)
        mB = _batch_last(mB_lkn, [2, 1, 0])  # (N, K, L)
        mD = _batch_last(mD_lmn, [1, 2, 0])  # (M, N, L)
        if cutlass.const_expr(self.paired_d):  # D's half of the (M, 2N, L) tensor its D_up shares
            mD = _paired_half(mD, 0)
        if cutlass.const_expr(self.cfg.swap_ab):  # D^T = B^T A^T: (N, K, L) x (M, K, L) -> (N, M, L), N contiguous
            mA, mB, mD = mB, mA, _rotate(mD, [1, 0, 2])
        tiles_m = cute.ceil_div(cute.size(mD, mode=[0]), self.cfg.tile_m)
        tiles_n = cute.ceil_div(cute.size(mD, mode=[1]), self.out_tile_n)
        num_batches = cute.size(mD, mode=[2])
        clusters_m, clusters_n, total_clusters = cluster_counts(tiles_m, tiles_n, num_batches, self.cluster_shape_mn)
        # The plan's grid by the same function; the tile scheduler strides by gridDim.z, so
        # whatever this launches, the persistent clusters cover every tile (every split) exactly once.
        work = total_clusters * self.cfg.split_k
        launched = ClusterTileScheduler.grid(work, max_active_clusters, self.cfg.persistent, cutlass.min)
        sched_args = (*sched_prefix, clusters_m, clusters_n, num_batches)
        self._launch(mA, mB, mD, epi_tensors, epi_scalars, block_scales, sched_args, launched, stream)

    @cute.jit
    def _launch(self, mA, mB, mD, epi_tensors, epi_scalars, block_scales, sched_args: tuple, launched, stream):
        """Build the TMA atoms and shared-memory layouts of ``(M, K, L)`` A, ``(N, K, L)`` B and
        ``(M, N, L)`` D, and launch ``launched`` clusters; ``sched_args`` are what :meth:`_scheduler`
        builds each role's tile scheduler from. Outputs are stored through :meth:`_store_view`."""
        cfg = self.cfg
        tiled_mma = self._make_tiled_mma(cfg.tile_n)
        a_smem_staged = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_shape_mnk, self.ab_dtype, cfg.ab_stages)
        b_smem_staged = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_shape_mnk, self.b_dtype, cfg.ab_stages)
        d_smem_staged = (
            self._epi_smem_layout(self.d_dtype_name, cfg.num_epi_stages, paired=True)
            if self.paired_d
            else sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, cfg.epi_tile, self.d_stages)
        )

        tma_a, tma_mA = self._make_tma_load(self._load_view(mA), a_smem_staged, (cfg.tile_m, cfg.tile_k),
                                            self.a_mcast_ctas, self.paired)  # fmt: skip
        tma_b, tma_mB = self._make_tma_load(self._load_view(mB), b_smem_staged, (cfg.tile_n, cfg.tile_k),
                                            self.b_mcast_ctas, self.paired)  # fmt: skip
        if cutlass.const_expr(self.a_scales_tma):
            # A's scales (L, M, KB), M-major, as (M, KB, L): a k-tile's box is the tile's rows of one block of K.
            # Rows past M arrive as zeros (their products are never stored). Not multicast: 512 bytes per CTA.
            sfa, sfb = block_scales
            tma_sfa, tma_mSFA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), _rotate(sfa, [1, 2, 0]),
                cute.make_layout((cfg.tile_m, 1)), (cfg.tile_m, 1),
            )  # fmt: skip
            block_scales = ((tma_sfa, tma_mSFA), sfb)
        tma_d, tma_mD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            self._store_view(mD),
            cute.slice_(d_smem_staged, (None, None, 0)),
            cfg.epi_tile,
        )

        # Fused epilogue: TMA atoms for operand tiles (loads) and aux outputs
        # (stores); vectors and reduction workspaces are indexed element-wise in
        # their torch (batch-first) order.
        epi_loads, epi_stores, epi_vectors, epi_workspaces = (), (), (), ()
        if cutlass.const_expr(self.fusion is not None):
            for (role, name, dtype), t in zip(self.fusion.tensor_args, epi_tensors):
                if cutlass.const_expr(role == "tile"):
                    layout = self._epi_smem_layout(dtype, cfg.num_c_stages)
                    epi_loads += (cute.nvgpu.cpasync.make_tiled_tma_atom(
                        cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), _rotate(t, [1, 2, 0]),
                        cute.slice_(layout, (None, None, 0)), cfg.epi_tile),)  # fmt: skip
                elif cutlass.const_expr(role == "aux"):
                    paired = self.paired_d and name == UP_OUTPUT
                    layout = self._epi_smem_layout(dtype, cfg.num_epi_stages, paired)
                    view = _rotate(t, [1, 2, 0])
                    if cutlass.const_expr(paired):  # D's tensor, the other half
                        view = _paired_half(view, 1)
                    epi_stores += (cute.nvgpu.cpasync.make_tiled_tma_atom(
                        cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), self._store_view(view),
                        cute.slice_(layout, (None, None, 0)), cfg.epi_tile),)  # fmt: skip
                elif cutlass.const_expr(role in ("workspace", "group_scales")):  # the scales last
                    epi_workspaces += (t,)
                else:
                    epi_vectors += (t,)

        # The storage struct and explain's table are one object (epicute.gemm.smem); the buffers'
        # element counts are the staged layouts' (checked here, at trace time).
        for field, staged in (("sA", a_smem_staged), ("sB", b_smem_staged), ("sD", d_smem_staged)):
            assert cute.cosize(staged) == self.smem.buffer(field).count, (field, cute.cosize(staged))
        self.shared_storage = self.smem.struct()

        self.kernel(
            tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_d, tma_mD,
            a_smem_staged, b_smem_staged, d_smem_staged, sched_args,
            epi_loads, epi_stores, epi_vectors, epi_workspaces, epi_scalars, block_scales,
        ).launch(
            grid=(cfg.cluster_m, cfg.cluster_n, launched),
            block=[cfg.num_threads, 1, 1],
            cluster=(cfg.cluster_m, cfg.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    def _make_tiled_mma(self, tile_n: int):
        """The team's WGMMA over a ``tile_m x tile_n`` tile (a gated epilogue lays its outputs out as the
        accumulators of one half as wide)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.cfg.tile_warpgroups, 1, 1),
            tiler_mn=(WGMMA_M, tile_n),
        )

    def _store_view(self, tensor: cute.Tensor) -> cute.Tensor:
        """The ``(M, N, L)`` view an output's TMA store atom describes (the dense GEMM: the tensor itself)."""
        return tensor

    @staticmethod
    def _make_tma_load(tensor, smem_staged, smem_tile, mcast_ctas: int, multicast_whole: bool = False):
        """A TMA load atom whose box is split between ``mcast_ctas`` peers that multicast their parts, or
        (``multicast_whole``) a whole box one CTA may multicast."""
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if mcast_ctas > 1 or multicast_whole
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), smem_tile, num_multicast=mcast_ctas
        )

    def _load_view(self, tensor: cute.Tensor) -> cute.Tensor:
        """The view of ``(rows, K, L)`` A or B that its TMA load descriptor is built over: the tensor itself."""
        return tensor

    def _epi_smem_layout(self, dtype: str, stages: int, paired: bool = False):
        """Staged, swizzled smem layout of one epilogue subtile of ``dtype`` (row-major, like D). A paired half's
        (:func:`_paired_half`) is stored by column blocks of ``GATE_BLOCK``, not swizzled: its TMA box rows are one
        16-byte block, and a swizzled box lays each row out at the swizzle's width (4x the buffer at 64 bytes).
        Block by block, a subtile's rows of one block are 16-byte neighbours: the r2s copy's 8-row ``stmatrix``
        writes meet no bank twice, and the box (block, row, block index) is dense."""
        if paired:
            m, n = self.cfg.epi_tile
            blocks = cute.make_layout((m, (GATE_BLOCK, n // GATE_BLOCK), stages),
                                      stride=(GATE_BLOCK, (1, GATE_BLOCK * m), m * n))  # fmt: skip
            return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, blocks)
        return sm90_utils.make_smem_layout_epi(DSL_DTYPES[dtype], LayoutEnum.ROW_MAJOR, self.cfg.epi_tile, stages)

    def _scheduler(self, sched_args: tuple) -> ClusterTileScheduler:
        """A role's tile scheduler. Each role builds its own (the DSL cannot carry Python objects across a
        runtime branch); the schedule is static, so they agree tile for tile. Its ``coord(work)`` starts
        with ``(tile_m, tile_n, batch)``."""
        if cutlass.const_expr(self.cfg.split_k > 1):  # sched_args: the split workspace, then the counts
            clusters_m, clusters_n, num_batches = sched_args[2:]
            return SplitKTileScheduler(clusters_m, clusters_n, num_batches, self.cluster_shape_mn, self.cfg.swizzle,
                                       self.cfg.raster_along_m, self.cfg.split_k)  # fmt: skip
        clusters_m, clusters_n, num_batches = sched_args
        return ClusterTileScheduler(
            clusters_m, clusters_n, num_batches, self.cluster_shape_mn, self.cfg.swizzle, self.cfg.raster_along_m
        )

    def _output_tiles(self, tensor: cute.Tensor) -> cute.Tensor:
        """``tensor`` (M, N, L) viewed as (tile_m, out_tile_n, tiles_m, tiles_n, L)."""
        return cute.local_tile(tensor, (self.cfg.tile_m, self.out_tile_n), (None, None, None))

    def _subtile_partition(self, atom, smem_staged: cute.Tensor, tiles: cute.Tensor, coord: tuple, store: bool):
        """TMA (smem, gmem) partitions of the output tile at scheduler coordinate ``coord`` in ``epi_tile``
        subtiles (a smem stage and a gmem subtile are both one TMA box); ``tiles`` is what
        :meth:`_output_tiles` made, ``store`` says whether TMA stores through it or loads."""
        tm, tn, tl = coord[0], coord[1], coord[2]
        return self._partition_subtiles(atom, smem_staged, tiles[(None, None, tm, tn, tl)])

    def _partition_subtiles(self, atom, smem_staged: cute.Tensor, tile: cute.Tensor):
        return cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(smem_staged, 0, 2),
            cute.zipped_divide(tile, self.cfg.epi_tile),
        )  # fmt: skip

    def _a_k_tiles(self, cta, tma_a, coord: tuple) -> cute.Tensor:
        """The producer's TMA view of A's k-tiles for the tile at ``coord``: ``(TMA, k_tile)``."""
        return cta.tAgA[(None, coord[0], None, coord[2])]

    def _epilogue_frame(self, coord: tuple, extent_mn: tuple) -> tuple:
        """``(origin, extent, batch)`` of the tile at ``coord`` as the fused epilogue sees it: the global
        ``(m, n)`` of its corner, the ``(M, N)`` past which nothing is stored or reduced, and the batch
        index of its operands (the problem's ``extent_mn`` here)."""
        tm, tn, tl = coord[0], coord[1], coord[2]
        return (tm * self.cfg.tile_m, tn * self.out_tile_n), extent_mn, tl

    def _partials_origin(self, coord: tuple):
        """The row of the tile's own column and whole-tile reduction slots, or None: its partials go to the 16-row
        bands of its global rows (tiles of one output never share a band)."""
        return None

    def _subtile_order(self):
        """Subtile index -> (m, n) subtile coordinate: row-major over (tile_m/epi_m, tile_n/epi_n), the
        order in which the epilogue stores subtiles and the epilogue-load warp fills its ring."""
        n_subtiles_n = self.out_tile_n // self.cfg.epi_tile[1]
        return cute.make_layout((self.cfg.tile_m // self.cfg.epi_tile[0], n_subtiles_n), stride=(n_subtiles_n, 1))

    def _b_k_tiles(self, cta, tma_b, coord: tuple) -> cute.Tensor:
        """The producer's TMA view of B's k-tiles for the tile at ``coord``: ``(TMA, k_tile)``."""
        return cta.tBgB[(None, coord[1], None, coord[2])]

    def _tile_multicast(self, cta, coord: tuple) -> tuple:
        """``(A's multicast mask, B's, whether this CTA loads A, whether it loads B)`` for the tile at ``coord``:
        here the cluster's fixed masks, both loaded (each CTA its part of a shared box)."""
        return cta.a_mcast_mask, cta.b_mcast_mask, True, True

    def _k_tiles(self, cta, coord: tuple):
        """How many k-tiles the tile at ``coord`` reduces over (every tile's K, here; its split's share of them
        with ``split_k``: ``ceil(k_tiles / split_k)`` each, the last ones fewer or none)."""
        if cutlass.const_expr(self.cfg.split_k > 1):
            share = cute.ceil_div(cta.k_tiles, self.cfg.split_k)
            return cutlass.max(cutlass.min(share, cta.k_tiles - coord[3] * share), 0)
        return cta.k_tiles

    def _k_first(self, cta, coord: tuple):
        """The first k-tile the tile at ``coord`` reduces over (its split's, with ``split_k``)."""
        if cutlass.const_expr(self.cfg.split_k > 1):
            return coord[3] * cute.ceil_div(cta.k_tiles, self.cfg.split_k)
        return 0

    def _fix_stage(self, cta, coord: tuple, k_tile, stage, mma_tidx) -> None:
        """A consumer's last word on a filled A/B stage before its WGMMAs read it (nothing here: TMA
        already zero-filled whatever lies outside A and B)."""

    def _a_scale_rows(self, rows: list, sched_args: tuple) -> list:
        """The rows of the blockwise A scales the thread's accumulator rows read (the rows themselves here)."""
        return rows

    def _check_accumulator(self, acc: cute.Tensor, coord: tuple) -> None:
        """A consumer's last word on a tile's accumulator before its epilogue: a kernel that can tell, on the
        device, that a tile's inputs break its contract poisons the tile here (nothing to check here)."""

    def _skip_tiles(self, cta, scheduler, work, tiles, read_state, release_state, c_state):
        """Step a consumer's ring positions over ``tiles`` tiles of other teams, the schedule's from ``work`` on."""
        k_tiles = self._k_tiles_over(cta, scheduler, work, tiles)
        read_state.advance(k_tiles)
        release_state.advance(k_tiles)
        if cutlass.const_expr(self.epi_buffers.loads_tiles):
            c_state.advance(tiles * self.num_epi_subtiles)

    def _k_tiles_over(self, cta, scheduler, work, tiles):
        """The k-tiles the ring carries for ``tiles`` tiles of the schedule from ``work`` on: every tile's K here."""
        return tiles * cta.k_tiles

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
        sched_args: tuple,
        epi_loads: tuple,
        epi_stores: tuple,
        epi_vectors: tuple,
        epi_workspaces: tuple,
        epi_scalars: tuple,
        block_scales: tuple,
    ):
        """Shared setup, then each warp's role (see the module docstring).

        The role methods are ``cute.jit``, so they inline as they are traced. A runtime loop
        carries exactly those names defined before it that its body assigns or calls a method
        on: a ring position advanced inside a helper must come back and be reassigned (see
        :meth:`_epilogue`), and the order those names first appear in a loop body shows in
        the PTX (its register numbering), so moving code between a loop and a helper can
        change the kernel even when it computes the same thing.
        """
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        cta = self._setup(
            warp_idx, tma_a, mA, tma_b, mB, tma_d, mD, a_smem_staged, b_smem_staged, d_smem_staged,
            epi_loads, epi_stores,
        )  # fmt: skip
        if warpgroup_idx == 0:
            # Producer warpgroup: its registers go to the consumers.
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == self.load_warp:
                self._load_ab(cta, tma_a, tma_b, sched_args, block_scales)
            if cutlass.const_expr(self.gather_threads > 0):  # noqa: SIM102 - compile-time guard, dynamic if
                if warp_idx >= GATHER_FIRST_WARP:
                    self._gather_a(cta, sched_args)
            if cutlass.const_expr(self.epi_buffers.loads_tiles):  # noqa: SIM102 - compile-time guard, dynamic if
                if warp_idx == self.epi_load_warp:
                    self._load_epi_tiles(cta, epi_loads, sched_args)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            self._consume(
                cta, tiled_mma, tma_d, mD, tidx, sched_args, epi_vectors, epi_stores, epi_workspaces, epi_scalars,
                block_scales,
            )  # fmt: skip

    @cute.jit
    def _setup(
        self, warp_idx, tma_a, mA, tma_b, mB, tma_d, mD, a_smem_staged, b_smem_staged, d_smem_staged,
        epi_loads, epi_stores,
    ):  # fmt: skip
        """What every role shares (:class:`CtaShared`), built by all threads before they split.

        Prefetches the TMA descriptors (load warp), carves shared memory, initializes the
        A/B ring's barriers (and the epilogue-operand ring's, created first so that the A/B
        ring's init fence covers it) and partitions A and B for the producer's TMA. Ends with
        the cluster barrier (a CTA sync without a cluster): no CTA may multicast into a peer
        before that peer's barriers are initialized.
        """
        cfg = self.cfg
        if warp_idx == self.load_warp:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
            for atom, _ in epi_loads + epi_stores:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        # Position inside the cluster, and which peers our multicasts reach.
        cta_layout_mnk = cute.make_layout((cfg.cluster_m, cfg.cluster_n, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mcast_mask = a_mcast_mask if self.a_mcast_ctas > 1 else 0
        b_mcast_mask = b_mcast_mask if self.b_mcast_ctas > 1 else 0

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        if cutlass.const_expr(not self.gather_threads):  # gathered A rows arrive by cp.async, not as TMA bytes
            tx_bytes += cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
        if cutlass.const_expr(self.a_scales_tma):
            tx_bytes += cfg.tile_m * 4  # the k-tile's A scales, fp32
        if cutlass.const_expr(self.b_scales_bulk):
            tx_bytes += B_SCALE_SLOT * 4  # the bulk copy holding the k-tile's B scale
        c_pipeline = None
        if cutlass.const_expr(self.epi_buffers.loads_tiles):
            c_tx_bytes = sum(cfg.epi_tile[0] * cfg.epi_tile[1] * DSL_DTYPES[d].width // 8
                             for d in self.epi_buffers.tile_inputs)  # fmt: skip
            # Created first: the mainloop ring's init fence and sync below cover it.
            c_pipeline = make_local_tma_load_pipeline(
                storage.epi_barriers.data_ptr(), cfg.num_c_stages, c_tx_bytes, cfg.tile_threads // 32
            )
        ab_pipeline = make_tma_load_pipeline(
            storage.ab_barriers.data_ptr(),
            cfg.ab_stages,
            tx_bytes,
            num_consumer_warps=cfg.tile_threads // 32,  # a stage feeds one tile's team
            cluster_shape_mn=self.cluster_shape_mn,
            mcast_ctas=self.ring_peers,
            async_copy_threads=self.gather_threads + self.scale_copy_threads,
        )
        # Peers must see our initialized barriers before any multicast lands.
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_arrive_relaxed()

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sScaleA = sScaleB = None
        if cutlass.const_expr(self.block_scaled):
            sScaleA = storage.sScaleA.get_tensor(cute.make_layout((cfg.tile_m, cfg.ab_stages)))
            sScaleB = storage.sScaleB.get_tensor(
                cute.make_layout((B_SCALE_SLOT, cfg.ab_stages), stride=(1, B_SCALE_SLOT))
            )  # fmt: skip
        sSplitArrival = None
        if cutlass.const_expr(cfg.split_k > 1):
            sSplitArrival = storage.split_arrival.get_tensor(cute.make_layout(1))
        if cutlass.const_expr(cfg.epi_reuses_ab_smem):
            # Non-persistent: the A ring is idle once the only mainloop is done.
            d_ptr = cute.recast_ptr(storage.sA.data_ptr(), d_smem_staged.inner, dtype=self.d_dtype)
            sD = cute.make_tensor(d_ptr, d_smem_staged.outer)
        elif cutlass.const_expr(cfg.reuse_smem_c):
            # ReuseSmemC: the first operand tile's ring, the same subtile layout and dtype as D's.
            d_ptr = cute.recast_ptr(storage.epi_tile_0.data_ptr(), d_smem_staged.inner, dtype=self.d_dtype)
            sD = cute.make_tensor(d_ptr, d_smem_staged.outer)
        else:
            sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        # The fused epilogue's buffers: fields of the same struct (epicute.gemm.smem).
        sC, sAux, sVec = [], [], []
        for i, dtype in enumerate(self.epi_buffers.tile_inputs):
            layout = self._epi_smem_layout(dtype, cfg.num_c_stages)
            sC.append(getattr(storage, f"epi_tile_{i}").get_tensor(layout.outer, swizzle=layout.inner))
        aux_names = self.fusion.aux_outputs if self.fusion is not None else ()
        for i, (name, dtype) in enumerate(zip(aux_names, self.epi_buffers.aux_outputs)):
            layout = self._epi_smem_layout(dtype, cfg.num_epi_stages, self.paired_d and name == UP_OUTPUT)
            sAux.append(getattr(storage, f"epi_aux_{i}").get_tensor(layout.outer, swizzle=layout.inner))
        for i, kind in enumerate(self.epi_buffers.vectors):
            length = self.out_tile_n if kind == "row" else cfg.tile_m
            sVec.append(getattr(storage, f"epi_vec_{i}").get_tensor(cute.make_layout(length)))

        # Global tiles: (bM, bK, RestM, RestK, L) etc. (A ragged load view's extra modes at 0: its tiles are cut
        # per unit, by the subclass that made it.)
        gA = cute.local_tile(_first_modes(mA, 3), cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None,) * 3)
        gB = cute.local_tile(_first_modes(mB, 3), cute.slice_(self.tile_shape_mnk, (0, None, None)), (None,) * 3)
        gD = self._output_tiles(mD)
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            cluster_coord[1] if self.a_mcast_ctas > 1 else 0,
            cute.make_layout(self.a_mcast_ctas),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            cluster_coord[0] if self.b_mcast_ctas > 1 else 0,
            cute.make_layout(self.b_mcast_ctas),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        return CtaShared(
            ab_pipeline, c_pipeline, sA, sB, sD, sC, sAux, sVec, gD, k_tiles,
            tAsA, tAgA, tBsB, tBgB, a_mcast_mask, b_mcast_mask, mA, mB, cluster_coord, sScaleA, sScaleB,
            sSplitArrival,
        )  # fmt: skip

    @cute.jit
    def _load_ab(self, cta, tma_a, tma_b, sched_args, block_scales):
        """The A/B load warp (producer warp ``load_warp``): walks the tile schedule and TMA-loads
        every tile's k-tiles into the A/B ring (multicast across the cluster when it has 2 CTAs).

        Owns the ring's producer side: acquires a stage (waits on its empty barrier, released by
        the consumers of every CTA the stage's loads reach), arms its full barrier with its bytes.
        Blockwise fp8: its lanes also copy the k-tile's scales into the stage (:meth:`_copy_block_scales`).
        """
        cfg = self.cfg
        ab_pipeline = cta.ab_pipeline
        tAsA, tBsB = cta.tAsA, cta.tBsB
        a_policy, b_policy = evict_first_if(cfg.evict_first == "a"), evict_first_if(cfg.evict_first == "b")
        scheduler = self._scheduler(sched_args)
        state = RingState.producer(cfg.ab_stages, tracked=True)
        work = scheduler.first()
        while scheduler.is_valid(work):
            tile_coord = scheduler.coord(work)
            tAgA_tile = self._a_k_tiles(cta, tma_a, tile_coord)
            tBgB_tile = self._b_k_tiles(cta, tma_b, tile_coord)
            a_mcast_mask, b_mcast_mask, load_a, load_b = self._tile_multicast(cta, tile_coord)
            scale_sources = None
            if cutlass.const_expr(self.block_scaled):
                scale_sources = self._block_scale_sources(cta, tile_coord, block_scales, sched_args)
            k_first = self._k_first(cta, tile_coord)
            for k_tile in range(self._k_tiles(cta, tile_coord)):
                ab_pipeline.producer_acquire(state)
                barrier = ab_pipeline.producer_get_barrier(state)
                if cutlass.const_expr(not self.gather_threads):  # noqa: SIM102 - compile-time guard, dynamic if
                    if load_a:
                        cute.copy(tma_a, tAgA_tile[(None, k_first + k_tile)], tAsA[(None, state.index)],
                                  tma_bar_ptr=barrier, mcast_mask=a_mcast_mask, cache_policy=a_policy)  # fmt: skip
                if load_b:
                    cute.copy(tma_b, tBgB_tile[(None, k_first + k_tile)], tBsB[(None, state.index)],
                              tma_bar_ptr=barrier, mcast_mask=b_mcast_mask, cache_policy=b_policy)  # fmt: skip
                if cutlass.const_expr(self.block_scaled):
                    self._copy_block_scales(cta, block_scales, scale_sources, state.index, k_first + k_tile, barrier)
                ab_pipeline.producer_commit(state)  # no-op for TMA: bytes arm the barrier
                state.advance()
            work = scheduler.next(work)
        # Stay alive until consumers (ours and peers') released every
        # stage, so no remote arrive targets an exited CTA.
        ab_pipeline.producer_tail(state)

    def _block_scale_sources(self, cta, coord: tuple, block_scales: tuple, sched_args: tuple) -> tuple:
        """Where the load warp reads the tile's blockwise scales: ``(A's, batch, B's)``. A's are the tile's
        ``(TMA, k_tile)`` view with its smem stages (``a_scales_tma``), or the rows the lane copies (lane, lane +
        32, ..., clamped to the problem's rows: rows past M compute values never stored). B's are the block of N
        of each chunk of the tile's columns (``b_scale_chunks``), clamped to B's blocks (for a tile or a cluster's
        spare tile past N). A grouped GEMM's tile starts at its group's row and reads its group's B."""
        sfa, sfb = block_scales
        lane = cute.arch.lane_idx()
        rows_total = cute.size(sfa[1], mode=[0]) if self.a_scales_tma else cute.size(sfa, mode=[1])
        origin, extent, batch = self._epilogue_frame(coord, (rows_total, 0))
        chunk = self.cfg.tile_n // self.b_scale_chunks
        n_blocks = [
            cutlass.min((coord[1] * self.cfg.tile_n + c * chunk) // BLOCK_K, cute.size(sfb, mode=[1]) - 1)
            for c in range(self.b_scale_chunks)
        ]
        if cutlass.const_expr(self.a_scales_tma):
            tma_sfa, tma_mSFA = sfa
            gSFA = cute.local_tile(tma_mSFA, (self.cfg.tile_m, 1), (None, None, None))  # (tile_m, 1, tiles, KB, L)
            sSFA = cute.make_tensor(cta.sScaleA.iterator, cute.make_layout((self.cfg.tile_m, 1, self.cfg.ab_stages)))
            tSFAs, tSFAg = cute.nvgpu.cpasync.tma_partition(
                tma_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2)
            )  # fmt: skip
            return (tSFAs, tSFAg[(None, coord[0], None, batch)]), batch, n_blocks
        rows = [cutlass.min(origin[0] + lane + 32 * i, extent[0] - 1) for i in range(self.cfg.tile_m // 32)]
        return self._a_scale_rows(rows, sched_args), batch, n_blocks

    @cute.jit
    def _copy_block_scales(self, cta, block_scales: tuple, sources: tuple, stage, k_tile, barrier) -> None:
        """Copy k-tile ``k_tile``'s scales into ring stage ``stage``, the bytes of A's TMA copy and B's bulk copy
        (``a_scales_tma``, ``b_scales_bulk``) expected by the stage's barrier; else A's a word per row by each
        lane and B's (a block per chunk of the tile's columns) by lane 0 with cp.async, every lane then arriving
        on the barrier once its copies land. Consumers read them from shared memory after the barrier they wait
        on anyway: a scale loaded from global memory by a consumer stalls its warpgroup's next WGMMAs for an L2
        round trip unless loaded several k-tiles ahead. Four 4-byte cp.async per lane cost ~12 % of the
        blockwise GEMM's time against A's TMA copy (bench/NOTES.md)."""
        sfa, sfb = block_scales
        a_source, batch, n_blocks = sources
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.a_scales_tma):
            tSFAs, tSFAg = a_source
            cute.copy(sfa[0], tSFAg[(None, k_tile)], tSFAs[(None, stage)], tma_bar_ptr=barrier)
        else:
            for i, row in enumerate(a_source):
                dst = cta.sScaleA.iterator + (stage * self.cfg.tile_m + lane + 32 * i)
                copy_word(dst, sfa.iterator + cute.crd2idx((batch, row, k_tile), sfa.layout))
        if lane == 0:
            b_slot = cta.sScaleB.iterator + stage * B_SCALE_SLOT
            if cutlass.const_expr(self.b_scales_bulk):
                # The aligned group of B_SCALE_SLOT blocks of K holding the k-tile's: 16 aligned bytes of the
                # row (its stride and base are 16-byte aligned). Past KB they are the row's padding, or bytes in
                # the same 16-byte granule as its last block, which no allocation ends inside.
                group = k_tile - k_tile % B_SCALE_SLOT
                bulk_copy(b_slot, sfb.iterator + cute.crd2idx((batch, n_blocks[0], group), sfb.layout),
                          B_SCALE_SLOT * 4, barrier)  # fmt: skip
            else:
                for c, n_block in enumerate(n_blocks):
                    copy_word(b_slot + c, sfb.iterator + cute.crd2idx((batch, n_block, k_tile), sfb.layout))
        if cutlass.const_expr(self.scale_copy_threads > 0):
            arrive_when_copied(barrier)

    def _b_scale_offset(self, k_tile):
        """Where a stage's B scale sits in its slot: the k-tile's place in its bulk-copied group of blocks
        (``k_tile``: the problem's k-tile index), or the slot's start (cp.async)."""
        if cutlass.const_expr(self.b_scales_bulk):
            return k_tile % B_SCALE_SLOT
        return 0

    def _gather_a(self, cta, sched_args) -> None:
        """Producer warps ``GATHER_FIRST_WARP``.. where ``gather_threads`` is set: fill every stage's A with
        cp.async (a kernel whose A rows are not one TMA box overrides it)."""
        raise NotImplementedError(f"{type(self).__name__} loads A by TMA")

    @cute.jit
    def _load_epi_tiles(self, cta, epi_loads, sched_args):
        """The epilogue-operand load warp (producer warp ``epi_load_warp``, fused epilogues with
        tile operands only): TMA-loads each tile's operand tiles one ``epi_tile`` subtile per
        stage of the CTA-local ``num_c_stages`` ring, in the consumers' subtile order, so the
        mainloop's loads never wait behind them.

        Owns that ring's producer side: acquires a stage (waits on the empty barrier the
        consumers release after copying it to registers), arms its full barrier with the bytes.
        """
        cfg = self.cfg
        c_pipeline, sC = cta.c_pipeline, cta.sC
        # One stage = one epilogue subtile of every operand tile, in the
        # consumers' subtile order; the ring runs ahead by num_c_stages.
        scheduler = self._scheduler(sched_args)
        fill_state = RingState.producer(cfg.num_c_stages, tracked=True)
        epi_tile_layout = self._subtile_order()
        work = scheduler.first()
        while scheduler.is_valid(work):
            tile_coord = scheduler.coord(work)
            partitions = [
                self._subtile_partition(atom, sC_i, self._output_tiles(mC), tile_coord, store=False)
                for (atom, mC), sC_i in zip(epi_loads, sC)
            ]
            for epi_idx in cutlass.range_constexpr(self.num_epi_subtiles):
                c_pipeline.producer_acquire(fill_state)
                barrier = c_pipeline.producer_get_barrier(fill_state)
                for (atom, _), (tCsC, tCgC) in zip(epi_loads, partitions):
                    cute.copy(atom, tCgC[(None, epi_tile_layout.get_hier_coord(epi_idx))],
                              tCsC[(None, fill_state.index)], tma_bar_ptr=barrier)  # fmt: skip
                c_pipeline.producer_commit(fill_state)
                fill_state.advance()
            work = scheduler.next(work)
        c_pipeline.producer_tail(fill_state)

    @cute.jit
    def _consume(
        self, cta, tiled_mma, tma_d, mD, tidx, sched_args, epi_vectors, epi_stores, epi_workspaces, epi_scalars,
        block_scales,
    ):  # fmt: skip
        """A consumer warpgroup: per tile of its team, the MMA mainloop, then :meth:`_epilogue`.

        Mainloop: waits on the A/B ring's full barriers, issues WGMMA into fp32 accumulators
        keeping one batch in flight, and releases a stage (its empty barrier, in every CTA
        that multicast into it) only once the WGMMA that read it retired. Ping-pong: the
        ``MMA_TURN`` named barriers order the teams' mainloops, the ``EPILOGUE_TURN`` ones
        their epilogues, and a team steps its ring positions over the other's tiles.

        The mainloop stays inline: the tile loop must advance ``read_state`` and
        ``release_state`` itself for the DSL to carry them (see :meth:`kernel`).
        """
        cfg = self.cfg
        ab_pipeline, sA, sB = cta.ab_pipeline, cta.sA, cta.sB
        # A team: the consumer warpgroups on one tile (both cooperative, one ping-pong).
        team = cute.arch.make_warp_uniform((tidx - THREADS_PER_WARPGROUP) // cfg.tile_threads)
        mma_tidx = (tidx - THREADS_PER_WARPGROUP) % cfg.tile_threads
        thr_mma = tiled_mma.get_slice(mma_tidx)
        # Shared-memory operands: see warpgroup_slice.
        wg_mma = warpgroup_slice(tiled_mma, cute.arch.make_warp_uniform(mma_tidx // THREADS_PER_WARPGROUP))
        tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
        acc_shape = thr_mma.partition_shape_C(cute.slice_(self.tile_shape_mnk, (None, None, 0)))
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])
        partial0 = partial1 = scale_regs = scale_rows = scale_slot = None
        partials = promote_partials(cfg) if self.block_scaled else 0
        chunks = promote_chunks(cfg) if self.block_scaled else 1
        chunk_mma = tCrA_chunk = tCrB_chunks = positions = None
        if cutlass.const_expr(self.block_scaled):
            # One or two k-tiles' WGMMA accumulators (with two, one in flight while the other is promoted
            # into acc), and their scales: per slot, A's of the thread's rows, then B's of its column chunks.
            partial_shape = acc_shape
            if cutlass.const_expr(chunks > 1):
                # A 256-wide tile whose whole partial would not fit beside acc: each k-tile's WGMMAs run in
                # column chunks of one block of N (promote_chunks), the same WGMMAs N / chunks wide over that
                # chunk's rows of B's stage, into one chunk-wide partial.
                width = cfg.tile_n // chunks
                chunk_mma = self._make_tiled_mma(width)
                chunk_wg = warpgroup_slice(chunk_mma, cute.arch.make_warp_uniform(mma_tidx // THREADS_PER_WARPGROUP))
                tCrA_chunk = chunk_mma.make_fragment_A(chunk_wg.partition_A(sA))
                sB_chunks = cute.flat_divide(sB, (width,))  # (width, chunks, tile_k, stages)
                tCrB_chunks = [
                    chunk_mma.make_fragment_B(chunk_wg.partition_B(sB_chunks[(None, c, None, None)]))
                    for c in range(chunks)
                ]
                partial_shape = chunk_mma.get_slice(mma_tidx).partition_shape_C((cfg.tile_m, width))
                positions = chunk_positions(tiled_mma, chunk_mma, (cfg.tile_m, cfg.tile_n), chunks)
            partial0 = cute.make_rmem_tensor(partial_shape, self.acc_dtype)
            if cutlass.const_expr(partials == 2):
                partial1 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            acc_coords = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            scale_slot, row_values = accumulator_scales(tiled_mma, (cfg.tile_m, cfg.tile_n), self.b_scale_chunks)
            scale_rows = [acc_coords[v][0] for v in row_values]  # tile rows
            scale_regs = cute.make_rmem_tensor((partials, len(row_values) + self.b_scale_chunks), Float32)
        copies = self._epilogue_copies(cta, tiled_mma, thr_mma, acc, mma_tidx, mD, tma_d, epi_stores)
        store, is_store_warp = copies.store, copies.is_store_warp
        c_state = c_release = None
        if cutlass.const_expr(self.epi_buffers.loads_tiles):
            c_state = RingState.consumer(cfg.num_c_stages, tracked=True)
        if cutlass.const_expr(cfg.reuse_smem_c):
            # The operand ring's slots go back to its loads only once D's store from them has been read.
            c_release = RingState.consumer(cfg.num_c_stages)

        scheduler = self._scheduler(sched_args)
        read_state = RingState.consumer(cfg.ab_stages, tracked=True)
        release_state = RingState.consumer(cfg.ab_stages, tracked=True)
        ping_pong = cfg.num_teams > 1
        mma_turns = WarpgroupTurns(NamedBarriers.MMA_TURN_WG1, cfg.num_teams, enabled=ping_pong)
        epilogue_turns = WarpgroupTurns(NamedBarriers.EPILOGUE_TURN_WG1, cfg.num_teams, enabled=ping_pong)
        mma_turns.grant_first(team)
        epilogue_turns.grant_first(team)
        # Team t takes the CTA's tiles t, t + num_teams, ...; the rings carry every
        # tile in schedule order, so a team steps its positions over the others' tiles.
        if cutlass.const_expr(ping_pong):
            self._skip_tiles(cta, scheduler, scheduler.first(), team, read_state, release_state, c_state)
        tiles_done = Int32(0)
        work = scheduler.next(scheduler.first(), team)
        while scheduler.is_valid(work):
            tile_coord = scheduler.coord(work)
            tile_k_tiles = self._k_tiles(cta, tile_coord)
            k_first = self._k_first(cta, tile_coord)  # where the tile's k-tiles start (a split's share)
            run = GemmEpilogueRun(
                self, cta, copies, tile_coord, tiles_done, mma_tidx, c_state, epi_vectors, epi_workspaces,
                epi_scalars, c_release,
            )  # fmt: skip
            run_chain("prologue", run)

            acc.fill(0.0)
            mma_turns.wait(team)
            if cutlass.const_expr(partials == 1 and chunks == 1):
                # ---- promoting mainloop, one partial (tiles too wide for two): each k-tile accumulates from
                # zero into the partial; the warpgroup waits for it, releases the stage and promotes it while
                # the other warpgroup's WGMMAs keep the tensor cores busy.
                for k_tile in range(tile_k_tiles):
                    ab_pipeline.consumer_wait(read_state)
                    read_block_scales(scale_regs, 0, cta, scale_rows, read_state.index, self.b_scale_chunks,
                                      self._b_scale_offset(k_first + k_tile))  # fmt: skip
                    self._fix_stage(cta, tile_coord, k_tile, read_state.index, mma_tidx)
                    issue_k_tile(tiled_mma, tCrA, tCrB, read_state.index, partial0, k_blocks)
                    read_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
                    promote(acc, partial0, scale_regs, 0, scale_slot, self.b_scale_chunks)
                mma_turns.pass_on(team)
            elif cutlass.const_expr(partials == 2):
                # ---- promoting mainloop: each k-tile (one 128-wide scale block of K) accumulates
                # from zero into one of two partials; while k-tile j's WGMMAs run, j-1's partial is
                # scaled by its A-row and B-block scales and added into acc in fp32. Unrolled by two
                # so that each partial is a fixed set of registers: k-tile j's partial and scales are
                # slot j % 2. Its scales arrived in its stage (:meth:`_copy_block_scales`) and are read
                # as soon as the stage is full, an iteration before their use.
                has_k_tiles = True  # a split of K (or an empty group's) may have none: its partial sum stays zero
                if cutlass.const_expr(cfg.split_k > 1 or self.k_tiles_may_be_zero):
                    has_k_tiles = tile_k_tiles > 0
                if has_k_tiles:
                    last = tile_k_tiles - 1
                    ab_pipeline.consumer_wait(read_state)
                    read_block_scales(scale_regs, 0, cta, scale_rows, read_state.index, self.b_scale_chunks,
                                      self._b_scale_offset(k_first))  # fmt: skip
                    self._fix_stage(cta, tile_coord, 0, read_state.index, mma_tidx)
                    issue_k_tile(tiled_mma, tCrA, tCrB, read_state.index, partial0, k_blocks)
                    read_state.advance()
                    for pair in range(last // 2):
                        for slot in cutlass.range_constexpr(2):  # k-tile j = 2 pair + 1 + slot: slot 1 - slot
                            ab_pipeline.consumer_wait(read_state)
                            read_block_scales(scale_regs, 1 - slot, cta, scale_rows, read_state.index,
                                              self.b_scale_chunks,
                                              self._b_scale_offset(k_first + 2 * pair + 1 + slot))  # fmt: skip
                            self._fix_stage(cta, tile_coord, 2 * pair + 1 + slot, read_state.index, mma_tidx)
                            issue_k_tile(
                                tiled_mma, tCrA, tCrB, read_state.index, partial0 if slot else partial1, k_blocks
                            )
                            read_state.advance()
                            cute.nvgpu.warpgroup.wait_group(1)  # k-tile j - 1 retired
                            ab_pipeline.consumer_release(release_state)
                            release_state.advance()
                            promote(acc, partial1 if slot else partial0, scale_regs, slot, scale_slot,
                                    self.b_scale_chunks)  # fmt: skip
                    if last % 2 == 1:  # the last k-tile is odd: partial 1, scales slot 1
                        ab_pipeline.consumer_wait(read_state)
                        read_block_scales(scale_regs, 1, cta, scale_rows, read_state.index, self.b_scale_chunks,
                                          self._b_scale_offset(k_first + last))  # fmt: skip
                        self._fix_stage(cta, tile_coord, last, read_state.index, mma_tidx)
                        issue_k_tile(tiled_mma, tCrA, tCrB, read_state.index, partial1, k_blocks)
                        read_state.advance()
                        cute.nvgpu.warpgroup.wait_group(1)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        promote(acc, partial0, scale_regs, 0, scale_slot, self.b_scale_chunks)
                        cute.nvgpu.warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        promote(acc, partial1, scale_regs, 1, scale_slot, self.b_scale_chunks)
                    else:
                        cute.nvgpu.warpgroup.wait_group(0)
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                        promote(acc, partial0, scale_regs, 0, scale_slot, self.b_scale_chunks)
                mma_turns.pass_on(team)
            elif cutlass.const_expr(partials == 1):  # chunks > 1
                # ---- promoting mainloop, one chunk-wide partial (256-wide tiles): each k-tile's WGMMAs run
                # chunk by chunk into the partial, from zero; the warpgroup waits for a chunk and promotes it
                # (with its block of N's B scale) before issuing the next, while the other warpgroup's WGMMAs
                # keep the tensor cores busy, and releases the stage once the last chunk's WGMMAs retired.
                for k_tile in range(tile_k_tiles):
                    ab_pipeline.consumer_wait(read_state)
                    read_block_scales(scale_regs, 0, cta, scale_rows, read_state.index, self.b_scale_chunks,
                                      self._b_scale_offset(k_first + k_tile))  # fmt: skip
                    self._fix_stage(cta, tile_coord, k_tile, read_state.index, mma_tidx)
                    for c in cutlass.range_constexpr(chunks):
                        issue_k_tile(chunk_mma, tCrA_chunk, tCrB_chunks[c], read_state.index, partial0, k_blocks)
                        cute.nvgpu.warpgroup.wait_group(0)
                        if cutlass.const_expr(c == chunks - 1):
                            ab_pipeline.consumer_release(release_state)
                            release_state.advance()
                        promote_chunk(acc, partial0, scale_regs, 0, scale_slot, self.b_scale_chunks, positions[c])
                    read_state.advance()
                mma_turns.pass_on(team)
            else:
                # ---- mainloop: keep one WGMMA batch in flight, release a stage
                # only after the WGMMA that read it has retired.
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.nvgpu.warpgroup.fence()
                for k_tile in range(tile_k_tiles):
                    ab_pipeline.consumer_wait(read_state)
                    self._fix_stage(cta, tile_coord, k_tile, read_state.index, mma_tidx)
                    for kb in cutlass.range_constexpr(k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k_tile > 0:
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
                    read_state.advance()
                # Every WGMMA of this tile is issued: the other team may issue its own.
                mma_turns.pass_on(team)
                cute.nvgpu.warpgroup.wait_group(0)
                if tile_k_tiles > 0:  # K == 0: nothing was read, acc stays zero for the epilogue
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()

            self._check_accumulator(acc, tile_coord)
            if cutlass.const_expr(cfg.split_k > 1):
                # Only the split that finishes last holds the tile's sum: it alone runs the epilogue.
                if self._reduce_splits(cta, acc, tile_coord, scheduler.tile_slot(work), tiled_mma, thr_mma, mma_tidx,
                                       copies, sched_args, cute.size(mD, mode=[0])):  # fmt: skip
                    self._epilogue(run)
            else:
                epilogue_turns.wait(team)
                self._epilogue(run)
                c_state = run.c_state  # reassigned here, so the tile loop carries it
                if cutlass.const_expr(cfg.reuse_smem_c):
                    c_release = run.c_release
            if cutlass.const_expr(ping_pong):
                # The other team overwrites the staging buffers next: our last
                # stores must have read them before we pass the turn.
                store.drain(is_store_warp)
                self._skip_tiles(cta, scheduler, scheduler.next(work), cfg.num_teams - 1, read_state, release_state,
                                 c_state)  # fmt: skip
            epilogue_turns.pass_on(team)
            tiles_done += 1
            work = scheduler.next(work, cfg.num_teams)
        store.drain(is_store_warp)
        if cutlass.const_expr(cfg.reuse_smem_c):
            # Every store has been read: the slots still held go back, so the load warp's tail returns.
            store.sync()
            for i in cutlass.range(tiles_done * self.num_epi_subtiles - c_release.count, unroll=1):
                cta.c_pipeline.consumer_release(RingState(cfg.num_c_stages, c_release.count + i))

    @cute.jit
    def _reduce_splits(self, cta, acc, coord, slot, tiled_mma, thr_mma, mma_tidx, copies, sched_args, m_extent):
        """Split-K's serial reduction, after a split's mainloop: True for the team that now holds the tile's
        sum in ``acc`` and runs its epilogue.

        Every split stores its fp32 partial (each thread its accumulators, value-major, rows past M
        skipped) into the tile's slot of the workspace, fences, and counts itself on the tile's counter. The
        split that arrives last reads all of them back and adds them in split order, so the sum does not
        depend on which split finished last (deterministic), and resets the counter for the next launch. No
        split waits for another: a persistent grid whose CTAs are not all resident cannot deadlock."""
        cfg = self.cfg
        partials, counters = sched_args[0], sched_args[1]
        splits, size = cfg.split_k, cute.size(acc)
        coords = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        rows_left = m_extent - coord[0] * cfg.tile_m
        # A thread's values lie in a few rows (two per 64-row band): the rows past M hold zeros (TMA zero-fills
        # A there) and are neither stored nor read. Each row's values move as one branch-free block, so a
        # split's loads are all in flight at once rather than one L2 round trip per value.
        row_slot, row_values = accumulator_scales(tiled_mma, (cfg.tile_m, cfg.tile_n), 1)  # one chunk: the row
        values_of_row = [[v for v in range(size) if row_slot[v] == r] for r in range(len(row_values))]
        row_in_range = [coords[v][0] < rows_left for v in row_values]

        # Value v of split s is at first + s * split_stride + v * tile_threads: value-major, so that a warp's
        # store (and the last split's load) of one value is one 128-byte line; thread-major, it touched 32 lines
        # (bench/NOTES.md, "Split-K's reduction at full rows").
        split_stride = cfg.tile_threads * size
        first = slot * splits * split_stride + mma_tidx
        mine = first + coord[3] * split_stride
        for r in cutlass.range_constexpr(len(values_of_row)):
            if row_in_range[r]:
                for v in values_of_row[r]:
                    partials[mine + v * cfg.tile_threads] = acc[v]
        cute.arch.fence_acq_rel_gpu()  # our partial is visible GPU-wide before the counter counts us
        copies.store.sync()
        if mma_tidx == 0:
            cta.sSplitArrival[0] = cute.arch.atomic_add(counters.iterator + slot, Int32(1), sem="relaxed", scope="gpu")
        copies.store.sync()
        last = cta.sSplitArrival[0] == splits - 1
        if last:
            cute.arch.fence_acq_rel_gpu()  # the other splits' partials, published before they were counted
            for r in cutlass.range_constexpr(len(values_of_row)):
                if row_in_range[r]:
                    for v in values_of_row[r]:
                        total = partials[first + v * cfg.tile_threads]
                        for split in cutlass.range_constexpr(1, splits):  # in split order: deterministic
                            total = total + partials[first + split * split_stride + v * cfg.tile_threads]
                        acc[v] = total
            if mma_tidx == 0:
                counters[slot] = Int32(0)
        return last

    @cute.jit
    def _epilogue_copies(self, cta, tiled_mma, thr_mma, acc, mma_tidx, mD, tma_d, epi_stores):
        """What a consumer's epilogue needs on every tile (:class:`EpilogueCopies`): register -> smem
        copies and staging views of each stored output, the operand tiles' smem -> register copies
        and the coordinates of this thread's values, built once before its tile loop."""
        cfg = self.cfg
        fusion = self.fusion
        sD, sC, sAux = cta.sD, cta.sC, cta.sAux
        # Register -> smem copies. Which accumulator values a thread holds comes
        # from a 16-bit stmatrix atom whatever the output dtype; the store
        # itself is stmatrix for 16-bit outputs and plain stores otherwise.
        stmatrix_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), cutlass.Float16
        )
        # The output tile's values as a thread holds them: the accumulators' layout, at half the width when
        # gated (the layout of a WGMMA of N = out_tile_n; see epicute.epilogue.gated).
        out_mma, out_thr_mma = tiled_mma, thr_mma
        if cutlass.const_expr(self.gated):
            out_mma = self._make_tiled_mma(self.out_tile_n)
            out_thr_mma = out_mma.get_slice(mma_tidx)
        tiled_copy_C_atom = cute.make_tiled_copy_C_atom(stmatrix_atom, out_mma)
        copy_atom_r2s = sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, self.acc_dtype)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_C_atom)
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, stage)
        tRS_rAcc, gate_up = acc, None
        if cutlass.const_expr(not self.gated):
            tRS_rAcc = tiled_copy_r2s.retile(acc)
        subtile_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
        tRS_rD = cute.make_rmem_tensor(subtile_shape, self.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(subtile_shape, self.d_dtype)
        outputs = {"D": GemmOutput(
            "D", self.d_dtype_name, tRS_rD, tRS_rD_out, tiled_copy_r2s, tRS_rD_out, tRS_sD, sD, tma_d, cta.gD,
            aliases_ab=cfg.epi_reuses_ab_smem,
        )}  # fmt: skip

        store = TmaStoreEpilogue(cfg.num_epi_stages, cfg.tile_threads)
        # The team's first warp issues its TMA stores.
        is_store_warp = mma_tidx // 32 == 0
        epi_tile_layout = self._subtile_order()
        extent_mn = lane = tRS_cT = tRS_cT0 = None
        c_s2r = {}
        if cutlass.const_expr(fusion is not None):
            extent_mn = (cute.size(mD, mode=[0]), cute.size(mD, mode=[1]))
            lane = mma_tidx % 32
            ident = cute.make_identity_tensor((cfg.tile_m, self.out_tile_n))
            tRS_cT = tiled_copy_r2s.retile(out_thr_mma.partition_C(ident))
            tRS_cT0 = tiled_copy_r2s.retile(out_mma.get_slice(0).partition_C(ident))
            if cutlass.const_expr(self.gated):
                gate_up = gate_up_positions(tiled_mma, tRS_cT0, (cfg.tile_m, cfg.tile_n))
            # smem -> registers for operand tiles (ldmatrix when 16-bit), in
            # the same value order as the accumulators.
            for name, dtype, sC_i in zip(fusion.tile_inputs, self.epi_buffers.tile_inputs, sC):
                op = (
                    cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4)
                    if DSL_DTYPES[dtype].width == 16
                    else cute.nvgpu.CopyUniversalOp()
                )
                tiled_s2r = cute.make_tiled_copy_S(cute.make_copy_atom(op, DSL_DTYPES[dtype]), tiled_copy_C_atom)
                thr_s2r = tiled_s2r.get_slice(mma_tidx)
                rC = cute.make_rmem_tensor(tRS_rD.layout, DSL_DTYPES[dtype])
                c_s2r[name] = (tiled_s2r, thr_s2r.partition_S(sC_i), rC, thr_s2r.retile(rC))
            # registers -> smem for aux outputs: fp32 values, rounded copy, staged view.
            for name, dtype, sAux_i, (aux_tma, mAux) in zip(
                fusion.aux_outputs, self.epi_buffers.aux_outputs, sAux, epi_stores
            ):
                aux_store_op = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, DSL_DTYPES[dtype], self.acc_dtype)
                tiled_aux = cute.make_tiled_copy_S(aux_store_op, tiled_copy_C_atom)
                rAux_out = cute.make_rmem_tensor(subtile_shape, DSL_DTYPES[dtype])
                outputs[name] = GemmOutput(
                    name, dtype, cute.make_rmem_tensor(subtile_shape, self.acc_dtype), rAux_out, tiled_aux,
                    tiled_aux.retile(rAux_out), tiled_aux.get_slice(mma_tidx).partition_D(sAux_i), sAux_i, aux_tma,
                    self._output_tiles(mAux),
                )  # fmt: skip
        return EpilogueCopies(
            outputs, tRS_rAcc, cute.size(tRS_rD), store, is_store_warp, epi_tile_layout, extent_mn, lane, tRS_cT,
            tRS_cT0, c_s2r, gate_up,
        )  # fmt: skip

    @cute.jit
    def _epilogue(self, run):
        """The team's epilogue for one output tile, run in its ``EPILOGUE_TURN``: the chain's stages
        (:mod:`epicute.sm90.epilogue_chain`), once at the tile's start, per ``epi_tile`` subtile in
        row-major order, and at its end. The stores go through ``num_epi_stages`` staging buffers
        (:class:`TmaStoreEpilogue`: the ``EPILOGUE`` named barrier and the store warp's bulk groups
        guard them)."""
        run_chain("begin", run)
        first, second = chain_passes(self.chain)
        for epi_idx in cutlass.range_constexpr(self.num_epi_subtiles):
            run.subtile = epi_idx
            run_chain("subtile", run, first)
        if cutlass.const_expr(second):  # D quantized per group of columns: its scales, then a second pass
            run_chain("pass_end", run, first)
            for epi_idx in cutlass.range_constexpr(self.num_epi_subtiles):
                run.subtile = epi_idx
                run_chain("subtile", run, second)
        run_chain("end", run)


# ---- blockwise fp8 scales in the mainloop (:meth:`GemmSm90._consume`)
#
# fp8 WGMMA keeps its running sum with fewer mantissa bits than fp32, and blockwise scales vary along
# K, so the mainloop *promotes*: each k-tile (one 128-wide scale block) accumulates into ``partial``
# from zero, and ``acc += partial * a_scale[row] * b_scale[chunk]`` once it retired. The load warp
# copies each k-tile's scales (the tile's rows' A scales, B's block for each chunk of columns that lies
# in one block of N: one chunk for 64- and 128-wide tiles, three 64-column chunks for 192-wide ones, two
# 128-column ones for 256-wide ones, whose k-tiles are also computed and promoted a chunk at a time) into
# the stage with the operands (:meth:`GemmSm90._copy_block_scales`); a thread holds a few distinct rows
# (thread 0's coordinates are static: equal ones mean the same row offset) and reads one A scale per row
# and the chunks' B scales from shared memory. Functions, not an object: a runtime loop carries every
# object its body calls a method on.


def accumulator_scales(tiled_mma, tile_mn: tuple[int, int], chunks: int) -> tuple[list[int], list[int]]:
    """Static: for each accumulator value, the index of its scale among the thread's (row, column chunk)
    products, row-major; and for each of the thread's rows, one value in it. A thread's columns lie in the
    same ``tile_n / chunks``-wide chunks as thread 0's (WGMMA's thread offsets stay within 8 columns), so
    thread 0's coordinates serve every thread."""
    coords0 = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))
    chunk = tile_mn[1] // chunks
    first_value_of_row: dict = {}
    scale_slot = []
    for v in range(cute.size(coords0)):
        m0, n0 = coords0[v]
        first_value_of_row.setdefault(m0, v)
        scale_slot.append(list(first_value_of_row).index(m0) * chunks + n0 // chunk)
    return scale_slot, list(first_value_of_row.values())


def read_block_scales(regs: cute.Tensor, slot: int, cta, rows: list, stage, chunks: int, b_offset) -> None:
    """A full stage's scales into ``regs[slot, :]``: A's of each of the thread's tile ``rows``, then B's of
    each of the ``chunks`` column chunks, from ``b_offset`` on in the stage's slot."""
    for i, r in enumerate(rows):
        regs[slot, i] = cta.sScaleA[(r, stage)]
    for c in range(chunks):
        regs[slot, len(rows) + c] = cta.sScaleB[(b_offset + c, stage)]


def issue_k_tile(tiled_mma, tCrA: cute.Tensor, tCrB: cute.Tensor, stage, partial: cute.Tensor, k_blocks: int) -> None:
    """One k-tile's WGMMAs from ring stage ``stage`` into ``partial``, from zero, as one commit group."""
    cute.nvgpu.warpgroup.fence()
    mma_atom = cute.make_mma_atom(tiled_mma.op)  # its own ACCUMULATE field, restarted per k-tile
    mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    for kb in range(k_blocks):  # trace-time Python: unrolled
        coord = (None, None, kb, stage)
        cute.gemm(mma_atom, partial, tCrA[coord], tCrB[coord], partial)
        mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.commit_group()


def gate_up_positions(tiled_mma, out_coords0: cute.Tensor, tile_mn: tuple[int, int]) -> tuple:
    """Static: for each output value of thread 0 (tile-local coordinates ``out_coords0``), the flat positions
    in the accumulator fragment of its gate and up values. B interleaves gate and up in blocks of
    ``GATE_BLOCK`` columns, so output column n's gate is accumulator column ``2 * GATE_BLOCK * (n // GATE_BLOCK)
    + n % GATE_BLOCK`` and its up ``GATE_BLOCK`` further. Every thread holds the same columns of each block
    (WGMMA's thread offsets are the same for any N, and under ``GATE_BLOCK``), so thread 0's positions are
    every thread's."""
    acc0 = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))
    position = {tuple(acc0[i]): i for i in range(cute.size(acc0))}
    gate, up = [], []
    for u in range(cute.size(out_coords0)):
        m, n = out_coords0[u]
        col = 2 * GATE_BLOCK * (n // GATE_BLOCK) + n % GATE_BLOCK
        gate.append(position[(m, col)])
        up.append(position[(m, col + GATE_BLOCK)])
    return tuple(gate), tuple(up)


def promote(acc: cute.Tensor, partial: cute.Tensor, regs: cute.Tensor, slot: int, scale_slot: list[int],
            chunks: int) -> None:  # fmt: skip
    """``acc += partial * a_scale[row] * b_scale[chunk]`` for a retired k-tile whose scales are in ``regs[slot, :]``
    (:func:`read_block_scales`), each value's product at ``scale_slot`` (:func:`accumulator_scales`)."""
    rows = cute.size(regs, mode=[1]) - chunks
    products = [regs[slot, r] * regs[slot, rows + c] for r in range(rows) for c in range(chunks)]
    for v in range(cute.size(acc)):
        acc[v] = acc[v] + partial[v] * products[scale_slot[v]]


def chunk_positions(tiled_mma, chunk_mma, tile_mn: tuple[int, int], chunks: int) -> list[list[int]]:
    """Static: for each of the tile's ``chunks`` column chunks, where each value of ``chunk_mma``'s accumulator (a
    ``tile_m x tile_n / chunks`` tile) sits in ``tiled_mma``'s (the whole tile's): the same row, its column plus the
    chunk's first. Thread 0's coordinates serve every thread (WGMMA's thread offsets are the same for any N)."""
    width = tile_mn[1] // chunks
    acc0 = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))
    position = {tuple(acc0[i]): i for i in range(cute.size(acc0))}
    part0 = chunk_mma.get_slice(0).partition_C(cute.make_identity_tensor((tile_mn[0], width)))
    coords = [tuple(part0[v]) for v in range(cute.size(part0))]
    return [[position[(m, n + c * width)] for m, n in coords] for c in range(chunks)]


def promote_chunk(acc: cute.Tensor, partial: cute.Tensor, regs: cute.Tensor, slot: int, scale_slot: list[int],
                  chunks: int, positions: list[int]) -> None:  # fmt: skip
    """:func:`promote` for a retired column chunk of a k-tile: ``acc[positions[v]] += partial[v] * a_scale[row] *
    b_scale[chunk]`` (``positions``: :func:`chunk_positions`; ``chunks``: the tile's B scales per k-tile)."""
    rows = cute.size(regs, mode=[1]) - chunks
    products: dict[int, object] = {}
    for v, position in enumerate(positions):
        s = scale_slot[position]
        if s not in products:
            products[s] = regs[slot, s // chunks] * regs[slot, rows + s % chunks]
        acc[position] = acc[position] + partial[v] * products[s]


class GemmOutput(StagedOutput):
    """D or an aux tile of the GEMM: its subtile's fp32 registers, a rounded copy, a staging ring
    (``num_epi_stages`` buffers) and a TMA store per subtile into the output's tile."""

    def __init__(self, name, dtype, values, converted, r2s, src, smem, staged, atom, gmem_tiles, aliases_ab=False):
        super().__init__(name, dtype, values)
        self.converted = converted  # the stored dtype's registers
        self.r2s, self.src, self.smem = r2s, src, smem  # registers -> staging: copy, its source, (.., stage) view
        self.staged, self.atom, self.gmem_tiles = staged, atom, gmem_tiles  # the TMA store's smem, atom, tiles
        self.aliases_ab = aliases_ab

    def begin(self, run) -> None:
        if cutlass.const_expr(self.aliases_ab):
            # Staged in the A ring: the other warpgroup may still be reading it.
            run.store.sync()
        self.tma_smem, self.tma_gmem = run.kernel._subtile_partition(self.atom, self.staged, self.gmem_tiles,
                                                                     run.tile_coord, store=True)  # fmt: skip

    def cast(self, run) -> None:
        emit.round_for_store(self.values, self.dtype)
        self.converted.store(self.values.load().to(DSL_DTYPES[self.dtype]))

    def store_smem(self, run) -> None:
        cute.copy(self.r2s, self.src, self.smem[(None, None, None, run.staging.index)])

    def tma_copy(self, run) -> tuple:
        subtile = run.copies.epi_tile_layout.get_hier_coord(run.subtile)
        return self.atom, self.tma_smem[(None, run.staging.index)], self.tma_gmem[(None, subtile)]


class GemmEpilogueRun(EpilogueRun):
    """The GEMM's :class:`~epicute.sm90.epilogue_chain.EpilogueRun` over output tile ``tile_coord``:
    subtiles are slices of the accumulators in the r2s copy's value order, operand tiles arrive
    through the epilogue-operand ring (``c_state``: the caller reads it back after the tile), and
    the staging ring advances once per subtile across the team's tiles (``tiles_done``)."""

    def __init__(self, kernel, cta, copies, tile_coord, tiles_done, mma_tidx, c_state, epi_vectors, epi_workspaces,
                 epi_scalars, c_release=None):  # fmt: skip
        super().__init__()
        cfg, fusion = kernel.cfg, kernel.fusion
        self.kernel, self.cta, self.copies, self.fusion, self.stages = kernel, cta, copies, fusion, kernel.chain
        self.tile_coord, self.tiles_done, self.c_state = tile_coord, tiles_done, c_state
        self.c_release = c_release  # ReuseSmemC: the operand ring's next slot to give back
        self.outputs, self.store, self.is_store_warp = copies.outputs, copies.store, copies.is_store_warp
        self.subtile_size = copies.subtile_size
        self.staging = None
        if cutlass.const_expr(fusion is not None):
            self.origin, self.extent, batch = kernel._epilogue_frame(tile_coord, copies.extent_mn)
            self.band_origin = kernel._partials_origin(tile_coord)
            self.lane = copies.lane
            self.coords, self.coords0 = copies.tRS_cT, copies.tRS_cT0
            self.scalars, self.workspaces, self.tile_index = epi_scalars, epi_workspaces, (tile_coord[1], batch)
            vector_names = fusion.row_inputs + fusion.col_inputs
            self.vectors = dict(zip(vector_names, cta.sVec))
            self.vector_sources = dict(zip(vector_names, epi_vectors))
            self.vector_lengths = {name: kernel.out_tile_n if name in fusion.row_inputs else cfg.tile_m
                                   for name in vector_names}  # fmt: skip
            self.batch, self.thread, self.threads = batch, mma_tidx, cfg.tile_threads

    def slice_acc(self) -> None:
        if cutlass.const_expr(self.subtile == 0):
            self.staging = RingState(self.kernel.d_stages, self.tiles_done * self.kernel.num_epi_subtiles)
        values = self.outputs["D"].values
        for v in range(self.subtile_size):
            values[v] = self.copies.tRS_rAcc[self.copies.acc_position(self.base + v)]

    def load_tiles(self) -> None:
        ring = self.cta.c_pipeline
        ring.consumer_wait(self.c_state)
        for tiled_s2r, tSR_sC, _, tSR_rC in self.copies.c_s2r.values():
            cute.copy(tiled_s2r, tSR_sC[(None, None, None, self.c_state.index)], tSR_rC)
        if cutlass.const_expr(not self.kernel.cfg.reuse_smem_c):  # else D leaves from this slot: see advance
            ring.consumer_release(self.c_state)
        self.c_state.advance()

    def tile_value(self, name, v, m, n):
        if cutlass.const_expr(name == emit.UP):
            return self.copies.tRS_rAcc[self.copies.gate_up[1][self.base + v]]
        return self.copies.c_s2r[name][2][v].to(Float32)

    def advance(self) -> None:
        self.staging.advance()
        cfg = self.kernel.cfg
        if cutlass.const_expr(cfg.reuse_smem_c):
            # After this subtile's store and the barrier behind its wait: at most num_epi_stages - 1 stores are
            # unread, so every slot older than those is free for the operand loads again.
            stored = self.tiles_done * self.kernel.num_epi_subtiles + self.subtile + 1
            due = self.c_release.count < stored - (cfg.num_epi_stages - 1)
            release_if(self.cta.c_pipeline, self.c_release, due)
            self.c_release.advance(Int32(cutlass.select_(due, Int32(1), Int32(0))))

    def park(self) -> None:
        # This subtile's accumulators are spent: their registers keep the values.
        values = self.outputs["D"].values
        for v in range(self.subtile_size):
            self.copies.tRS_rAcc[self.copies.acc_position(self.base + v)] = values[v]

    def unpark(self) -> None:
        values = self.outputs["D"].values
        for v in range(self.subtile_size):
            values[v] = self.copies.tRS_rAcc[self.copies.acc_position(self.base + v)]
