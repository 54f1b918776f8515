"""FlashAttention-3 style attention forward for SM90, built from the GEMM's parts.

``O = softmax(Q K^T * scale) V`` per (batch, head); a work tile is ``tile_m``
query rows of one (batch, head). Tiles are numbered m-block fastest, or, for
causal launches, longest query blocks first, a band of heads at a time sized so
their K and V share L2 (:meth:`_work_coord`). A CTA runs one tile, or
(``persistent``) one CTA per SM walks tiles, so that the next tile's K loads and
its Q load run under the current tile's epilogue instead of behind a CTA
launch: tiles ``blockIdx.x + i * gridDim.x``, or (``dynamic_tiles``, planned for
every persistent launch) whichever tile a global counter hands out next, which
keeps causal tiles of unequal length balanced and the tiles in flight a
contiguous window of the order (:class:`TileQueue`: the producer claims, and
announces each tile to the consumers with its Q load).
Warp roles (as in the GEMM: producer warpgroup 0, consumers after it):

- producer (warp 0): per tile, TMA loads of the first K block, then Q (through a
  one-stage ring: the previous tile's O is staged in Q's buffer, so the load
  waits for the store warp to release it; with ``o_buffer`` O has a buffer of
  its own and the consumers release Q once their last QK^T has retired, so the
  load runs under the last PV and the epilogue), then K and V through their own
  ``stages``-deep rings (:func:`make_tma_load_pipeline`), whose positions carry
  over from tile to tile. K runs one block ahead of V, so the consumers can
  issue QK^T of block j+1 before PV of block j.
- consumers (``num_mma_warpgroups`` x 64 query rows): per key block, S = Q K^T
  (WGMMA from smem), score_mod, masks, online softmax in registers (row max and
  sum; each warp holds whole rows, checked by the planner), P cast to 16 bits in
  registers and O += P V (WGMMA with A from registers).
  **Intra-warpgroup overlap**: the QK^T WGMMA of block j+1 and the PV WGMMA of
  block j are in flight while the softmax of block j+1 runs.
  With ``rescale_o_early`` (large head_dim) O is rescaled under the QK^T WGMMA
  instead of after PV retires. **Ping-pong**: before issuing its two GEMMs a warpgroup syncs on its own named
  barrier, after issuing them it arrives at the next warpgroup's; the first one
  is pre-armed, so the warpgroups take turns at the tensor cores while the
  others run softmax.
- The first key block (the right-most: it holds the ragged seqlen_k edge and the
  causal diagonal) is peeled: its softmax is compile-time ``is_first`` and the
  first PV runs with the accumulate flag off. Causal masking runs only on blocks
  that cross the diagonal; blocks fully above it are never loaded. The causal
  diagonal is aligned bottom-right (query i sees keys <= i + seqlen_k - seqlen_q; :mod:`.mask`).
- Epilogue: O normalized by the row sums, the user's epilogue per element, cast,
  ``stmatrix`` into Q's shared memory (the rows each warpgroup stages are the
  rows only it read) or O's own (``o_buffer``), TMA store (:class:`TmaStoreEpilogue`,
  which clips the ragged seqlen_q edge); once the store has read Q's buffer, the
  store warp hands it back to the producer for the next tile's Q. LSE (natural
  log, fp32) written by one lane per row.

Decode (``plan.decode_choices``): with ``pack_gqa`` a tile's rows are the query
heads of one K/V head times its queries (Q, O and LSE viewed as ``((group,
seqlen_q), ...)``, one TMA box per tile), so each K/V block is read once for the
group; with ``split_kv`` each tile's key blocks are cut into ``num_splits`` ranges
run by different CTAs, which store fp32 partial O and LSE for
:mod:`epicute.attention.combine_sm90`; a paged cache is read block by block through
the page table, and ``seqused_k`` bounds each sequence (:class:`KeyRange`).

fp8 (e4m3) Q, K, V (:mod:`epicute.attention.fp8`): both GEMMs are fp8 WGMMAs, which read their operands
K-major, so V arrives keys-contiguous (the V ring is ``(head_dim, tile_n)`` per stage, V^T for PV) in an order
that lets P go to the PV WGMMA register for register (:func:`~epicute.sm90.fragments.acc_as_operand_a_8bit`);
Q's and K's descales join the tile's softmax scale, V's the final ``1 / row sum``, and Q's buffer is sized for
the bf16 O staged in it.

Sizes, strides, head counts and the split count are dynamic; head_dim, tiles,
dtype, causal, the packed group, the page size and the fused graphs are compile-time.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int16, Int32, cute
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator

from epicute.attention.fp8 import FP8_INPUT_DTYPES, KEY_GROUP, stored_dtype
from epicute.attention.key_blocks import KeyRange, QueryRange
from epicute.attention.mask import Diagonal, first_diagonal_block, key_blocks, seen_key_blocks
from epicute.attention.plan import WGMMA_M, AttentionConfig, attention_smem_layout, lpt_keys_per_band
from epicute.attention.softmax import LN_2, OnlineSoftmax, exp2_scale
from epicute.epilogue.fusion import EpilogueFusion, ScoreModFusion
from epicute.epilogue.schedule import ATTENTION_SM90, plain_graph, schedule
from epicute.sm90.epilogue_chain import EpilogueRun, StagedOutput, run_chain
from epicute.sm90.epilogue_emit import DSL_DTYPES, emit_score_mod
from epicute.sm90.fragments import (
    acc_as_operand_a,
    acc_as_operand_a_8bit,
    acc_rows_cols,
    pack_16bit,
    pack_pair,
    pack_pairs,
    row_major_smem_layout,
    select_modes,
    stmatrix_copy,
    warpgroup_gemm,
    warpgroup_slice,
)
from epicute.sm90.pipeline import (
    NamedBarriers,
    RingState,
    TmaStoreEpilogue,
    WarpgroupTurns,
    make_tma_load_pipeline,
    release_after,
    wait_full,
)
from epicute.sm90.tile_scheduler import TileQueue, band_coord
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP


def _pack_heads(t: cute.Tensor, group: int, head_mode: int, rows: int | None = None) -> cute.Tensor:
    """Fold the ``group`` query heads of each key/value head into the rows (mode 0): ``(seqlen, ...,
    heads, ...)`` -> ``((rows, seqlen), ..., heads // group, ...)``, row ``r`` = query ``r // rows``
    of head ``r % rows`` of the group (no data moves). ``rows`` (default ``group``) is the rows a
    query takes in a tile: a group that does not divide the tile is padded to a power of two, and
    the padded rows (``r % rows >= group``) alias the next group's heads, so they are never stored."""
    rows = group if rows is None else rows
    shape, stride = list(t.shape), list(t.stride)
    head_stride = stride[head_mode]
    shape[0], stride[0] = (rows, shape[0]), (head_stride, stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // group, head_stride * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def _packed_tma_atom(op, t_sdhb: cute.Tensor, smem_layout, tile: tuple[int, int], group: int, rows: int):
    """A TMA atom and tensor for ``(seqlen, dim, heads, batch)`` with the group's heads packed into
    the rows (see :func:`_pack_heads`), as ``((rows, seqlen), dim, heads_kv, batch)``; the box is
    ``(rows, tile_m // rows)`` heads x queries by ``dim``.

    When the group fills its rows, heads and queries are grouped into one mode for the atom, so the
    TMA stays 4-D and clips the ragged seqlen edge, then the heads mode is split back into (group,
    key/value head). A padded group (``rows > group``) keeps the group as a TMA dimension of its own,
    of extent ``group``: the box's padded heads fall outside it, so TMA zero-fills them on load and
    drops them on store (5-D)."""
    if group == rows:
        heads_first = cute.group_modes(select_modes(t_sdhb, [2, 0, 1, 3]), 0, 2)  # ((heads, seqlen), dim, batch)
        atom, tma = cpasync.make_tiled_tma_atom(op, heads_first, smem_layout, ((group, tile[0] // group), tile[1]))
        shape = ((group, tma.shape[0][1]), tma.shape[1], tma.shape[0][0] // group, tma.shape[2])
        stride = (tma.stride[0], tma.stride[1], tma.stride[0][0] * group, tma.stride[2])
        return atom, cute.make_tensor(tma.iterator, cute.make_layout(shape, stride=stride))
    grouped = _pack_heads(t_sdhb, group, 2)  # ((group, seqlen), dim, heads_kv, batch)
    atom, tma = cpasync.make_tiled_tma_atom(op, grouped, smem_layout, ((rows, tile[0] // rows), tile[1]))
    shape = ((rows, tma.shape[0][1]), tma.shape[1], tma.shape[2], tma.shape[3])
    return atom, cute.make_tensor(tma.iterator, cute.make_layout(shape, stride=tma.stride))


class AttentionSm90:
    """Compile-time description of one attention kernel variant (see module docstring)."""

    def __init__(
        self,
        cfg: AttentionConfig,
        dtype: str,
        causal: bool,
        score_mod: ScoreModFusion | None = None,
        epilogue: EpilogueFusion | None = None,
        page_size: int = 0,
        seqused_k: bool = False,
        varlen: bool = False,
    ):
        cfg.validate(dtype=dtype)
        self.cfg = cfg
        self.dtype = DSL_DTYPES[dtype]
        self.dtype_name = dtype
        #: fp8 inputs: V arrives keys-contiguous (epicute.attention.fp8), scales come with Q, K and V, and O is
        #: stored in a wider dtype, staged in Q's buffer sized for it (or in its own, ``o_buffer``).
        self.fp8 = dtype in FP8_INPUT_DTYPES
        self.causal = causal
        self.score_mod = score_mod
        self.epilogue = epilogue
        #: The output epilogue the kernel runs: the fusion's chain, or the plain one (cast and store O).
        self.chain = (epilogue.stages if epilogue is not None
                      else schedule(plain_graph(stored_dtype(dtype)), style=ATTENTION_SM90).stages)  # fmt: skip
        #: Each stored output's dtype (D first): all are staged in one buffer (Q's, or O's own), one after the other.
        self.output_dtypes = epilogue.tile_output_dtypes if epilogue is not None else {"D": stored_dtype(dtype)}
        self.smem = attention_smem_layout(cfg, dtype)
        self.num_wg = cfg.num_mma_warpgroups
        self.load_warp = 0
        # First warp of the first consumer warpgroup issues the O store.
        self.store_warp = THREADS_PER_WARPGROUP // 32
        #: Longest-processing-time-first order (causal only: otherwise every query block is as long).
        self.lpt = causal and cfg.lpt_order
        self.softmax = OnlineSoftmax(cfg.lazy_rescale)
        #: Query heads per tile row block (packed GQA; 1: a tile holds one head's queries), and the
        #: rows each query takes (the group padded to a power of two that divides tile_m).
        self.pack = cfg.pack_gqa
        self.pack_rows = cfg.pack_rows
        #: Keys per page of a paged K/V cache (0: contiguous K/V).
        self.page_size = page_size
        self.seqused_k = seqused_k
        #: Packed variable-length sequences (cu_seqlens_q/k; :class:`QueryRange`).
        self.varlen = varlen

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ_bshd: cute.Tensor,
        mK_bshd: cute.Tensor,
        mV_bshd: cute.Tensor,
        mO_bshd: cute.Tensor,
        mLSE_bhs: cute.Tensor,
        softmax_scale: Float32,
        score_tensors: tuple,
        score_scalars: tuple,
        epi_tensors: tuple,
        epi_scalars: tuple,
        max_ctas: Int32,
        tile_counter: cute.Tensor,
        paged: tuple,
        seqused: tuple,
        partials: tuple,
        varlen: tuple,
        descales: tuple,
        stream,
    ):
        """``paged``: ``()``, or ``(page_table,)`` (int32 ``(batch, pages per sequence)``) when K and V
        are a paged cache ``(num_pages, page_size, heads_kv, head_dim)``; ``seqused``: ``()`` or
        ``(seqused_k,)`` (int32 ``(batch,)``, keys each sequence uses); ``partials``: ``()``, or with
        split-KV the fp32 partial O ``(splits, batch, seqlen_q, heads_q, head_dim)`` and LSE
        ``(splits, batch, heads_q, seqlen_q)`` the combine kernel reads (O and LSE are then unwritten);
        ``varlen``: ``()``, or ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)`` (int32 ``(batch + 1,)`` twice,
        and an Int32) with Q, K, V, O and LSE packed: ``(1, total, heads, dim)`` and ``(1, heads, total_q)``;
        ``descales``: ``()``, or with fp8 inputs Q's, K's and V's descales, fp32 ``(batch, heads_kv)`` each (one
        per sequence and key/value head, read element by element). fp8 V is keys-contiguous
        (:mod:`epicute.attention.fp8`)."""
        cfg = self.cfg
        d = cfg.head_dim
        # (batch, seqlen, heads, dim) -> (seqlen, dim, heads, batch): TMA boxes are (rows, dim). A
        # paged cache (pages, page_size, heads, dim) becomes (page_size, dim, heads, pages) alike.
        mQ, mK, mV, mO = (select_modes(t, [1, 3, 2, 0]) for t in (mQ_bshd, mK_bshd, mV_bshd, mO_bshd))
        mLSE = select_modes(mLSE_bhs, [2, 1, 0])  # (seqlen_q, heads, batch)
        if cutlass.const_expr(self.pack > 1):
            mLSE = _pack_heads(mLSE, self.pack, 1, self.pack_rows)
        if cutlass.const_expr(cfg.split_kv):
            # (seqlen_q, dim, heads, batch, split) and (seqlen_q, heads, batch, split), packed like O.
            o_part, lse_part = select_modes(partials[0], [2, 4, 3, 1, 0]), select_modes(partials[1], [3, 2, 1, 0])
            if cutlass.const_expr(self.pack > 1):
                o_part = _pack_heads(o_part, self.pack, 2, self.pack_rows)
                lse_part = _pack_heads(lse_part, self.pack, 1, self.pack_rows)
            partials = (o_part, lse_part)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (self.num_wg, 1, 1), tiler_mn=(WGMMA_M, cfg.tile_n),
        )  # fmt: skip
        # fp8 WGMMA reads B K-major only: V^T with the keys contiguous, as fp8 V arrives.
        v_major = OperandMajorMode.K if self.fp8 else OperandMajorMode.MN
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, v_major, Float32,
            (self.num_wg, 1, 1), tiler_mn=(WGMMA_M, d), a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        sQ_layout = row_major_smem_layout(self.dtype, cfg.tile_m, d)
        sK_layout = row_major_smem_layout(self.dtype, cfg.tile_n, d, cfg.stages)
        sV_layout, sV_buffer = self._value_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = self._rows_tma_atom(g2s, mQ, sQ_layout)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, cute.slice_(sK_layout, (None, None, 0)), (cfg.tile_n, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, cute.slice_(sV_layout, (None, None, 0)), (cfg.tile_n, d))
        # Every stored output (O first) is staged in one buffer, with the layout of its own dtype, and
        # TMA-stored from there; the rest of the fused epilogue's tensors are read element by element.
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        queries = QueryRange(mQ, varlen)
        tma_o, tma_mO = self._rows_tma_atom(s2g, queries.store_tensor(mO), self._staging_layout("D"))
        epi_operands, epi_stores, epi_workspaces = (), (), ()
        if cutlass.const_expr(self.epilogue is not None):
            for (role, name, _), t in zip(self.epilogue.tensor_args, epi_tensors):
                if cutlass.const_expr(role == "aux"):
                    view = queries.store_tensor(select_modes(t, [1, 3, 2, 0]))
                    atom, tma_t = self._rows_tma_atom(s2g, view, self._staging_layout(name))
                    epi_stores += ((atom, tma_t),)
                elif cutlass.const_expr(role == "workspace"):
                    epi_workspaces += (t,)
                else:
                    epi_operands += (t,)

        # The storage struct and explain's table are one object (attention.plan.attention_smem_layout).
        for field, layout in (("sQ", sQ_layout), ("sK", sK_layout), ("sV", sV_buffer)):
            assert cute.cosize(layout) == self.smem.buffer(field).count, (field, cute.cosize(layout))
        self.shared_storage = self.smem.struct()
        # Query heads per key/value head a tile's head index is divided by (GQA/MQA; 1 when packed).
        group = cute.size(tma_mQ, mode=[2]) // cute.size(mK, mode=[2])
        scale_log2 = exp2_scale(softmax_scale, self.score_mod is not None)

        _, num_tiles = self._tiles(QueryRange(tma_mQ, varlen), cute.size(tma_mQ, mode=[2]), self._num_splits(partials))
        num_ctas = TileQueue.grid(num_tiles, max_ctas, cfg.persistent, cutlass.min)
        # plan.attention.lpt_heads_per_band on the runtime seqlen_k.
        keys_per_band = lpt_keys_per_band(d, self.dtype.width // 8)
        heads_per_band = cutlass.max(keys_per_band // self._capacity(mK, paged), 1)

        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, tma_o, tma_mO, mLSE,
            sQ_layout, sK_layout, sV_buffer, group, heads_per_band, softmax_scale, scale_log2,
            score_tensors, score_scalars, epi_operands, epi_stores, epi_workspaces, epi_scalars, tile_counter,
            paged, seqused, partials, varlen, descales,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=[cfg.num_threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_buffer: cute.ComposedLayout,
        group: Int32,
        heads_per_band: Int32,
        softmax_scale: Float32,
        scale_log2: Float32,
        score_tensors: tuple,
        score_scalars: tuple,
        epi_operands: tuple,
        epi_stores: tuple,
        epi_workspaces: tuple,
        epi_scalars: tuple,
        tile_counter: cute.Tensor,
        paged: tuple,
        seqused: tuple,
        partials: tuple,
        varlen: tuple,
        descales: tuple,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        if warp_idx == self.load_warp:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
            for atom, _ in epi_stores:
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        consumer_warps = cfg.num_mma_threads // 32
        # Q's buffer: filled by the producer, handed back by the store warp alone once O's store has read it, or
        # (o_buffer) by every consumer warp once its last QK^T has retired.
        q_releases = consumer_warps if cutlass.const_expr(cfg.o_buffer) else 1
        q_pipe = make_tma_load_pipeline(
            storage.q_barriers.data_ptr(), 1, cute.size_in_bytes(self.dtype, sQ_layout), q_releases, (1, 1), 1,
            defer_sync=True,
        )
        k_pipe, v_pipe = (
            make_tma_load_pipeline(
                barriers.data_ptr(), cfg.stages, kv_bytes, consumer_warps, (1, 1), 1, defer_sync=True
            )
            for barriers in (storage.k_barriers, storage.v_barriers)
        )
        if cutlass.const_expr(self.fp8 and not cfg.o_buffer):  # Q's buffer is sized for the wider staged outputs
            sQ = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), sQ_layout.inner, dtype=self.dtype),
                                  sQ_layout.outer)  # fmt: skip
        else:
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV, sVt = self._value_views(storage.sV.get_tensor(sV_buffer.outer, swizzle=sV_buffer.inner))
        num_splits = self._num_splits(partials)
        keys = KeyRange(self, self._capacity(mK, paged), num_splits, paged, seqused, varlen)
        queries = QueryRange(mQ, varlen)
        _, num_tiles = self._tiles(queries, cute.size(mQ, mode=[2]), num_splits)
        tiles = TileQueue(
            storage.tile_slot.get_tensor(cute.make_layout((5, 2))),
            num_tiles,
            None,  # each role sets the order (_work_coord) from the extents it computes
            tile_counter if cutlass.const_expr(cfg.dynamic_tiles) else None,
            meeting_threads=32 + cfg.num_mma_threads,  # the load warp and the consumers
        )
        # Barrier initialization is visible to every thread (and the async proxy) before first use.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == self.load_warp:
                self._load(
                    tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_pipe, k_pipe, v_pipe, group, heads_per_band, tiles,
                    queries, keys,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            # Each stored output's staging view: Q's bytes (or O's own buffer's), in the output dtype's layout.
            staging = {name: self._staging_view(storage, sQ, name) for name in self.output_dtypes}
            stores = {"D": (tma_o, mO), **dict(zip(self.output_dtypes_aux, epi_stores))}
            self._consume(
                tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, mO, mLSE, group, heads_per_band,
                softmax_scale, scale_log2, score_tensors, score_scalars, (epi_operands, epi_workspaces, epi_scalars),
                staging, stores, tidx - THREADS_PER_WARPGROUP, warp_idx == self.store_warp, tiles,
                queries, keys, partials, descales,
            )  # fmt: skip

    @property
    def output_dtypes_aux(self) -> tuple[str, ...]:
        """The aux outputs' names, in the order of the kernel's aux tensors."""
        return tuple(name for name in self.output_dtypes if name != "D")

    def _value_layouts(self):
        """V's ring as TMA fills it, ``(tile_n, head_dim, stages)``, and as it is allocated: row-major V (head_dim
        contiguous) both, or with fp8 a view of the keys-contiguous V^T ring ``(head_dim, tile_n, stages)``."""
        cfg = self.cfg
        if cutlass.const_expr(self.fp8):
            buffer = row_major_smem_layout(self.dtype, cfg.head_dim, cfg.tile_n, cfg.stages)
            return cute.composition(buffer, self._swap_first_modes(cfg.tile_n, cfg.head_dim)), buffer
        layout = row_major_smem_layout(self.dtype, cfg.tile_n, cfg.head_dim, cfg.stages)
        return layout, layout

    def _value_views(self, ring: cute.Tensor):
        """(V ``(tile_n, head_dim, stages)`` for the loads, V^T ``(head_dim, tile_n, stages)`` for PV's B operand)
        of the allocated ring: V^T a view of row-major V, or (fp8) V a view of the keys-contiguous V^T."""
        cfg = self.cfg
        if cutlass.const_expr(self.fp8):
            return cute.composition(ring, self._swap_first_modes(cfg.tile_n, cfg.head_dim)), ring
        return ring, cute.composition(ring, self._swap_first_modes(cfg.head_dim, cfg.tile_n))

    def _swap_first_modes(self, rows: int, cols: int):
        """The layout that reads a ``(cols, rows, stages)`` tile as ``(rows, cols, stages)`` (compose it with the
        tile): the same bytes, the first two modes swapped."""
        return cute.make_ordered_layout((rows, cols, self.cfg.stages), order=(1, 0, 2))

    def _staging_layout(self, name: str):
        """Output ``name``'s staging layout: a row-major ``tile_m x head_dim`` tile of its dtype."""
        return row_major_smem_layout(DSL_DTYPES[self.output_dtypes[name]], self.cfg.tile_m, self.cfg.head_dim)

    def _staging_view(self, storage, sQ, name: str):
        """The staging buffer (Q's, or O's own with ``o_buffer``) viewed as output ``name``'s staging tile (Q's own
        view when the dtypes agree; outputs no wider than q's elements, bf16 for fp8 q, fit: the host checks)."""
        if cutlass.const_expr(self.output_dtypes[name] == self.dtype_name and not self.cfg.o_buffer):
            return sQ
        layout = self._staging_layout(name)
        dtype = DSL_DTYPES[self.output_dtypes[name]]
        buffer = storage.sO if cutlass.const_expr(self.cfg.o_buffer) else storage.sQ
        return cute.make_tensor(cute.recast_ptr(buffer.data_ptr(), layout.inner, dtype=dtype), layout.outer)

    def _rows_tma_atom(self, op, t_sdhb, smem_layout):
        """The TMA atom and tensor of a ``(seqlen, dim, heads, batch)`` Q, O or aux tile, boxes of
        ``tile_m`` rows by head_dim; with packed GQA, rows are (head in group, query) pairs and the
        tensor is ``((group, seqlen), dim, heads_kv, batch)``."""
        tile = (self.cfg.tile_m, self.cfg.head_dim)
        if cutlass.const_expr(self.pack > 1):
            return _packed_tma_atom(op, t_sdhb, smem_layout, tile, self.pack, self.pack_rows)
        return cpasync.make_tiled_tma_atom(op, t_sdhb, smem_layout, tile)

    def _num_splits(self, partials):
        """Splits of each tile's keys: the partials' count (split-KV), else 1 (a constant)."""
        return cute.size(partials[0], mode=[4]) if cutlass.const_expr(self.cfg.split_kv) else 1

    def _capacity(self, mK, paged):
        """Keys a sequence holds at most: K's length, or a paged sequence's pages x page_size."""
        if cutlass.const_expr(self.page_size):
            return cute.size(paged[0], mode=[1]) * self.page_size
        return cute.size(mK, mode=[0])

    def _tiles(self, queries: QueryRange, heads, num_splits):
        """(m-blocks, work tiles) over the queries' rows (packed, with packed GQA; the longest
        sequence's, varlen), ``heads`` (a key/value head's, packed) and sequences."""
        m_blocks = cute.ceil_div(queries.rows, self.cfg.tile_m)
        return m_blocks, m_blocks * heads * queries.batches * num_splits

    @cute.jit
    def _work_coord(self, tile, m_blocks, heads, head_batches, heads_per_band, num_splits):
        """(m_block, head, batch, split) of work tile ``tile``.

        A tile's key splits are consecutive (split-KV; one split otherwise). Without LPT, tiles
        run m-block fastest, then head, then batch. With LPT they walk an (m-block, batch x head)
        raster in bands of ``heads_per_band`` heads with m-blocks descending: every band's longest
        blocks start first and the short ones fill the tail, while the tiles in flight share the K
        and V of a few heads in L2.
        """
        split, tile = tile % num_splits, tile // num_splits
        if cutlass.const_expr(self.lpt):
            longest_first, bh = band_coord(tile, m_blocks, head_batches, heads_per_band)
            m_block = m_blocks - 1 - longest_first
        else:
            m_block, bh = tile % m_blocks, tile // m_blocks
        return m_block, bh % heads, bh // heads, split

    def _has_rows(self, m_block, bounds):
        """Whether m-block ``m_block`` holds rows of its sequence (``bounds``: :meth:`QueryRange.bounds`):
        always, unless the sequences are packed (varlen), each with its own length."""
        if cutlass.const_expr(self.varlen):
            return m_block * self.cfg.tile_m < bounds[1]
        return True

    def _query(self, row):
        """The query index of packed row ``row`` of a (batch, head): the row itself, or with packed
        GQA the row's query (rows run head-in-group fastest, ``pack_rows`` per query)."""
        return row // self.pack_rows if cutlass.const_expr(self.pack > 1) else row

    def _is_head_row(self, row):
        """Whether packed row ``row`` holds a query head (False for a padded group's extra rows)."""
        if cutlass.const_expr(self.pack_rows != self.pack):
            return row % self.pack_rows < self.pack
        return True

    def _n_blocks(self, m_block, seqlen_q, seqlen_k):
        """Key blocks this query tile reads: all of them, or (causal) up to the last row's diagonal.

        At least one: a tile whose rows all see no key (causal above the diagonal, or
        seqused_k = 0) still runs one block, fully masked, and so writes O = 0 and LSE = -inf.
        """
        cfg = self.cfg
        n = key_blocks(seqlen_k, cfg.tile_n)
        if cutlass.const_expr(self.causal):
            last_query = self._query((m_block + 1) * cfg.tile_m - 1)
            n = cutlass.min(n, seen_key_blocks(Diagonal(seqlen_q, seqlen_k), last_query, cfg.tile_n))
        if cutlass.const_expr(self.seqused_k or self.varlen):
            n = cutlass.max(n, 1)  # seqlen_k >= 1 otherwise (checked on the host)
        return n

    @cute.jit
    def _load(
        self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_pipe, k_pipe, v_pipe, group, heads_per_band, tiles,
        queries, keys,
    ):  # fmt: skip
        cfg = self.cfg
        d = cfg.head_dim
        one = cute.make_layout(1)
        heads = cute.size(mQ, mode=[2])
        head_batches = heads * queries.batches
        state = RingState.producer(cfg.stages)
        q_state = RingState.producer(1)
        m_blocks, _ = self._tiles(queries, heads, keys.num_splits)
        tiles = tiles.ordered_by(
            lambda t: self._work_coord(t, m_blocks, heads, head_batches, heads_per_band, keys.num_splits)
        )
        tile = tiles.first()
        while tiles.is_valid(tile):
            m_block, head, batch, split = tiles.coord(tile)
            bounds = queries.bounds(batch)
            # Packed sequences are as long as they are: the m-blocks past a short one's rows are
            # skipped here, so the consumers never see them (dynamic tiles are announced; static
            # ones are skipped by the same test).
            if self._has_rows(m_block, bounds):
                seqlen_q = self._query(bounds[1])
                n_end, n_count, _ = keys.blocks(m_block, split, seqlen_q, keys.seqlen(batch))
                kv_head = head // group
                m_seq = queries.load_view(mQ[None, None, head, bounds[2]], bounds)
                gQ = cute.local_tile(m_seq, (cfg.tile_m, d), (m_block, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                tKsK, tKgK = keys.partition(tma_k, sK, mK, kv_head, batch)
                # fp8 V of packed sequences: each sequence's value slots start at a whole group (fp8.value_starts).
                tVsV, tVgV = keys.partition(tma_v, sV, mV, kv_head, batch, KEY_GROUP if self.fp8 else 0)

                # The first K block before Q: it only needs a free K stage, while Q waits for the
                # previous tile's O to leave Q's buffer.
                k_pipe.producer_acquire(state)
                cute.copy(tma_k, keys.block(tma_k, sK, mK, tKgK, kv_head, batch, n_end - 1), tKsK[None, state.index],
                          tma_bar_ptr=k_pipe.producer_get_barrier(state))  # fmt: skip
                tiles.announce(q_pipe, q_state, tile, (m_block, head, batch, split))
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                tiles.meet()  # dynamic tiles: the consumers read the announced tile past this barrier
                q_state.advance()
                # K runs one block ahead of V: K[n - 1] is in flight before V[n].
                for i in cutlass.range(n_count - 1, unroll=1):
                    n = n_end - 2 - i
                    v_state = state.clone()
                    state.advance()
                    k_pipe.producer_acquire(state)
                    cute.copy(tma_k, keys.block(tma_k, sK, mK, tKgK, kv_head, batch, n), tKsK[None, state.index],
                              tma_bar_ptr=k_pipe.producer_get_barrier(state))  # fmt: skip
                    v_pipe.producer_acquire(v_state)
                    cute.copy(tma_v, keys.block(tma_v, sV, mV, tVgV, kv_head, batch, n + 1), tVsV[None, v_state.index],
                              tma_bar_ptr=v_pipe.producer_get_barrier(v_state))  # fmt: skip
                v_pipe.producer_acquire(state)
                cute.copy(tma_v, keys.block(tma_v, sV, mV, tVgV, kv_head, batch, n_end - n_count),
                          tVsV[None, state.index], tma_bar_ptr=v_pipe.producer_get_barrier(state))  # fmt: skip
                state.advance()
            # Claimed once this tile's loads are issued, as late as the ring allows: the consumers
            # are a few blocks from its end, so a dynamic claim sees how the other CTAs got on.
            tile = tiles.next(tile)
        tiles.announce_end(q_pipe, q_state)
        # No producer_tail: without a cluster no remote CTA arrives on our barriers.

    # ------------------------------------------------------------ consumers
    @cute.jit
    def _scores(
        self, acc_S, tScS, m_block, n, seqlen_q, seqlen_k, key_limit, softmax_scale, index_bh, score_args,
        mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """score_mod, then the key-limit (ragged seqlen_k, split end) and causal masks (-inf), on
        one S block in registers. ``score_args``: the score_mod's per-head vectors, its operands
        loaded for the tile's head, and that head (packed GQA: a key/value head, and the operands
        are loaded per row, whose query head varies)."""
        cfg = self.cfg
        S = acc_rows_cols(acc_S)
        cS = acc_rows_cols(tScS)
        if cutlass.const_expr(self.score_mod is not None):
            score_tensors, score_operands, tile_head = score_args
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                row = m_block * cfg.tile_m + cS[r, 0][0]
                index = dict(index_bh)
                index["q_idx"] = self._query(row).to(Float32)
                operands = score_operands
                if cutlass.const_expr(self.pack > 1):
                    in_group = row % self.pack_rows
                    if cutlass.const_expr(self.pack_rows != self.pack):
                        in_group = cutlass.min(in_group, self.pack - 1)  # a padded row: never stored
                    head = tile_head * self.pack + in_group
                    index["h"] = head.to(Float32)
                    operands = dict(score_operands)
                    for i, (name, _, _) in enumerate(self.score_mod.tensor_operands):
                        operands[name] = score_tensors[i][head].to(Float32)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    index["kv_idx"] = (n * cfg.tile_n + cS[0, c][1]).to(Float32)
                    S[r, c] = self._score_mod(S[r, c] * softmax_scale, index, operands)
        if cutlass.const_expr(mask_seqlen or mask_causal):
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                # Columns >= limit (block-local) are masked for this row.
                limit = key_limit - n * cfg.tile_n
                if cutlass.const_expr(mask_causal):
                    q = self._query(m_block * cfg.tile_m + cS[r, 0][0])
                    limit = cutlass.min(limit, Diagonal(seqlen_q, seqlen_k).key_end(q) - n * cfg.tile_n)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    S[r, c] = cutlass.select_(cS[0, c][1] >= limit, -Float32.inf, S[r, c])

    def _score_mod(self, score, index: dict, operands: dict):
        """The traced score_mod on one scaled score: its leaves are the score, the index leaves and
        the operands (by name); its ops are emitted like every epilogue's."""
        graph = self.score_mod.graph
        return emit_score_mod(graph, score, index, operands)[dict(graph.outputs)["D"]]

    @cute.jit
    def _consume(
        self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, mO, mLSE, group, heads_per_band,
        softmax_scale, scale_log2, score_tensors, score_scalars, epi_args, staging, stores, mma_tidx, is_store_warp,
        tiles, queries, keys, partials, descales,
    ):  # fmt: skip
        cfg = self.cfg
        d = cfg.head_dim
        wg = cute.arch.make_warp_uniform(mma_tidx // THREADS_PER_WARPGROUP)
        thr_qk = tiled_mma_qk.get_slice(mma_tidx)
        thr_pv = tiled_mma_pv.get_slice(mma_tidx)
        # Shared-memory operands: see warpgroup_slice.
        wg_qk = warpgroup_slice(tiled_mma_qk, wg)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = tiled_mma_pv.make_fragment_B(warpgroup_slice(tiled_mma_pv, wg).partition_B(sVt))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        tScS = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))

        mma_turns = WarpgroupTurns(NamedBarriers.MMA_TURN_WG1, self.num_wg, enabled=cfg.pingpong)
        mma_turns.grant_first(wg)
        store = TmaStoreEpilogue(1, cfg.num_mma_threads)
        read = RingState.consumer(cfg.stages)
        q_read = RingState.consumer(1)
        heads = cute.size(mO, mode=[2])
        head_batches = heads * queries.batches
        m_blocks, _ = self._tiles(queries, heads, keys.num_splits)
        tiles = tiles.ordered_by(
            lambda t: self._work_coord(t, m_blocks, heads, head_batches, heads_per_band, keys.num_splits)
        )
        tile = tiles.follow(None, q_pipe, q_read)
        while tiles.is_valid(tile):
            m_block, head, batch, split = tiles.followed_coord(tile, 4, q_read)  # dynamic: announced with Q
            bounds = queries.bounds(batch)
            if self._has_rows(m_block, bounds):  # packed sequences: see _load
                q_rows = bounds[1]  # the (batch, head)'s query rows, packed with packed GQA
                seqlen_q = self._query(q_rows)
                seqlen_k = keys.seqlen(batch)
                n_end, n_count, key_limit = keys.blocks(m_block, split, seqlen_q, seqlen_k)
                acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n)), Float32)
                acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((cfg.tile_m, d)), Float32)
                rows = cute.size(acc_rows_cols(acc_S), mode=[0])
                row_max = cute.make_rmem_tensor(rows, Float32)
                row_sum = cute.make_rmem_tensor(rows, Float32)
                row_scale = cute.make_rmem_tensor(rows, Float32)

                # score_mod leaves that are constant over the tile, loaded once.
                index_bh = {"b": batch.to(Float32), "h": head.to(Float32)}
                score_operands = {}
                if cutlass.const_expr(self.score_mod is not None):
                    if cutlass.const_expr(self.pack == 1):  # packed GQA: loaded per row (_scores)
                        for i, (name, _, _) in enumerate(self.score_mod.tensor_operands):
                            score_operands[name] = score_tensors[i][head].to(Float32)
                    for i, (name, _, _) in enumerate(self.score_mod.scalar_operands):
                        score_operands[name] = score_scalars[i]
                score_args = (score_tensors, score_operands, head)
                tile_scale, tile_scale_log2, v_descale = self._tile_scales(
                    softmax_scale, scale_log2, descales, batch, head, group
                )

                # ---- first (right-most) block, peeled: its softmax is compile-time is_first.
                n = n_end - 1
                if cutlass.const_expr(not tiles.dynamic):
                    wait_full(q_pipe, q_read)
                wait_full(k_pipe, read)
                mma_turns.wait(wg)
                warpgroup_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, read.index], False, -1)
                mma_turns.pass_on(wg)
                warpgroup.wait_group(0)
                k_pipe.consumer_release(read)
                self._scores(acc_S, tScS, m_block, n, seqlen_q, seqlen_k, key_limit, tile_scale, index_bh,
                             score_args, True, self.causal)  # fmt: skip
                self.softmax.fold(acc_S, row_max, row_sum, row_scale, tile_scale_log2, True)
                self._hand_over_p(acc_S, tOrP)

                # ---- blocks crossing the causal diagonal, then blocks fully below it.
                n_masked = 0
                if cutlass.const_expr(self.causal):
                    diagonal = Diagonal(seqlen_q, seqlen_k)
                    first_masked = first_diagonal_block(diagonal, self._query(m_block * cfg.tile_m), cfg.tile_n)
                    n_masked = cutlass.max(n_end - 1 - first_masked, 0)
                for i in cutlass.range(n_count - 1, unroll=1):
                    n = n_end - 2 - i
                    read_v = read.clone()
                    read.advance()
                    wait_full(k_pipe, read)
                    mma_turns.wait(wg)
                    # A fresh accumulator per block: with accumulate off, its old values are dead and
                    # need not stay in registers (as WGMMA inputs) until the QK^T is issued.
                    acc_S_n = cute.make_rmem_tensor(acc_S.layout, Float32)
                    warpgroup_gemm(tiled_mma_qk, acc_S_n, tSrQ, tSrK[None, None, None, read.index], False, -1)
                    if cutlass.const_expr(cfg.rescale_o_early):
                        # The previous softmax's scale, applied while QK^T runs (the last PV has retired).
                        self.softmax.rescale_lazy(acc_O, row_scale)
                    wait_full(v_pipe, read_v)
                    # O's accumulate flag is off for the first PV: no zero-fill of O needed.
                    warpgroup_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, read_v.index], i > 0, -1)
                    mma_turns.pass_on(wg)
                    warpgroup.wait_group(1)  # S is ready; PV still runs under the softmax
                    if cutlass.const_expr(not cfg.release_k_late):
                        k_pipe.consumer_release(read)
                    if i < n_masked:
                        self._scores(acc_S_n, tScS, m_block, n, seqlen_q, seqlen_k, key_limit, tile_scale, index_bh,
                                     score_args, False, True)  # fmt: skip
                    else:
                        self._scores(acc_S_n, tScS, m_block, n, seqlen_q, seqlen_k, key_limit, tile_scale, index_bh,
                                     score_args, False, False)  # fmt: skip
                    self.softmax.fold(acc_S_n, row_max, row_sum, row_scale, tile_scale_log2, False)
                    if cutlass.const_expr(cfg.release_k_late):
                        # K's stage is free since S landed; released after the softmax (whose last row sum
                        # it waits for) so the PV wait below stays after the softmax too: see release_after.
                        release_after(k_pipe, read, row_sum[cute.size(row_sum) - 1])
                    warpgroup.wait_group(0)
                    v_pipe.consumer_release(read_v)
                    self._hand_over_p(acc_S_n, tOrP)
                    if cutlass.const_expr(not cfg.rescale_o_early):
                        self.softmax.rescale_lazy(acc_O, row_scale)
                # ---- the last PV.
                if cutlass.const_expr(cfg.o_buffer):
                    # Every QK^T of the tile has retired (the loop's waits): the next tile's Q may land now.
                    q_pipe.consumer_release(q_read)
                if cutlass.const_expr(cfg.rescale_o_early):
                    self.softmax.rescale_lazy(acc_O, row_scale)
                wait_full(v_pipe, read)
                warpgroup_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, read.index], n_count > 1, 0)
                v_pipe.consumer_release(read)
                read.advance()  # the next tile's first block, on the ring's next stage

                self._epilogue(
                    tiled_mma_pv, thr_pv, acc_O, row_max, row_sum, row_scale, tile_scale_log2, v_descale, mLSE,
                    (m_block, head, batch),
                    queries, bounds, epi_args, staging, stores, mma_tidx, is_store_warp, store, (split, partials),
                )  # fmt: skip
                # The O store has read Q's buffer (publish waits for that): the next tile's Q may land.
                if cutlass.const_expr(not cfg.o_buffer):  # noqa: SIM102 - a compile-time branch around a runtime one
                    if is_store_warp:
                        q_pipe.consumer_release(q_read)
                q_read.advance()
            tile = tiles.follow(tile, q_pipe, q_read)
        store.drain(is_store_warp)

    def _tile_scales(self, softmax_scale, scale_log2, descales, batch, head, group):
        """(the scores' scale, exp2's factor, V's descale) of one tile: the launch's, or with fp8 inputs Q's and
        K's descales of the tile's sequence and key/value head folded into the scale (V's is applied with the
        final 1 / row sum). ``head``: the tile's query head, or its key/value head with packed GQA."""
        if cutlass.const_expr(not self.fp8):
            return softmax_scale, scale_log2, Float32(1.0)
        q_descale, k_descale, v_descale = descales
        kv_head = head if cutlass.const_expr(self.pack > 1) else head // group
        scale = softmax_scale * q_descale[batch, kv_head] * k_descale[batch, kv_head]
        return scale, exp2_scale(scale, self.score_mod is not None), v_descale[batch, kv_head]

    def _hand_over_p(self, acc_S, tOrP):
        """P (the softmax's S registers) as PV's A operand: 16-bit pairs where they lie, or fp8 in the order
        the registers hold them, which the value tile's key order matches (:mod:`epicute.attention.fp8`)."""
        if cutlass.const_expr(self.fp8):
            pack_pairs(acc_as_operand_a_8bit(acc_S), tOrP)
        else:
            pack_16bit(acc_as_operand_a(acc_S), tOrP)

    @cute.jit
    def _epilogue(
        self, tiled_mma_pv, thr_pv, acc_O, row_max, row_sum, row_scale, scale_log2, v_descale, mLSE, tile, queries,
        bounds, epi_args, staging, stores, mma_tidx, is_store_warp, store, split_args,
    ):  # fmt: skip
        """O normalized by the row sums and its LSE written, then the output epilogue's chain
        (:mod:`epicute.sm90.epilogue_chain`) over the tile as one subtile: every stored output is
        staged in Q's buffer -- whose rows each warpgroup stages were read only by its own QK^T
        WGMMAs, all retired -- or (``o_buffer``) in the outputs' own, which the previous tile's last
        store has finished reading, and TMA-stored from there, one after the other.

        With split-KV the normalized fp32 O and the LSE of the split's keys go to the partials
        instead (``split_args``: the split and the partial tensors), for the combine kernel.
        ``bounds``: the sequence's rows in ``queries`` (:meth:`QueryRange.bounds`; packed rows with packed GQA)."""
        cfg = self.cfg
        d = cfg.head_dim
        m_block, head, _ = tile
        first_row, seqlen_q, tensor_batch = bounds
        # ---- finalize: 1 / row sum, and LSE = max * scale + ln(sum).
        lse = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            empty = total == Float32(0.0)  # every score of the row was masked
            row_scale[r] = cute.arch.rcp_approx(cutlass.select_(empty, Float32(1.0), total))
            if cutlass.const_expr(self.fp8):
                row_scale[r] = row_scale[r] * v_descale
            lse[r] = cutlass.select_(
                empty, -Float32.inf, (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            )
        self.softmax.rescale(acc_O, row_scale)

        ident = cute.make_identity_tensor((cfg.tile_m, d))
        cO = thr_pv.partition_C(ident)
        cO_rc = acc_rows_cols(cO)
        if cutlass.const_expr(cfg.split_kv):
            self._store_partials(acc_O, lse, cO_rc, tile, seqlen_q, split_args)
            # Every consumer is past its last read of Q's buffer before the store warp frees it.
            store.sync()
        else:
            if cO_rc[0, 0][1] == 0:  # one lane of each quad writes its rows' LSE
                for r in cutlass.range_constexpr(cute.size(lse)):
                    q = m_block * cfg.tile_m + cO_rc[r, 0][0]
                    if q < seqlen_q and self._is_head_row(q):
                        mLSE[first_row + q, head, tensor_batch] = lse[r]
            outputs = {}
            for name, dtype in self.output_dtypes.items():
                # O's fp32 values are its accumulator; aux tiles are rounded as they are computed (no
                # second fp32 tile of registers next to O's: at d256 that would not fit).
                values = acc_O if name == "D" else None
                atom, tensor = stores[name]
                outputs[name] = AttentionOutput(
                    name, dtype, values, acc_O.shape, atom, tensor, staging[name], tiled_mma_pv, mma_tidx
                )
            run = AttentionEpilogueRun(
                self, outputs, store, is_store_warp, tile, queries, bounds, cO, epi_args, mma_tidx
            )
            if cutlass.const_expr(self.epilogue is not None):
                run.coords0 = tiled_mma_pv.get_slice(0).partition_C(ident)
            run_chain("begin", run)
            run_chain("subtile", run)
            run_chain("end", run)

    @cute.jit
    def _store_partials(self, acc_O, lse, cO_rc, tile, rows, split_args):
        """Split-KV: this split's normalized fp32 O rows and their LSE, for the combine kernel; rows
        past the (batch, head)'s ``rows`` are not stored."""
        m_block, head, batch = tile
        split, (o_part, lse_part) = split_args
        O = acc_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(lse)):
            q = m_block * self.cfg.tile_m + cO_rc[r, 0][0]
            if q < rows and self._is_head_row(q):
                if cO_rc[r, 0][1] == 0:  # one lane of each quad writes its rows' LSE
                    lse_part[q, head, batch, split] = lse[r]
                for c in cutlass.range_constexpr(cute.size(O, mode=[1])):
                    o_part[q, cO_rc[r, c][1], head, batch, split] = O[r, c]


class AttentionOutput(StagedOutput):
    """O or an aux tile of the attention epilogue: the tile's fp32 registers, cast (16-bit pairs
    packed as the PV operand is), copied into its staging view of Q's buffer and TMA-stored whole;
    the TMA store clips the rows past seqlen_q."""

    def __init__(self, name, dtype, values, shape, atom, tensor, staging, tiled_mma_pv, mma_tidx):
        super().__init__(name, dtype, values)
        self.atom, self.tensor, self.staging = atom, tensor, staging
        dsl = DSL_DTYPES[dtype]
        self.converted = cute.make_rmem_tensor(shape, dsl)
        self.r2s = stmatrix_copy(tiled_mma_pv, dsl)
        self.thr_r2s = self.r2s.get_slice(mma_tidx)

    def begin(self, run) -> None:
        cfg = run.kernel.cfg
        m_block, head, batch = run.tile
        rows = run.queries.store_view(self.tensor, head, batch, run.bounds)
        gO = cute.local_tile(rows, (cfg.tile_m, cfg.head_dim), (m_block, 0))
        self.tma_smem, self.tma_gmem = cpasync.tma_partition(
            self.atom, 0, cute.make_layout(1), cute.group_modes(self.staging, 0, 2), cute.group_modes(gO, 0, 2)
        )

    def cast(self, run) -> None:
        pack_pairs(self.values, self.converted)  # outputs are 16-bit or fp8 (checked on the host)

    def cast_element(self, run, v: int, value) -> None:
        # Pairs of neighbours share a register word: the even element waits for the odd one.
        if v % 2 == 0:
            self.pending = value
        else:
            words = cute.recast_tensor(self.converted, Int16 if DSL_DTYPES[self.dtype].width == 8 else Int32)
            words[v // 2] = pack_pair(self.pending, value, DSL_DTYPES[self.dtype])

    def store_smem(self, run) -> None:
        cute.copy(self.r2s, self.thr_r2s.retile(self.converted), self.thr_r2s.partition_D(self.staging))

    def tma_copy(self, run) -> tuple:
        return self.atom, self.tma_smem, self.tma_gmem


class AttentionEpilogueRun(EpilogueRun):
    """Attention's :class:`~epicute.sm90.epilogue_chain.EpilogueRun` over one O tile (one subtile):
    the accumulator is O itself, operand tiles ``(batch, seqlen_q, heads, head_dim)`` and vectors
    ``(head_dim,)`` are read from global memory where the compute needs them, and reductions see
    the problem as ``(L, M, N) = (batch * heads, seqlen_q, head_dim)``, as the reference does."""

    def __init__(self, kernel, outputs, store, is_store_warp, tile, queries, bounds, cO, epi_args, mma_tidx):
        super().__init__()
        cfg, fusion = kernel.cfg, kernel.epilogue
        self.kernel, self.fusion, self.stages = kernel, fusion, kernel.chain
        self.outputs, self.store, self.is_store_warp = outputs, store, is_store_warp
        self.tile, self.queries, self.bounds, self.seqlen_q = tile, queries, bounds, bounds[1]
        self.subtile_size = cute.size(outputs["D"].values)  # O's: the tile is one subtile
        if cutlass.const_expr(fusion is not None):
            operands, workspaces, scalars = epi_args
            m_block, head, batch = tile
            self.coords, self.scalars, self.workspaces, self.lane = cO, scalars, workspaces, mma_tidx % 32
            self.origin, self.extent = (m_block * cfg.tile_m, 0), (self.seqlen_q, cfg.head_dim)
            heads = cute.size(self.outputs["D"].tensor, mode=[2])
            self.tile_index = (0, batch * heads + head)  # (tn, tl): one tile spans head_dim
            tensors = dict(zip(fusion.tile_inputs + fusion.row_inputs, operands))
            self.tiles = {name: tensors[name] for name in fusion.tile_inputs}
            # A row vector of head_dim values: its tile-local index is the global one.
            self.vectors = {name: tensors[name] for name in fusion.row_inputs}

    def slice_acc(self) -> None:
        """The subtile is the whole O tile, already in D's registers."""

    def tile_value(self, name, v, m, n):
        m_block, head, batch = self.tile
        # Rows past seqlen_q read a valid row; the TMA store clips them.
        q = cutlass.min(m_block * self.kernel.cfg.tile_m + m, self.seqlen_q - 1)
        return self.tiles[name][batch, q, head, n].to(Float32)
