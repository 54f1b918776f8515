"""FlashAttention-3 style attention backward for SM90.

Given Q, K, V, O's gradient dO, the forward's LSE and ``D = rowsum(dO * O)`` (the host's
preprocess), with ``P = exp(S - LSE)`` recomputed from ``S = Q K^T * scale``::

    dV = P^T dO        dP = dO V^T        dS = P * (dP - D)
    dK = dS^T Q * scale                    dQ = dS K * scale

A CTA owns ``tile_n`` keys of one (batch, key/value head) and walks every query block that
sees them (causal: from the diagonal down), for each query head of its share of the GQA group, so
dK and dV accumulate in registers. With the whole group (``heads`` = the group) they are stored
once, the group's sum; split over ``ceil(group / heads)`` CTAs (``head_split``: the planner's choice for
causal GQA, whose CTAs of one key/value head otherwise stream more queries than L2 holds), each CTA
adds its fp32 part into a zeroed accumulator with a bulk reduce-add, in fragment order as dQ, and
the postprocess casts it. Warp roles:

- producer warp 0: K and V once, then each step's Q and dO tiles and its queries' LSE and D
  through a ``stages``-deep ring (one full barrier covers all four).
- producer warp 1 (dQ writer): adds each consumer warpgroup's staged dQ into the fp32 dQ
  accumulator in global memory with one bulk reduce-add (other CTAs add theirs: the sum's
  order is not fixed), and hands the staging buffer back once the reduce-add has read it.
  At head_dim 64 and 128 (``BackwardConfig.dq_fragment_order``) dQ is staged and accumulated in
  the WGMMA accumulator's own order (:func:`dq_fragment`): each thread's registers, four at a
  time, as consecutive 16-byte stores that no two lanes share a bank in, and each warpgroup's
  part of a query block is one contiguous run of the accumulator; the postprocess
  (:mod:`~epicute.attention.backward_prep_sm90`) un-permutes it through the same partition as it
  scales and casts dQ. At 256 it is row-major, staged in a swizzled tile for a TMA reduce-add.
  ``deterministic``: the key blocks add into each query block in ascending order, taking turns
  through a counter per (query block, head) (:mod:`epicute.sm90.turns`). Every CTA then walks
  its query blocks from the last one down, each for every query head of the group: all CTAs of
  a group start at the same query block, where key block n waits for n adds, then each follows
  its predecessor one add behind. (Walking up, a causal CTA would idle at its diagonal until the
  first key block's CTA got there.) A CTA waits only for CTAs launched before it, so a grid
  larger than the GPU cannot deadlock.
- consumers (2 warpgroups, 64 keys each). Per step: S^T = K Q^T and dP^T = V dO^T (WGMMA from
  shared memory, keys as M so each warpgroup's rows are its own keys); P^T = exp2(S^T *
  scale * log2 e - LSE * log2 e) with the ragged-key and causal masks; dS^T = P^T (dP^T - D).
  Without a score_mod the masks set hidden scores to -inf first, and half of the exponentials
  run while dP^T's WGMMA does, the rest interleaved with dS^T's arithmetic after its wait.
  dS^T is staged in shared memory (stmatrix) while dV += P^T dO runs (P^T a register A
  operand); once both warpgroups have staged their keys (named barrier ``SCORES_STAGED``),
  each warpgroup issues its half of dQ = dS K over all 128 keys (half of head_dim, or at
  128-query steps half of the rows; at 80-query steps dQ^T = K^T dS^T, half of head_dim), then
  dK += dS^T Q (dS^T from registers), and copies dQ into its staging buffer for the dQ writer
  while dK runs.
- head_dim 256 (``split_dims``, see :mod:`~epicute.attention.backward_plan`): a CTA owns 64 keys;
  each warpgroup computes S^T and dP^T for half of the step's queries and stages P^T and dS^T in
  shared memory (two buffers, alternating by step), and after ``SCORES_STAGED`` issues dK, dV and
  dQ over its half of head_dim, all three reading the staged scores. Q (with LSE) and dO (with D)
  ride in two one-stage rings, each released as soon as its last reader retires: Q once dK has,
  dO once dV has. So the next Q loads while dV and dQ run, and the next dO while dQ runs and is
  staged and the next S^T runs. (Releasing dO only after dQ's staging left its load exposed at
  every step: 27 % of the causal main kernel's time, bench/NOTES.md.)
- epilogue: dK scaled, dV and dK cast and staged in K's and V's buffers once both warpgroups
  are past their last dQ (which reads all of K), TMA-stored (the store clips the ragged
  seqlen_k edge); ``head_split``: each staged in fp32 fragment order across both buffers (they
  are adjacent) and reduce-added, dK then dV.

The preprocess pads LSE and D to whole query blocks (LSE = +inf there and on rows the forward
saw no key: P = 0), so the consumers read them without bounds checks; Q and dO rows past
seqlen_q load as zeros. Sizes, strides and head counts are dynamic; head_dim, tiles, dtype
and causal are compile-time.

Packed variable-length sequences (``varlen``): the grid's third mode is the sequence, whose
rows start at ``cu_seqlens_q/k[b]`` of one ``(total, heads, dim)`` tensor each; a CTA past its
sequence's keys exits. Rows past a sequence's end load the next sequence's, so the consumers
mask queries past seqlen_q as they mask keys (P = 0, so their dQ rows add zeros), each
sequence's LSE and D rows start at a block boundary (``stat_rows_start``), and dK and dV are
stored through ragged views that clip at the sequence's end
(:func:`~epicute.attention.key_blocks.ragged_tensor`).
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, cute, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator

from epicute.attention.backward_plan import (
    KEYS_PER_WARPGROUP,
    MMA_WARPGROUPS,
    BackwardConfig,
    backward_smem_layout,
    dq_split,
    stat_rows_start,
)
from epicute.attention.key_blocks import packed_range, ragged_rows, ragged_tensor
from epicute.attention.mask import Diagonal, crosses_diagonal, first_query_block
from epicute.attention.softmax import exp2_scale
from epicute.epilogue.derivative import value_and_derivative
from epicute.epilogue.fusion import ScoreModFusion
from epicute.sm90.cp_async import bulk_reduce_add_f32
from epicute.sm90.epilogue_emit import DSL_DTYPES, emit_graph, emit_score_mod
from epicute.sm90.fragments import (
    acc_as_operand_a,
    acc_rows_cols,
    pack_16bit,
    row_major_smem_layout,
    select_modes,
    stmatrix_copy,
    transposed_view,
    warpgroup_gemm,
    warpgroup_slice,
)
from epicute.sm90.pipeline import NamedBarriers, RingState, make_tma_load_pipeline, wait_full
from epicute.sm90.tile_scheduler import band_coord
from epicute.sm90.turns import pass_turn, wait_turn
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP


class AttentionBackwardSm90:
    """Compile-time description of one attention backward variant (see module docstring)."""

    def __init__(
        self, cfg: BackwardConfig, dtype: str, causal: bool, score_mod: ScoreModFusion | None = None,
        varlen: bool = False, deterministic: bool = False, operand_grads: bool = False, head_split: bool = False,
    ):  # fmt: skip
        cfg.validate()
        self.varlen = varlen
        self.deterministic = deterministic
        #: dK and dV reduce-added in fp32 (the group's query heads split over several CTAs): module docstring.
        self.head_split = head_split
        self.cfg = cfg
        self.dtype = DSL_DTYPES[dtype]
        self.causal = causal
        self.score_mod = score_mod
        #: The score_mod's per-head vectors whose gradients the kernel sums (``operand_grads``).
        self.grad_operands = ()
        if operand_grads and score_mod is not None:
            self.grad_operands = tuple(name for name, _, _ in score_mod.tensor_operands)
        #: The score_mod's value and its derivatives by the score and the ``grad_operands``, one graph
        #: (shared nodes).
        self.score_graph = (
            None if score_mod is None else value_and_derivative(score_mod.graph, operands=self.grad_operands)
        )
        #: The nodes the operands' derivatives need. Without the score among them (learnable ALiBi slopes, a
        #: per-head bias: functions of the indices), the derivatives are evaluated where dS^T is made, after
        #: dP^T landed; with it, the softmax waits for dP^T and makes dS^T itself (``fused_grads``), as the
        #: score is gone once P^T replaces it.
        self.grad_nodes = frozenset()
        if self.grad_operands:
            outputs = dict(self.score_graph.outputs)
            self.grad_nodes = frozenset(_ancestors(self.score_graph, {outputs[f"d_{n}"] for n in self.grad_operands}))
        self.fused_grads = any(self.score_graph.node(i).op == "acc" for i in self.grad_nodes)
        self.smem = backward_smem_layout(cfg, dtype)
        offsets = self.smem.offsets()
        # head_split stages a key block's fp32 dK (then dV) across K's and V's buffers, one region.
        assert offsets["sV"] == offsets["sK"] + self.smem.buffer("sK").bytes, offsets
        self.num_wg = cfg.num_mma_warpgroups
        #: head_dim 256: the warpgroups split head_dim and the step's queries, not the keys (backward_plan).
        self.split_dims = cfg.split_head_dim
        self.load_warp = 0
        self.dq_warp = 1
        #: dQ's split over the consumer warpgroups: by rows at 128-query steps (a WGMMA's M is 64).
        self.dq_split_rows = cfg.dq_split_rows
        #: dQ^T = K^T dS^T (80-query steps: head_dim is the WGMMA's M, the queries its N).
        self.dq_swap_ab = cfg.dq_swap_ab
        #: The dQ accumulator's (M, N) extent: (queries, head_dim), or transposed.
        self.dq_mn = (cfg.head_dim, cfg.tile_m) if self.dq_swap_ab else (cfg.tile_m, cfg.head_dim)
        #: dQ staged and added in fragment order (:func:`dq_fragment`), or row-major through a swizzled TMA box.
        self.fragment_order = cfg.dq_fragment_order
        #: Floats of one warpgroup's part of a query block's dQ: its staging buffer, one reduce-add.
        self.dq_part = cfg.tile_m * cfg.head_dim // self.num_wg
        #: A warpgroup's part as a row-major tile (rows, columns) of the accumulator, when not in fragment order.
        self.dq_tile = (
            (cfg.tile_m // self.num_wg, cfg.head_dim)
            if self.dq_split_rows
            else (cfg.tile_m, cfg.head_dim // self.num_wg)
        )

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ_bshd: cute.Tensor,
        mK_bshd: cute.Tensor,
        mV_bshd: cute.Tensor,
        mdO_bshd: cute.Tensor,
        mLSE_bhs: cute.Tensor,
        mD_bhs: cute.Tensor,
        mdQ_accum: cute.Tensor,
        mdK_bshd: cute.Tensor,
        mdV_bshd: cute.Tensor,
        softmax_scale: Float32,
        band: cutlass.Int32,
        heads: cutlass.Int32,
        score_tensors: tuple,
        score_scalars: tuple,
        varlen: tuple,
        dq_turns: tuple,
        operand_grads: tuple,
        dkv_accum: tuple,
        stream,
    ):
        """Tensors ``(batch, seqlen, heads, head_dim)``; ``mLSE_bhs`` (LSE in log2 units) and
        ``mD_bhs`` fp32 ``(batch, heads_q, padded seqlen_q)``; ``mdQ_accum`` the fp32 dQ accumulator
        (zeroed; gets ``dS K``, unscaled): in fragment order ``(batch, heads_q, LSE's rows, head_dim)``, each
        query block's parts one after the other, or (``dq_fragment_order`` off) ``(batch, seqlen_q, heads_q,
        head_dim)``; dK and dV in the input dtype; the score_mod's
        per-head vectors and scalars as the forward takes them. ``varlen``: ``()``, or
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_k)`` with every tensor packed (batch extent 1, LSE
        and D padded by a query block past the last row). ``dq_turns``: ``()``, or (deterministic) the
        zeroed int32 turn counters ``(batch, heads_q, LSE's rows / tile_m)``, one per query block.
        ``operand_grads``: per grad operand (``grad_operands``), zeroed fp32 partial sums ``(batch, heads_q,
        key blocks, consumer warps)``: each consumer warp adds its part of every step into its own slot,
        in step order (no two writers share one: the sums are reproducible). ``band``: the grid visits
        its (key/value head, batch) pairs this many at a time, key block by key block
        (:func:`~epicute.sm90.tile_scheduler.band_coord`; :func:`~epicute.attention.backward_plan.grid_band`
        chooses it). ``heads``: the query heads a CTA walks, the group or (``head_split``) fewer: the group's
        ``ceil(group / heads)`` CTAs take ``heads`` each, the last one the rest;
        ``dkv_accum``: ``()``, or (``head_split``) one zeroed fp32 tensor of dK's and dV's accumulators ``(2 batch,
        heads_kv, key rows, head_dim)`` in fragment order (each batch's dK, then its dV), key rows padded to whole
        key blocks (packed: each sequence's from :func:`~epicute.attention.backward_plan.stat_rows_start` of its
        first key on); dK and dV are then left to the postprocess."""
        cfg = self.cfg
        d = cfg.head_dim
        # (seqlen, dim, heads, batch): TMA boxes are (rows, dim).
        mQ, mK, mV, mdO, mdK, mdV = (
            select_modes(t, [1, 3, 2, 0]) for t in (mQ_bshd, mK_bshd, mV_bshd, mdO_bshd, mdK_bshd, mdV_bshd)
        )
        mLSE, mD = select_modes(mLSE_bhs, [2, 1, 0]), select_modes(mD_bhs, [2, 1, 0])  # (seqlen_q, heads, batch)
        if cutlass.const_expr(self.deterministic):
            dq_turns = (select_modes(dq_turns[0], [2, 1, 0]),)  # (query blocks, heads, batch)

        # S^T = K Q^T and dP^T = V dO^T: keys as M, one 64-key atom per warpgroup (split_dims: all
        # 64 keys, each warpgroup half of the step's queries).
        sdp_atoms, sdp_tiler = (self.num_wg, 1, 1), (KEYS_PER_WARPGROUP, cfg.tile_m)
        # dV += P^T dO and dK += dS^T Q: A from registers, B (dO^T, Q^T) read head_dim-major (split_dims:
        # A from shared memory, where both warpgroups staged their queries, each warpgroup half of head_dim).
        dkv_atoms, dkv_tiler, dkv_a = (self.num_wg, 1, 1), (KEYS_PER_WARPGROUP, d), warpgroup.OperandSource.RMEM
        if cutlass.const_expr(self.split_dims):
            sdp_atoms, sdp_tiler = (1, self.num_wg, 1), (KEYS_PER_WARPGROUP, cfg.tile_m // self.num_wg)
            dkv_atoms, dkv_tiler = (1, self.num_wg, 1), (KEYS_PER_WARPGROUP, d // self.num_wg)
            dkv_a = warpgroup.OperandSource.SMEM
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, sdp_atoms, tiler_mn=sdp_tiler,
        )  # fmt: skip
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, dkv_atoms, tiler_mn=dkv_tiler,
            a_source=dkv_a,
        )  # fmt: skip
        tiled_mma_dq = dq_tiled_mma(cfg.tile_m, d, self.dtype)

        sQ_layout = row_major_smem_layout(self.dtype, cfg.tile_m, d, cfg.stages)
        k_major = d if self.dq_split_rows else d // self.num_wg  # dQ's B operand: a warpgroup's columns
        sK_layout = row_major_smem_layout(self.dtype, cfg.tile_n, d, major=k_major)
        sV_layout = row_major_smem_layout(self.dtype, cfg.tile_n, d)
        sdS_layout = row_major_smem_layout(self.dtype, cfg.tile_n, cfg.tile_m, cfg.score_buffers)
        if cutlass.const_expr(self.fragment_order):
            sdQ_layout = cute.make_layout(cfg.tile_m * d)  # the warpgroups' parts, one after the other
            dq_store = (mdQ_accum,)  # reduce-added by address: no tensor map
        else:
            mdQ = select_modes(mdQ_accum, [1, 3, 2, 0])
            sdQ_layout = row_major_smem_layout(Float32, cfg.tile_m, d, major=self.dq_tile[1],
                                               row_bands=self.dq_split_rows)  # fmt: skip
            sdQ_wg_layout = row_major_smem_layout(Float32, *self.dq_tile, row_bands=self.dq_split_rows)
            tma_dq, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ, sdQ_wg_layout, self.dq_tile
            )
            dq_store = (tma_mdQ, tma_dq, sdQ_wg_layout)  # TMA's coordinates, its atom, a warpgroup's part
        # LSE and D, one vector per stage, each 128-byte aligned for its TMA load.
        sStat_layout = cute.make_layout((cfg.tile_m, cfg.stages), stride=(1, cfg.stat_stage_floats))

        g2s, s2g = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        q_box, kv_box = (cfg.tile_m, d), (cfg.tile_n, d)
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), q_box)
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(g2s, mdO, cute.slice_(sQ_layout, (None, None, 0)), q_box)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, kv_box)
        stat_box = cute.make_layout(cfg.tile_m)
        tma_lse, tma_mLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, stat_box, (cfg.tile_m,))
        tma_dsum, tma_mD = cpasync.make_tiled_tma_atom(g2s, mD, stat_box, (cfg.tile_m,))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, kv_box)
        if cutlass.const_expr(self.varlen):
            mdK, mdV = ragged_tensor(mdK), ragged_tensor(mdV)
        tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, kv_box)
        tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout, kv_box)

        for name, layout in (("sQ", sQ_layout), ("sdO", sQ_layout), ("sK", sK_layout), ("sV", sV_layout),
                             ("sdS", sdS_layout), ("sdQ", sdQ_layout)):  # fmt: skip
            assert cute.cosize(layout) == self.smem.buffer(name).count, (name, cute.cosize(layout))
        self.shared_storage = self.smem.struct()
        group = cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2])
        n_blocks = cute.ceil_div(cute.size(mK, mode=[0]), cfg.tile_n)
        batches = cute.size(mK, mode=[3])
        if cutlass.const_expr(self.varlen):
            n_blocks = cute.ceil_div(varlen[2], cfg.tile_n)
            batches = cute.size(varlen[0], mode=[0]) - 1

        self.kernel(
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tma_q, tma_mQ, tma_do, tma_mdO, tma_k, tma_mK, tma_v, tma_mV,
            dq_store, tma_dk, tma_mdK, tma_dv, tma_mdV, tma_lse, tma_mLSE, tma_dsum, tma_mD, sQ_layout,
            sK_layout, sV_layout, sdS_layout, sdQ_layout, sStat_layout, group, softmax_scale, band, heads,
            score_tensors, score_scalars, varlen, dq_turns, operand_grads, dkv_accum,
        ).launch(
            grid=(n_blocks, cute.size(mK, mode=[2]) * cute.ceil_div(group, heads), batches),
            block=[cfg.num_threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        dq_store: tuple,
        tma_dk: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_dv: cute.CopyAtom,
        mdV: cute.Tensor,
        tma_lse: cute.CopyAtom,
        mLSE: cute.Tensor,
        tma_dsum: cute.CopyAtom,
        mD: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.Layout | cute.ComposedLayout,
        sStat_layout: cute.Layout,
        group: cutlass.Int32,
        softmax_scale: Float32,
        band: cutlass.Int32,
        heads: cutlass.Int32,
        score_tensors: tuple,
        score_scalars: tuple,
        varlen: tuple,
        dq_turns: tuple,
        operand_grads: tuple,
        dkv_accum: tuple,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        # Key blocks in bands of `band` (head, batch) pairs: causal key blocks shorten as n_block grows,
        # so this starts the long ones of several heads together and ends the launch on short ones. Every
        # CTA is still launched after its pair's previous key block (deterministic turns rely on it).
        # A pair's CTAs share a key/value head and (head_split) one share of its query heads.
        block_x, block_y, block_z = cute.arch.block_idx()
        n_blocks, shares, batches = cute.arch.grid_dim()
        linear = block_x + n_blocks * (block_y + shares * block_z)
        n_block, pair = band_coord(linear, n_blocks, shares * batches, band)
        share, batch = pair % shares, pair // shares
        splits = cute.ceil_div(group, heads)
        kv_head = share // splits
        first = share % splits * heads  # in the group; its last share is short where heads does not divide it
        cta_heads = (kv_head * group + first, cutlass.min(heads, group - first))  # (first query head, count)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        if warp_idx == self.load_warp:
            dq_atoms = () if self.fragment_order else (dq_store[1],)
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, tma_dk, tma_dv, *dq_atoms):
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        consumer_warps = cfg.num_mma_threads // 32
        kv_bytes = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        # Each step's Q and LSE, dO and D: one ring, or (split_dims) a ring each, so the next step's Q
        # loads once this step's dK has read Q, and its dO once dV has read dO, while dQ still runs.
        rows_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, (None, None, 0)))
        rows_bytes += cfg.tile_m * Float32.width // 8  # a step's LSE or D
        kv_pipe = make_tma_load_pipeline(storage.kv_barriers.data_ptr(), 1, kv_bytes, consumer_warps, (1, 1), 1, True)
        rings = (
            make_tma_load_pipeline(storage.qdo_barriers.data_ptr(), cfg.stages, 2 * rows_bytes, consumer_warps,
                                   (1, 1), 1, True),
        )  # fmt: skip
        if cutlass.const_expr(self.split_dims):
            rings = tuple(
                make_tma_load_pipeline(barriers, cfg.stages, rows_bytes, consumer_warps, (1, 1), 1, True)
                for barriers in (storage.qdo_barriers.data_ptr(), storage.do_barriers.data_ptr())
            )
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sP = storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner) if self.split_dims else None
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(sStat_layout)
        if cutlass.const_expr(self.fragment_order):
            sdQ = storage.sdQ.get_tensor(sdQ_layout)  # warpgroup w stages its part at w * dq_part
            dq_parts = sdQ
        else:
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
            # Consumer warpgroup w's dQ columns: a contiguous part of sdQ (see sdQ_layout's atom).
            sdQ_wg_layout = dq_store[2]
            dq_parts = [
                cute.make_tensor(
                    cute.recast_ptr(storage.sdQ.data_ptr() + w * cute.cosize(sdQ_wg_layout.outer),
                                    sdQ_wg_layout.inner, dtype=Float32),
                    sdQ_wg_layout.outer,
                )
                for w in range(self.num_wg)
            ]  # fmt: skip
        # Barrier initialization is visible to every thread (and the async proxy) before first use.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        seqlen_q, seqlen_k = cute.size(mQ, mode=[0]), cute.size(mK, mode=[0])
        # Where the CTA's sequence lives: (first query row, first key row, batch index of the tensors,
        # first row of LSE and D).
        seq = (0, 0, batch, 0)
        has_keys = True
        if cutlass.const_expr(self.varlen):
            first_q, seqlen_q = packed_range(varlen[0], batch, seqlen_q)
            first_k, seqlen_k = packed_range(varlen[1], batch, seqlen_k)
            seq = (first_q, first_k, 0, stat_rows_start(first_q, batch, cfg.tile_m))
            has_keys = n_block * cfg.tile_n < seqlen_k  # the grid covers the longest sequence's keys
        m_first, m_count = self._query_blocks(n_block, seqlen_q, seqlen_k)
        if has_keys:
            if warpgroup_idx == 0:
                cute.arch.setmaxregister_decrease(cfg.producer_regs)
                if warp_idx == self.load_warp:
                    self._load(
                        (tma_q, mQ, sQ), (tma_do, mdO, sdO), (tma_k, mK, sK), (tma_v, mV, sV), (tma_lse, mLSE, sLSE),
                        (tma_dsum, mD, sD), kv_pipe, rings, (n_block, kv_head, batch), seq, cta_heads, m_first,
                        m_count,
                    )  # fmt: skip
                if warp_idx == self.dq_warp:
                    self._write_dq(dq_store, dq_parts, n_block, seq, cta_heads, m_first, m_count, dq_turns)
            else:
                cute.arch.setmaxregister_increase(cfg.consumer_regs)
                self._consume(
                    tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, sQ, sdO, sK, sV, (sdS, sP), sdQ, sLSE, sD, kv_pipe,
                    rings, (tma_dk, mdK, tma_dv, mdV, dkv_accum), (n_block, kv_head, batch),
                    seq, cta_heads, m_first, m_count, seqlen_q, seqlen_k, softmax_scale,
                    (score_tensors, score_scalars, operand_grads), tidx - THREADS_PER_WARPGROUP,
                )  # fmt: skip

    def _query_blocks(self, n_block, seqlen_q, seqlen_k):
        """(first query block, count) that see key block ``n_block``: all, or (causal, diagonal
        bottom-right aligned) those from the block holding the first query that sees its first key."""
        cfg = self.cfg
        m_end = (seqlen_q + cfg.tile_m - 1) // cfg.tile_m
        m_first = 0
        if cutlass.const_expr(self.causal):
            m_first = first_query_block(Diagonal(seqlen_q, seqlen_k), n_block, cfg.tile_n, cfg.tile_m, m_end)
        return m_first, m_end - m_first

    def _step_block(self, step, cta_heads, m_first, m_count):
        """(query head, query block) of a CTA's step: every query block of its first head (``cta_heads``: the
        first and how many), then of the next; deterministic, the query blocks from the last down, each for
        every head (module docstring)."""
        first, heads = cta_heads
        if cutlass.const_expr(self.deterministic):
            return first + step % heads, m_first + m_count - 1 - step // heads
        return first + step // m_count, m_first + step % m_count

    @cute.jit
    def _load(self, q, do, k, v, lse, dsum, kv_pipe, rings, tile, seq, cta_heads, m_first, m_count):
        """Producer warp 0. ``q`` ... ``dsum``: (TMA atom, its global coordinate tensor, smem) of each
        operand; K and V once, then per step the query block's Q, dO, LSE and D into one ring stage
        (``rings``: one pipeline, or Q and LSE's then dO and D's)."""
        cfg = self.cfg
        d = cfg.head_dim
        one = cute.make_layout(1)
        n_block, kv_head, _ = tile
        kv_state = RingState.producer(1)
        kv_pipe.producer_acquire(kv_state)
        for tma, m_kv, s_kv in (k, v):
            g_kv = cute.local_tile(self._rows(m_kv, kv_head, seq, 1), (cfg.tile_n, d), (n_block, 0))
            kv_smem, kv_gmem = cpasync.tma_partition(
                tma, 0, one, cute.group_modes(s_kv, 0, 2), cute.group_modes(g_kv, 0, 2)
            )
            cute.copy(tma, kv_gmem, kv_smem, tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))

        state = RingState.producer(cfg.stages)
        for step in cutlass.range(cta_heads[1] * m_count, unroll=1):
            head, m_block = self._step_block(step, cta_heads, m_first, m_count)
            ring_loads = (((q, do), (lse, dsum)),)
            if cutlass.const_expr(len(rings) > 1):
                ring_loads = (((q,), (lse,)), ((do,), (dsum,)))
            for pipe, (rows, stats) in zip(rings, ring_loads):
                pipe.producer_acquire(state)
                full = pipe.producer_get_barrier(state)
                for tma, m_rows, s_rows in rows:
                    g_rows = cute.local_tile(self._rows(m_rows, head, seq, 0), (cfg.tile_m, d), (None, 0))
                    rows_smem, rows_gmem = cpasync.tma_partition(
                        tma, 0, one, cute.group_modes(s_rows, 0, 2), cute.group_modes(g_rows, 0, 2)
                    )
                    cute.copy(tma, rows_gmem[None, m_block], rows_smem[None, state.index], tma_bar_ptr=full)
                for tma, m_stat, s_stat in stats:
                    g_stat = cute.local_tile(self._stat_rows(m_stat, head, seq), (cfg.tile_m,), (None,))
                    stat_smem, stat_gmem = cpasync.tma_partition(
                        tma, 0, one, cute.group_modes(s_stat, 0, 1), cute.group_modes(g_stat, 0, 1)
                    )
                    cute.copy(tma, stat_gmem[None, m_block], stat_smem[None, state.index], tma_bar_ptr=full)
            state.advance()

    @cute.jit
    def _write_dq(self, dq_store, dq_parts, n_block, seq, cta_heads, m_first, m_count, dq_turns):
        """Producer warp 1: per step, once consumer warpgroup ``w`` has staged its part of dQ
        (``DQ_FULL``), reduce-add it into the fp32 accumulator: one bulk copy in fragment order (the
        part is contiguous there as in shared memory), else a TMA box; once the previous step's
        reduce-add has read a buffer, hand it back (``DQ_EMPTY``). Deterministic: the step's adds
        wait for the key block's turn at the query block (the key blocks before it have added
        theirs) and pass it on once they are complete."""
        pair = THREADS_PER_WARPGROUP + 32  # a consumer warpgroup and this warp
        lane = cute.arch.lane_idx()
        for step in cutlass.range(cta_heads[1] * m_count, unroll=1):
            head, m_block = self._step_block(step, cta_heads, m_first, m_count)
            for w in cutlass.range_constexpr(self.num_wg):
                # Buffer w was the (num_wg - w)-th last reduce-add committed (deterministic: all complete).
                cute.arch.cp_async_bulk_wait_group(self.num_wg - 1 - w, read=True)
                cute.arch.barrier_arrive(barrier_id=int(NamedBarriers.DQ_EMPTY_WG1) + w, number_of_threads=pair)
            counter = None
            if cutlass.const_expr(self.deterministic):
                counter = cute.domain_offset((m_block,), self._stat_rows(dq_turns[0], head, seq, blocks=True)).iterator
                wait_turn(counter, n_block, lane)
            for w in cutlass.range_constexpr(self.num_wg):
                cute.arch.barrier(barrier_id=int(NamedBarriers.DQ_FULL_WG1) + w, number_of_threads=pair)
                if cutlass.const_expr(self.fragment_order):
                    block = self._dq_block(dq_store[0], head, seq, m_block)
                    with cute.arch.elect_one():
                        bulk_reduce_add_f32(block + w * self.dq_part, dq_parts.iterator + w * self.dq_part,
                                            self.dq_part * 4)  # fmt: skip
                else:
                    tma_mdQ, tma_dq, _ = dq_store
                    part = (m_block * self.num_wg + w, 0) if self.dq_split_rows else (m_block, w)
                    g_dq = cute.local_tile(self._rows(tma_mdQ, head, seq, 0), self.dq_tile, part)
                    dq_smem, dq_gmem = cpasync.tma_partition(
                        tma_dq, 0, cute.make_layout(1), cute.group_modes(dq_parts[w], 0, 2),
                        cute.group_modes(g_dq, 0, 2),
                    )  # fmt: skip
                    cute.copy(tma_dq, dq_smem, dq_gmem)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are complete, not just read
                pass_turn(counter, lane)
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _dq_block(self, mdQ: cute.Tensor, head, seq: tuple, m_block):
        """Where query block ``m_block`` of one head starts in the ``(batch, heads, rows, head_dim)`` dQ
        accumulator, whose rows are LSE's (packed: the sequence's from ``seq[3]``, block-aligned)."""
        return self._block_start(mdQ, head, seq, m_block, self.cfg.tile_m, seq[3] if self.varlen else 0)

    def _block_start(self, m_acc: cute.Tensor, head, seq: tuple, block, rows: int, packed_start, pair: int = -1):
        """Where block ``block`` of ``rows`` rows of one head starts in a ``(batch, heads, rows, head_dim)``
        fp32 accumulator (packed: the sequence's rows from ``packed_start`` on). ``pair``: of a ``(2 batch, ...)``
        one, each batch's two entries side by side (dK's and dV's), the batch's ``pair``-th (a constant offset)."""
        entry = 0 if cutlass.const_expr(self.varlen) else seq[2]
        if cutlass.const_expr(pair >= 0):
            entry = 2 * entry + pair
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((packed_start + block * rows, 0), m_acc[entry, head, None, None]).iterator
        return cute.domain_offset((block * rows, 0), m_acc[entry, head, None, None]).iterator

    def _rows(self, t: cute.Tensor, head, seq: tuple, side: int) -> cute.Tensor:
        """One head's ``(rows, dim)`` of a ``(rows, dim, heads, batch)`` tensor for the CTA's sequence
        (``seq``: its first query row, first key row and tensor batch); ``side`` 0 for query rows, 1 for keys."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((seq[side], 0), t[None, None, head, 0])
        return t[None, None, head, seq[2]]

    def _stat_rows(self, t: cute.Tensor, head, seq: tuple, blocks: bool = False) -> cute.Tensor:
        """One head's query rows of a ``(rows, heads, batch)`` LSE or D tensor for the CTA's sequence
        (packed: from the sequence's block-aligned start, ``seq[3]``); ``blocks``: of a tensor with one
        entry per query block (the dQ turn counters)."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((seq[3] // self.cfg.tile_m if blocks else seq[3],), t[None, head, 0])
        return t[None, head, seq[2]]

    # ------------------------------------------------------------ consumers
    @cute.jit
    def _probabilities(
        self, acc_S, slope, cS, step_args, masked: cutlass.Constexpr[bool], grads=None,
        columns: cutlass.Constexpr = None,
    ):  # fmt: skip
        """S^T becomes P^T = exp2(s' * log2 e - LSE_log2) in place, s' the scaled score or the score_mod
        of it (whose derivative by the score goes to ``slope``: dS is then scaled by it); with
        ``masked``, keys past seqlen_k, (causal) keys past each query's diagonal and (packed sequences, whose
        next rows are another sequence's) queries past seqlen_q get P = 0.
        ``step_args``: (key block, query block, head, batch, the step's LSE by query row (shared memory),
        seqlen_q, seqlen_k, softmax scale, the score_mod's operands loaded for the head).

        ``grads`` (``fused_grads``: operand derivatives that read the score): (dP^T, landed; the step's D
        by query row; the grad operands' parts, an fp32 register vector): each score's dS^T is made here
        too, in place of dP^T, while its derivatives by the operands are at hand: their products with
        P (dP - D) are added to the parts (so neither the slope nor those derivatives are stored).

        ``columns``: (first, end) of this thread's accumulator columns to do, or all."""
        cfg = self.cfg
        n_block, m_block, head, batch, lse, seqlen_q, seqlen_k, softmax_scale, operands = step_args
        S = acc_rows_cols(acc_S)
        G = None
        if cutlass.const_expr(self.score_mod is not None and grads is None):
            G = acc_rows_cols(slope)
        dP = dsum = parts = None
        if cutlass.const_expr(grads is not None):
            dP, dsum, parts = acc_rows_cols(grads[0]), grads[1], grads[2]
        scale_log2 = exp2_scale(softmax_scale, self.score_mod is not None)
        index = {"b": batch.to(Float32), "h": head.to(Float32)}
        # Column by column: one query's LSE is read from shared memory once for its rows.
        first, end = columns if cutlass.const_expr(columns is not None) else (0, cute.size(S, mode=[1]))
        for c in cutlass.range_constexpr(first, end):
            query = m_block * cfg.tile_m + cS[0, c][1]
            if cutlass.const_expr(self.score_mod is not None):
                index["q_idx"] = query.to(Float32)
            lse_c = lse[cS[0, c][1]]
            dsum_c = dsum[cS[0, c][1]] if cutlass.const_expr(grads is not None) else None
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                key = n_block * cfg.tile_n + cS[r, 0][0]
                score = S[r, c]
                slope_rc, by_operand = None, []
                if cutlass.const_expr(self.score_mod is not None):
                    index["kv_idx"] = key.to(Float32)
                    score, slope_rc, by_operand = self._score_mod(score * softmax_scale, index, operands)
                p = cute.math.exp2(score * scale_log2 - lse_c, fastmath=True)
                if cutlass.const_expr(masked):
                    hidden = self._hidden(key, query, seqlen_q, seqlen_k)
                    p = cutlass.select_(hidden, Float32(0.0), p)
                    if cutlass.const_expr(self.score_mod is not None):
                        # A hidden key's slopes may be anything (its score is not a real one): 0 * inf is NaN.
                        slope_rc = cutlass.select_(hidden, Float32(0.0), slope_rc)
                        by_operand = [cutlass.select_(hidden, Float32(0.0), g) for g in by_operand]
                if cutlass.const_expr(grads is not None):
                    upstream = p * (dP[r, c] - dsum_c)  # d loss / d score_mod
                    for i, g in enumerate(by_operand):
                        parts[i] = parts[i] + upstream * g
                    dP[r, c] = upstream * slope_rc
                elif cutlass.const_expr(self.score_mod is not None):
                    G[r, c] = slope_rc
                S[r, c] = p

    @cute.jit
    def _hide_scores(self, acc_S, cS, step_args):
        """S^T = -inf where ``_probabilities`` would hide a score (its masks), so exp2 makes P = 0 there
        (the LSE is finite or, on padded rows, +inf). Only without a score_mod, which must see real scores."""
        cfg = self.cfg
        n_block, m_block, _, _, _, seqlen_q, seqlen_k, _, _ = step_args
        S = acc_rows_cols(acc_S)
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            query = m_block * cfg.tile_m + cS[0, c][1]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                key = n_block * cfg.tile_n + cS[r, 0][0]
                hidden = self._hidden(key, query, seqlen_q, seqlen_k)
                S[r, c] = cutlass.select_(hidden, -Float32.inf, S[r, c])

    def _hidden(self, key, query, seqlen_q, seqlen_k):
        """Whether the score of (``query``, ``key``) is masked: a key past seqlen_k, (packed sequences, whose next
        rows are another sequence's) a query past seqlen_q, (causal, diagonal bottom-right aligned) a key past the
        query's diagonal."""
        hidden = key >= seqlen_k
        if cutlass.const_expr(self.varlen):
            hidden = hidden | (query >= seqlen_q)
        if cutlass.const_expr(self.causal):
            hidden = hidden | Diagonal(seqlen_q, seqlen_k).hides(key, query)
        return hidden

    def _score_mod(self, score, index: dict, operands: dict):
        """The traced score_mod, its derivative by the score and (``fused_grads``) by each grad operand, on
        one scaled score."""
        graph = self.score_graph
        values = emit_score_mod(graph, score, index, operands)
        outputs = dict(graph.outputs)
        by_operand = [values[outputs[f"d_{n}"]] for n in self.grad_operands] if self.fused_grads else []
        return values[outputs["D"]], values[outputs["dD"]], by_operand

    def _operand_slopes(self, index: dict, operands: dict) -> list:
        """The score_mod's derivatives by the grad operands at one (query, key), when they do not read the
        score (not ``fused_grads``): only their own nodes are emitted."""
        graph = self.score_graph
        values = emit_graph(graph, lambda node: (index if node.op == "index" else operands)[node.attr("name")],
                            needed=set(self.grad_nodes))  # fmt: skip
        outputs = dict(graph.outputs)
        return [values[outputs[f"d_{n}"]] for n in self.grad_operands]

    @cute.jit
    def _consume(
        self, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, sQ, sdO, sK, sV, scores, sdQ, sLSE, sD, kv_pipe, rings,
        dkv_out, tile, seq, cta_heads, m_first, m_count, seqlen_q, seqlen_k, softmax_scale, score_args, mma_tidx,
    ):  # fmt: skip
        """Consumer warpgroups: per step S^T, dP^T, P^T, dS^T, then dV, dK and this warpgroup's part of dQ
        (module docstring); at the end, dK and dV stored (``dkv_out``: :meth:`_store_dkv`'s outputs). ``scores``:
        the staged (dS^T, P^T) buffers (P^T only when splitting head_dim, else None)."""
        cfg = self.cfg
        d = cfg.head_dim
        n_block, _, batch = tile
        sdS, sP = scores
        wg = cute.arch.make_warp_uniform(mma_tidx // THREADS_PER_WARPGROUP)
        # Shared-memory operands (partitioned per warpgroup: see warpgroup_slice).
        wg_sdp, wg_dkv, wg_dq = (warpgroup_slice(m, wg) for m in (tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq))
        tSrK = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdOt = tiled_mma_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sdO)))
        tdKrQt = tiled_mma_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sQ)))
        # dQ = dS K: dS from its staged transpose, K^T head_dim-major; swapped, the same views as B and A.
        if cutlass.const_expr(self.dq_swap_ab):
            tdQrdS = tiled_mma_dq.make_fragment_B(wg_dq.partition_B(transposed_view(sdS)))
            tdQrKt = tiled_mma_dq.make_fragment_A(wg_dq.partition_A(transposed_view(sK)))
        else:
            tdQrdS = tiled_mma_dq.make_fragment_A(wg_dq.partition_A(transposed_view(sdS)))
            tdQrKt = tiled_mma_dq.make_fragment_B(wg_dq.partition_B(transposed_view(sK)))
        thr_sdp, thr_dkv, thr_dq = (m.get_slice(mma_tidx) for m in (tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq))
        s_shape = thr_sdp.partition_shape_C((cfg.tile_n, cfg.tile_m))
        if cutlass.const_expr(self.split_dims):
            # P^T and dS^T in bf16/fp16 in the accumulator's order, for stmatrix; dV and dK read them
            # staged (both warpgroups' queries), as shared-memory A operands.
            p_regs = cute.make_rmem_tensor(s_shape, self.dtype)
            ds_regs = cute.make_rmem_tensor(s_shape, self.dtype)
            dS_acc_view = ds_regs
            tdVrP = tiled_mma_dkv.make_fragment_A(wg_dkv.partition_A(sP))
            tdKrdS = tiled_mma_dkv.make_fragment_A(wg_dkv.partition_A(sdS))
        else:
            # P^T and dS^T in bf16/fp16, as the A operands of dV and dK.
            tdVrP = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((cfg.tile_n, cfg.tile_m)))
            tdKrdS = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((cfg.tile_n, cfg.tile_m)))
            # dS^T's registers seen as an accumulator, for stmatrix into sdS (same element order).
            dS_acc_view = cute.make_tensor(tdKrdS.iterator, cute.make_layout(s_shape))
        r2s_ds = stmatrix_copy(tiled_mma_sdp, self.dtype)
        thr_r2s_ds = r2s_ds.get_slice(mma_tidx)
        tdSsdS = thr_r2s_ds.partition_D(sdS)
        tPsP = thr_r2s_ds.partition_D(sP) if cutlass.const_expr(self.split_dims) else None
        # dQ staged in fragment order: 16-byte stores, a warp's over 512 consecutive bytes (no bank conflicts).
        tdQsdQ = dq_fragment(sdQ.iterator, cfg.tile_m, d, mma_tidx) if self.fragment_order else thr_dq.partition_C(sdQ)
        cS = acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((cfg.tile_n, cfg.tile_m))))
        # This warpgroup and the dQ writer warp, around the warpgroup's dQ staging buffer.
        dq_empty = pipeline.NamedBarrier(
            barrier_id=int(NamedBarriers.DQ_EMPTY_WG1) + wg, num_threads=THREADS_PER_WARPGROUP + 32
        )
        dq_full = pipeline.NamedBarrier(
            barrier_id=int(NamedBarriers.DQ_FULL_WG1) + wg, num_threads=THREADS_PER_WARPGROUP + 32
        )
        scores_staged = pipeline.NamedBarrier(
            barrier_id=int(NamedBarriers.SCORES_STAGED), num_threads=cfg.num_mma_threads
        )
        score_tensors, score_scalars, operand_grads = score_args
        scalar_operands = {}
        if cutlass.const_expr(self.score_mod is not None):
            for i, (name, _, _) in enumerate(self.score_mod.scalar_operands):
                scalar_operands[name] = score_scalars[i]

        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((cfg.tile_n, d)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((cfg.tile_n, d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # A block is masked where it holds keys past seqlen_k or (causal) crosses the diagonal.
        ragged_keys = (n_block + 1) * cfg.tile_n > seqlen_k
        wait_full(kv_pipe, RingState.consumer(1))
        read = RingState.consumer(cfg.stages)
        for step in cutlass.range(cta_heads[1] * m_count, unroll=1):
            head, m_block = self._step_block(step, cta_heads, m_first, m_count)
            wait_full(rings[0], read)
            acc_S = cute.make_rmem_tensor(s_shape, Float32)
            acc_dP = cute.make_rmem_tensor(s_shape, Float32)
            slope = grads = None
            if cutlass.const_expr(self.score_mod is not None and not self.fused_grads):
                slope = cute.make_rmem_tensor(s_shape, Float32)
            operands = dict(scalar_operands)
            if cutlass.const_expr(self.score_mod is not None):
                for i, (name, _, _) in enumerate(self.score_mod.tensor_operands):
                    operands[name] = score_tensors[i][head].to(Float32)
            warpgroup_gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, read.index], False, -1)
            if cutlass.const_expr(len(rings) > 1):
                wait_full(rings[1], read)  # dO and D
            warpgroup_gemm(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, read.index], False, 1)
            masked = ragged_keys
            if cutlass.const_expr(self.varlen):  # the block's queries run past the sequence's
                masked = masked | ((m_block + 1) * cfg.tile_m > seqlen_q)
            if cutlass.const_expr(self.causal):
                diagonal = Diagonal(seqlen_q, seqlen_k)
                masked = masked | crosses_diagonal(diagonal, n_block, m_block, cfg.tile_n, cfg.tile_m)
            # The step's LSE and D (padded past seqlen_q: no bounds checks), in the ring stage.
            lse, dsum = sLSE[None, read.index], sD[None, read.index]
            step_args = (n_block, m_block, head, batch, lse, seqlen_q, seqlen_k, softmax_scale, operands)
            if cutlass.const_expr(self.fused_grads):
                # dP^T first: each score's derivatives by the operands meet its P (dP - D) at once.
                warpgroup.wait_group(0)
                grads = (acc_dP, dsum, cute.make_rmem_tensor(len(self.grad_operands), Float32))
                grads[2].fill(0.0)
            if cutlass.const_expr(self.score_mod is None):
                # Hidden scores become -inf (P = 0) in a pass of their own, so no branch splits the
                # exponentials from dS^T's ALU work. The first half of the columns' exponentials sits in a
                # branch that is always taken (the step exists, so the CTA has keys): ptxas cannot hoist
                # dP^T's wait above it, so those run while dP^T's WGMMA does, and the second half
                # interleaves with dS^T after the wait.
                if masked:
                    self._hide_scores(acc_S, cS, step_args)
                half = cute.size(acc_rows_cols(acc_S), mode=[1]) // 2
                if seqlen_k > 0:
                    self._probabilities(acc_S, slope, cS, step_args, False, grads, columns=(0, half))
                self._probabilities(acc_S, slope, cS, step_args, False, grads, columns=(half, 2 * half))
            elif masked:
                self._probabilities(acc_S, slope, cS, step_args, True, grads)
            else:
                self._probabilities(acc_S, slope, cS, step_args, False, grads)
            # The staged scores' buffer: the ring's stage, or (one stage) the step's parity.
            scores_buf = read.index
            if cutlass.const_expr(cfg.stages != cfg.score_buffers):
                scores_buf = step % cfg.score_buffers
            if cutlass.const_expr(self.split_dims):
                pack_16bit(acc_S, p_regs)
                cute.copy(r2s_ds, thr_r2s_ds.retile(p_regs), tPsP[None, None, None, scores_buf])
            else:
                pack_16bit(acc_as_operand_a(acc_S), tdVrP)
            warpgroup.wait_group(0)  # dP^T landed
            P, dP = acc_rows_cols(acc_S), acc_rows_cols(acc_dP)
            if cutlass.const_expr(not self.fused_grads):
                if cutlass.const_expr(self.grad_operands):  # their derivatives read only indices: made here
                    grads = (None, None, cute.make_rmem_tensor(len(self.grad_operands), Float32))
                    grads[2].fill(0.0)
                    index = {"b": batch.to(Float32), "h": head.to(Float32)}
                for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                    dsum_c = dsum[cS[0, c][1]]
                    if cutlass.const_expr(self.grad_operands):
                        index["q_idx"] = (m_block * cfg.tile_m + cS[0, c][1]).to(Float32)
                    for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                        dP[r, c] = P[r, c] * (dP[r, c] - dsum_c)
                        if cutlass.const_expr(self.grad_operands):
                            index["kv_idx"] = (n_block * cfg.tile_n + cS[r, 0][0]).to(Float32)
                            for i, g in enumerate(self._operand_slopes(index, operands)):
                                grads[2][i] = grads[2][i] + dP[r, c] * g
                        if cutlass.const_expr(self.score_mod is not None):
                            dP[r, c] = dP[r, c] * acc_rows_cols(slope)[r, c]
            # The step's parts of the operands' gradients (dS^T made with P^T when fused_grads, else just above).
            for i in cutlass.range_constexpr(len(self.grad_operands)):
                self._add_operand_part(operand_grads[i], grads[2][i], (batch, head, n_block), mma_tidx)
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_mn), Float32)
            if cutlass.const_expr(self.split_dims):
                # Both warpgroups' P^T and dS^T staged, then dK, dV and dQ read them from shared memory: dQ
                # last, so both one-stage rings are released (and their next loads start) before dQ's staging.
                pack_16bit(acc_dP, ds_regs)
                cute.copy(r2s_ds, thr_r2s_ds.retile(dS_acc_view), tdSsdS[None, None, None, scores_buf])
                cute.arch.fence_proxy("async.shared", space="cta")
                scores_staged.arrive_and_wait()
                dO_t, Q_t = tdVrdOt[None, None, None, read.index], tdKrQt[None, None, None, read.index]
                warpgroup_gemm(tiled_mma_dkv, acc_dK, tdKrdS[None, None, None, scores_buf], Q_t, True, -1)
                warpgroup_gemm(tiled_mma_dkv, acc_dV, tdVrP[None, None, None, scores_buf], dO_t, True, -1)
                warpgroup_gemm(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, scores_buf], tdQrKt, False, 2)
                rings[0].consumer_release(read)  # dK has read Q (and S the step's LSE): the next Q may load
                warpgroup.wait_group(1)
                rings[1].consumer_release(read)  # dV has read dO: the next dO loads while dQ runs and is staged
                warpgroup.wait_group(0)
            else:
                pack_16bit(acc_as_operand_a(acc_dP), tdKrdS)
                # dS^T staged for dQ (which reads both warpgroups' keys) while dV's WGMMA runs.
                cute.copy(r2s_ds, thr_r2s_ds.retile(dS_acc_view), tdSsdS[None, None, None, scores_buf])
                warpgroup_gemm(tiled_mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, read.index], True, -1)
                cute.arch.fence_proxy("async.shared", space="cta")
                scores_staged.arrive_and_wait()
                dq_operands = (tdQrdS[None, None, None, scores_buf], tdQrKt)
                if cutlass.const_expr(self.dq_swap_ab):
                    dq_operands = dq_operands[::-1]
                warpgroup_gemm(tiled_mma_dq, acc_dQ, *dq_operands, False, 1)
                warpgroup_gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, read.index], True, 1)
            # dQ landed (dK still runs, or split_dims: all landed): stage it for the dQ writer once its last
            # reduce-add has read the buffer.
            dq_empty.arrive_and_wait()
            cute.autovec_copy(as_vectors(acc_dQ) if self.fragment_order else acc_dQ, tdQsdQ)
            cute.arch.fence_proxy("async.shared", space="cta")
            dq_full.arrive()
            if cutlass.const_expr(not self.split_dims):
                warpgroup.wait_group(0)
                rings[-1].consumer_release(read)  # dV, dK and dQ have read Q, dO and dS
            read.advance()

        self._store_dkv(tiled_mma_dkv, acc_dK, acc_dV, sK, sV, dkv_out, tile, (seq, seqlen_k), softmax_scale, mma_tidx)

    @cute.jit
    def _add_operand_part(self, partials: cute.Tensor, part: Float32, where: tuple, mma_tidx):
        """The warp's sum of ``part`` added into its own slot of ``partials`` ``(batch, heads_q, key blocks,
        consumer warps)`` at ``where`` = (batch, query head, key block): one lane, so the slot's adds come
        in this warp's step order."""
        part = cute.arch.warp_reduction_sum(part)
        if cute.arch.lane_idx() == 0:
            batch, head, n_block = where
            slot = cute.domain_offset((batch, head, n_block, mma_tidx // 32), partials).iterator
            cute.arch.atomic_add(slot, part, sem="relaxed", scope="gpu")

    @cute.jit
    def _store_dkv(self, tiled_mma_dkv, acc_dK, acc_dV, sK, sV, dkv_out, tile, keys, softmax_scale, mma_tidx):
        """dK (scaled) and dV cast, staged in K's and V's buffers and TMA-stored; the store clips
        rows past seqlen_k (``keys``: the sequence and its seqlen_k; packed, through the ragged view).
        ``dkv_out``: (dK's TMA atom and tensor, dV's, the ``dkv_accum`` operand);
        ``head_split``: reduce-added instead (:meth:`_add_dkv`)."""
        cfg = self.cfg
        tma_dk, mdK, tma_dv, mdV, dkv_accum = dkv_out
        acc_dK.store(acc_dK.load() * softmax_scale)
        epilogue = pipeline.NamedBarrier(barrier_id=int(NamedBarriers.EPILOGUE), num_threads=cfg.num_mma_threads)
        # The other warpgroup's last dQ = dS K may still read all of K.
        epilogue.arrive_and_wait()
        if cutlass.const_expr(self.head_split):
            # K's buffer's address taken here, unswizzled, not carried through the loop (a live register there).
            stage = cute.recast_ptr(sK.iterator, dtype=Float32)
            self._add_dkv((acc_dK, acc_dV), dkv_accum[0], stage, tile, keys, epilogue, mma_tidx)
        else:
            self._cast_store_dkv(tiled_mma_dkv, (acc_dK, acc_dV), (sK, sV), (tma_dk, mdK, tma_dv, mdV), tile, keys,
                                 epilogue, mma_tidx)  # fmt: skip

    @cute.jit
    def _add_dkv(self, accs, m_acc, stage, tile, keys, epilogue, mma_tidx):
        """head_split: this CTA's fp32 dK and dV (its query heads' part of the group's sum) reduce-added into
        ``m_acc`` (a batch's dK and dV entries side by side: :func:`~epicute.attention.backward.key_accumulators`),
        one after the other through K's and V's buffers (free now, and adjacent) in fragment order
        (:func:`dq_fragment`, as dQ: 16-byte stores free of bank conflicts, each warpgroup's part one bulk
        reduce-add), which the postprocess un-permutes as it casts."""
        cfg = self.cfg
        n_block, kv_head, batch = tile
        seq, _ = keys
        part = cfg.tile_n * cfg.head_dim // self.num_wg
        staged = dq_fragment(stage, cfg.tile_n, cfg.head_dim, mma_tidx)
        packed_start = stat_rows_start(seq[1], batch, cfg.tile_n) if self.varlen else 0
        for i, acc in enumerate(accs):
            cute.autovec_copy(as_vectors(acc), staged)
            cute.arch.fence_proxy("async.shared", space="cta")
            epilogue.arrive_and_wait()
            if mma_tidx // 32 == 0:
                block = self._block_start(m_acc, kv_head, seq, n_block, cfg.tile_n, packed_start, i)
                with cute.arch.elect_one():
                    for w in cutlass.range_constexpr(self.num_wg):
                        bulk_reduce_add_f32(block + w * part, stage + w * part, part * 4)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            epilogue.arrive_and_wait()  # the staging is read: the next may overwrite it

    @cute.jit
    def _cast_store_dkv(self, tiled_mma_dkv, accs, buffers, outputs, tile, keys, epilogue, mma_tidx):
        """dK and dV cast, staged in K's and V's buffers and TMA-stored (see :meth:`_store_dkv`)."""
        cfg = self.cfg
        n_block, kv_head, batch = tile
        sK, sV = buffers
        tma_dk, mdK, tma_dv, mdV = outputs
        one = cute.make_layout(1)
        r2s = stmatrix_copy(tiled_mma_dkv, self.dtype)
        thr_r2s = r2s.get_slice(mma_tidx)
        for acc, s_buf in zip(accs, buffers):
            converted = cute.make_rmem_tensor(acc.shape, self.dtype)
            pack_16bit(acc, converted)
            cute.copy(r2s, thr_r2s.retile(converted), thr_r2s.partition_D(s_buf))
        cute.arch.fence_proxy("async.shared", space="cta")
        epilogue.arrive_and_wait()
        if mma_tidx // 32 == 0:
            for tma, m_out, s_buf in ((tma_dk, mdK, sK), (tma_dv, mdV, sV)):
                rows = m_out[None, None, kv_head, batch]
                if cutlass.const_expr(self.varlen):
                    (seq, seqlen_k) = keys
                    rows = ragged_rows(m_out, kv_head, seq[1], seqlen_k)
                g_out = cute.local_tile(rows, (cfg.tile_n, cfg.head_dim), (n_block, 0))
                s_part, g_part = cpasync.tma_partition(
                    tma, 0, one, cute.group_modes(s_buf, 0, 2), cute.group_modes(g_out, 0, 2)
                )
                cute.copy(tma, s_part, g_part)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


# ---- dQ's fragment order, shared with the postprocess that un-permutes it

#: fp32 values of dQ a thread moves per access of the fragment-ordered accumulator (16 bytes).
DQ_VECTOR = 4


def dq_tiled_mma(tile_m: int, head_dim: int, dtype) -> cute.TiledMma:
    """dQ = dS K, dS read from its staged transpose (queries contiguous), K^T head_dim-major: each
    consumer warpgroup takes half of head_dim over every query row, or (128-query steps) half of the
    rows over all of head_dim. At 80-query steps (no multiple of a WGMMA's M) it computes dQ^T = K^T dS^T
    instead, each warpgroup half of head_dim (its M) over every query. Its partition of C (``(tile_m,
    head_dim)``, or transposed) says which (row, column) of the query block each register of thread ``t``
    (0-255, the consumers' numbering) holds."""
    atoms, tiler = {
        "transposed": ((MMA_WARPGROUPS, 1, 1), (KEYS_PER_WARPGROUP, tile_m)),
        "rows": ((MMA_WARPGROUPS, 1, 1), (KEYS_PER_WARPGROUP, head_dim)),
        "columns": ((1, MMA_WARPGROUPS, 1), (tile_m, head_dim // MMA_WARPGROUPS)),
    }[dq_split(tile_m)]
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32, atoms, tiler_mn=tiler
    )


def dq_fragment(block, tile_m: int, head_dim: int, thread) -> cute.Tensor:
    """Thread ``thread``'s values of a query block of dQ in fragment order, from ``block`` (the block's first
    fp32, in shared or global memory): ``(DQ_VECTOR, vectors)``, register ``DQ_VECTOR j + i`` (of
    :func:`dq_tiled_mma`'s accumulator) at ``j DQ_VECTOR 128 + DQ_VECTOR (thread % 128) + i`` of the thread's
    warpgroup's part (``tile_m x head_dim / 2`` floats, warpgroup 1's after warpgroup 0's)."""
    part = tile_m * head_dim // MMA_WARPGROUPS
    vectors = part // (DQ_VECTOR * THREADS_PER_WARPGROUP)
    at = thread // THREADS_PER_WARPGROUP * part + thread % THREADS_PER_WARPGROUP * DQ_VECTOR
    return cute.make_tensor(
        block + cute.assume(at, divby=DQ_VECTOR),
        cute.make_layout((DQ_VECTOR, vectors), stride=(1, DQ_VECTOR * THREADS_PER_WARPGROUP)),
    )


def as_vectors(acc: cute.Tensor) -> cute.Tensor:
    """A register fragment's values as ``(DQ_VECTOR, vectors)`` in register order (see :func:`dq_fragment`)."""
    return cute.make_tensor(acc.iterator, cute.make_layout((DQ_VECTOR, cute.size(acc) // DQ_VECTOR)))


def _ancestors(graph, ids: set[int]) -> set[int]:
    """``ids`` and every node they depend on."""
    found = set(ids)
    for node in reversed(graph.nodes):
        if node.id in found:
            found.update(node.args)
    return found


__all__ = ["DQ_VECTOR", "AttentionBackwardSm90", "as_vectors", "dq_fragment", "dq_tiled_mma"]
