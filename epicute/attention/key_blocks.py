"""Which key blocks a work tile reads, and where they live: :class:`KeyRange`.

One object answers, for the producer and the consumers alike, the three questions
that decode attention adds to the forward kernel:

- how many keys sequence ``b`` holds: the K tensor's length, a paged sequence's
  capacity (pages x page size), or ``seqused_k[b]`` when given (clamped to the
  capacity, so a bad entry cannot read past the cache);
- which blocks a split reads (split-KV): the tile's blocks are cut into
  ``num_splits`` consecutive ranges, and a split whose range is empty still runs
  one block, fully masked, so it writes O = 0 and LSE = -inf like any tile that
  sees no key;
- where block ``n`` is in global memory: block ``n`` of the sequence, or, paged,
  sub-block ``n % blocks_per_page`` of page ``page_table[b, n // blocks_per_page]``
  (a block never straddles pages: the planner makes ``tile_n`` divide the page).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute
from cutlass.cute.nvgpu import cpasync


class KeyRange:
    """The key-side extents of one launch (see the module docstring); ``kernel`` is the
    :class:`~epicute.attention.kernel_sm90.AttentionSm90` it serves."""

    def __init__(self, kernel, capacity: Int32, num_splits: Int32, paged: tuple, seqused: tuple):
        self.kernel = kernel
        self.capacity = capacity
        self.num_splits = num_splits
        self.page_table = paged[0] if paged else None
        self.seqused = seqused[0] if seqused else None

    # Read-only inside loops: the DSL may carry it as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def seqlen(self, batch):
        """Keys sequence ``batch`` attends over."""
        if cutlass.const_expr(self.seqused is not None):
            return cutlass.min(cutlass.max(self.seqused[batch], 0), self.capacity)
        return self.capacity

    def blocks(self, m_block, split, seqlen_q, seqlen_k):
        """``(end, count, key_limit)``: the tile reads blocks ``end - 1`` down to ``end - count``
        (count >= 1) and masks keys at ``key_limit`` and past (its split's end, or seqlen_k)."""
        tile_n = self.kernel.cfg.tile_n
        total = self.kernel._n_blocks(m_block, seqlen_q, seqlen_k)
        if cutlass.const_expr(not self.kernel.cfg.split_kv):
            return total, total, seqlen_k
        per_split = (total + self.num_splits - 1) // self.num_splits
        lo = split * per_split
        hi = cutlass.min(lo + per_split, total)
        count = cutlass.max(hi - lo, 1)
        # An empty split (hi <= lo) masks every key of its one block: key_limit <= its first key.
        return lo + count, count, cutlass.min(seqlen_k, cutlass.max(hi, 0) * tile_n)

    def partition(self, tma, s_ring, m_kv, kv_head, batch):
        """TMA partitions of a tile's K or V: ``(ring stages, the sequence's blocks)``; paged, the
        blocks are found one at a time (:meth:`block`), and the second is None."""
        if cutlass.const_expr(self.page_table is not None):
            return self._partition(tma, s_ring, m_kv[None, None, kv_head, 0])[0], None
        return self._partition(tma, s_ring, m_kv[None, None, kv_head, batch])

    @cute.jit
    def block(self, tma, s_ring, m_kv, blocks, kv_head, batch, n):
        """Block ``n`` of ``blocks`` (:meth:`partition`), or, paged, of the page holding it."""
        if cutlass.const_expr(self.page_table is not None):
            per_page = self.kernel.page_size // self.kernel.cfg.tile_n
            slot = cutlass.min(n // per_page, cute.size(self.page_table, mode=[1]) - 1)
            page = self._partition(tma, s_ring, m_kv[None, None, kv_head, self.page_table[batch, slot]])[1]
            return page[None, n % per_page]
        return blocks[None, n]

    def _partition(self, tma, s_ring, m_seq):
        cfg = self.kernel.cfg
        g = cute.local_tile(m_seq, (cfg.tile_n, cfg.head_dim), (None, 0))
        return cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(s_ring, 0, 2), cute.group_modes(g, 0, 2)
        )


__all__ = ["KeyRange"]
