"""Where a work tile's queries and keys are: :class:`QueryRange` and :class:`KeyRange`.

Each object answers, for the producer and the consumers alike, what decode and
variable-length attention add to the forward kernel. :class:`QueryRange`: which
rows of Q, O and LSE sequence ``b`` owns -- mode 0 of its own batch entry, or,
packed (varlen: ``cu_seqlens_q``), rows ``cu_seqlens_q[b]`` up to
``cu_seqlens_q[b + 1]`` of one ``(total_q, ...)`` tensor. :class:`KeyRange`:

- how many keys sequence ``b`` holds: the K tensor's length, a paged sequence's
  capacity (pages x page size), ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` when
  packed, or ``seqused_k[b]`` when given (clamped to the capacity, so a bad entry
  cannot read past the cache);
- which blocks a split reads (split-KV): the tile's blocks are cut into
  ``num_splits`` consecutive ranges, and a split whose range is empty still runs
  one block, fully masked, so it writes O = 0 and LSE = -inf like any tile that
  sees no key;
- where block ``n`` is in global memory: block ``n`` of the sequence (packed: counted
  from its first key), or, paged, sub-block ``n % blocks_per_page`` of page
  ``page_table[b, n // blocks_per_page]`` (a block never straddles pages: the planner
  makes ``tile_n`` divide the page).

Packed sequences end inside the tensor, so TMA cannot clip their edges: loads past a
sequence's end read the next sequence's rows, which the masks (keys) or the stores
(queries) leave out, and O's store goes through a *ragged* view whose extra mode clips
each tile at its sequence's end (:meth:`QueryRange.store_view`).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute
from cutlass.cute.nvgpu import cpasync


def packed_range(cu_seqlens: cute.Tensor, batch, total) -> tuple:
    """``(first, length)`` of packed sequence ``batch``: ``cu_seqlens[batch]`` up to ``cu_seqlens[batch + 1]``,
    clamped into ``[0, total]`` (the values are not checked on the host without a sync: a malformed entry
    gives a wrong sequence, never an access outside the tensors)."""
    first = cutlass.min(cutlass.max(cu_seqlens[batch], 0), total)
    return first, cutlass.min(cutlass.max(cu_seqlens[batch + 1], first), total) - first


def ragged_tensor(t: cute.Tensor) -> cute.Tensor:
    """``t`` ``(R, dim, heads, 1)`` as the ragged ``(R, dim, heads, R + 1)`` view stores clip through
    (host side, before the TMA atom is built): its base moved back by ``R`` rows and its last mode
    stepping one row, so coordinate ``(R - rows + i, .., end)`` addresses row ``end - rows + i``, and
    rows ``i >= rows`` (coordinates ``>= R``) are dropped by TMA. Only stores may use it: a TMA load
    needs its base inside mapped memory."""
    total, row_stride = cute.size(t, mode=[0]), t.stride[0]
    base = cute.domain_offset((-total, 0, 0, 0), t).iterator
    shape = (total, cute.size(t, mode=[1]), cute.size(t, mode=[2]), total + 1)
    stride = (row_stride, t.stride[1], t.stride[2], row_stride)
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


def ragged_rows(t: cute.Tensor, head, first, rows) -> cute.Tensor:
    """Rows ``first`` to ``first + rows`` of one head of a :func:`ragged_tensor` view, as a ``(rows, dim)``
    tensor whose TMA stores stop at its end."""
    return cute.domain_offset((cute.size(t, mode=[0]) - rows, 0), t[None, None, head, first + rows])


class QueryRange:
    """The query-side extents of one launch (see the module docstring). ``varlen``: ``()``, or
    ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)`` with Q, O and LSE packed along their rows
    (batch mode of extent 1)."""

    def __init__(self, mQ: cute.Tensor, varlen: tuple):
        self.cu_seqlens = varlen[0] if varlen else None
        self.total = cute.size(mQ, mode=[0])
        #: rows per (batch, head) that tiles are cut from: the tensor's, or the longest sequence's
        self.rows = varlen[2] if varlen else cute.size(mQ, mode=[0])
        #: sequences
        self.batches = cute.size(varlen[0], mode=[0]) - 1 if varlen else cute.size(mQ, mode=[3])

    # Read-only inside loops: the DSL may carry it as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def bounds(self, batch) -> tuple:
        """``(first, rows, tensor_batch)`` of sequence ``batch``: its first row in the tensors, its
        rows, and its index in their batch mode."""
        if cutlass.const_expr(self.cu_seqlens is not None):
            return (*packed_range(self.cu_seqlens, batch, self.total), 0)
        return 0, self.rows, batch

    def load_view(self, m_seq: cute.Tensor, bounds: tuple) -> cute.Tensor:
        """The sequence's rows of a ``(rows, dim, heads, batch)`` tensor, one head's: ``m_seq`` is
        already sliced to ``(rows, dim)`` of the head and tensor batch; packed, offset to the first row."""
        if cutlass.const_expr(self.cu_seqlens is not None):
            return cute.domain_offset((bounds[0], 0), m_seq)
        return m_seq

    def store_tensor(self, t: cute.Tensor) -> cute.Tensor:
        """The tensor O's (and aux outputs') TMA atom is built on: :func:`ragged_tensor` when packed."""
        return ragged_tensor(t) if cutlass.const_expr(self.cu_seqlens is not None) else t

    def store_view(self, t: cute.Tensor, head, batch, bounds: tuple) -> cute.Tensor:
        """One head's ``(rows, dim)`` of the store tensor (:func:`ragged_rows` when packed)."""
        if cutlass.const_expr(self.cu_seqlens is not None):
            return ragged_rows(t, head, bounds[0], bounds[1])
        return t[None, None, head, batch]


class KeyRange:
    """The key-side extents of one launch (see the module docstring); ``kernel`` is the
    :class:`~epicute.attention.kernel_sm90.AttentionSm90` it serves."""

    def __init__(self, kernel, capacity: Int32, num_splits: Int32, paged: tuple, seqused: tuple, varlen: tuple = ()):
        self.kernel = kernel
        self.capacity = capacity
        self.num_splits = num_splits
        self.page_table = paged[0] if paged else None
        self.seqused = seqused[0] if seqused else None
        self.cu_seqlens = varlen[1] if varlen else None

    # Read-only inside loops: the DSL may carry it as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def seqlen(self, batch):
        """Keys sequence ``batch`` attends over."""
        if cutlass.const_expr(self.seqused is not None):
            return cutlass.min(cutlass.max(self.seqused[batch], 0), self.capacity)
        if cutlass.const_expr(self.cu_seqlens is not None):
            return packed_range(self.cu_seqlens, batch, self.capacity)[1]
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

    def partition(self, tma, s_ring, m_kv, kv_head, batch, group: int = 0):
        """TMA partitions of a tile's K or V: ``(ring stages, the sequence's blocks)``; paged, the
        blocks are found one at a time (:meth:`block`), and the second is None. ``group`` (fp8 V's
        16-key groups): packed sequence ``b`` starts at its offset rounded up to a group, plus ``group * b``
        (:func:`epicute.attention.fp8.value_starts`)."""
        if cutlass.const_expr(self.page_table is not None):
            return self._partition(tma, s_ring, m_kv[None, None, kv_head, 0])[0], None
        if cutlass.const_expr(self.cu_seqlens is not None):
            first = packed_range(self.cu_seqlens, batch, self.capacity)[0]
            if cutlass.const_expr(group > 0):
                first = (first + group - 1) // group * group + group * batch
            return self._partition(tma, s_ring, cute.domain_offset((first, 0), m_kv[None, None, kv_head, 0]))
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


__all__ = ["KeyRange", "QueryRange", "packed_range", "ragged_rows", "ragged_tensor"]
