"""fp8 attention's value pass: V ``(batch, seqlen, heads, head_dim)`` rewritten keys-contiguous in slot order.

The layout is :func:`epicute.attention.fp8.value_layout`'s (its torch form is the reference); this kernel moves
each byte once. A CTA takes :data:`KEYS_PER_CTA` keys of one (sequence, key/value head): each thread loads one
key's ``head_dim`` bytes (16-byte loads, all in flight before the first store) and writes them down its column
of a ``head_dim x KEYS_PER_CTA`` byte tile in shared memory, at the key's slot; a warp's byte stores for one row
fill 32 adjacent bytes (eight banks, one wavefront). Then each thread reads 16 slots of a row (a quarter warp
reads a whole 128-byte row) and stores them with one 16-byte store: a warp writes four rows' 128-byte runs.
Keys past the sequence become zeros up to its 16-slot padding; slots past that are not written.

Packed sequences (``cu_seqlens_k``) start at 16-aligned slots, ``pad16(cu_seqlens_k[b]) + 16 b`` (disjoint:
:func:`epicute.attention.fp8.value_starts`); the slots between them are zeroed by the caller.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Uint8, cute
from cutlass.utils import SmemAllocator

from epicute.attention.fp8 import KEY_GROUP, slot_of_key
from epicute.attention.key_blocks import packed_range

#: Keys per CTA (one per thread), and the bytes a store moves.
KEYS_PER_CTA = 128
VECTOR = 16


class ValueLayoutSm90:
    """The value pass for one head_dim, batched or packed."""

    def __init__(self, head_dim: int, varlen: bool):
        self.head_dim = head_dim
        self.varlen = varlen
        self.chunks = head_dim // VECTOR

    @cute.jit
    def __call__(self, mV: cute.Tensor, mOut: cute.Tensor, varlen: tuple, stream):
        """``mV`` bytes ``(batch, seqlen, heads, head_dim)`` (head_dim contiguous), ``mOut`` bytes ``(batch, heads,
        head_dim, slots)`` (slots contiguous); packed: batch 1 each and ``varlen = (cu_seqlens_k, max_seqlen_k)``."""
        rows = varlen[1] if cutlass.const_expr(self.varlen) else cute.size(mV, mode=[1])
        batches = cute.size(varlen[0], mode=[0]) - 1 if cutlass.const_expr(self.varlen) else cute.size(mV, mode=[0])
        grid = (cute.ceil_div(rows, KEYS_PER_CTA), cute.size(mV, mode=[2]), batches)
        self.kernel(mV, mOut, varlen).launch(grid=grid, block=[KEYS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mOut: cute.Tensor, varlen: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch = cute.arch.block_idx()
        d = self.head_dim
        if cutlass.const_expr(self.varlen):
            first, length = packed_range(varlen[0], batch, cute.size(mV, mode=[1]))
            out_first = (first + KEY_GROUP - 1) // KEY_GROUP * KEY_GROUP + KEY_GROUP * batch
            src, dst = mV[0, None, head, None], mOut[0, head, None, None]
        else:
            first, length, out_first = Int32(0), cute.size(mV, mode=[1]), Int32(0)
            src, dst = mV[batch, None, head, None], mOut[batch, head, None, None]
        padded = (length + KEY_GROUP - 1) // KEY_GROUP * KEY_GROUP
        tile_start = tile * KEYS_PER_CTA
        if tile_start < padded:  # uniform over the CTA
            smem = SmemAllocator()
            sT = smem.allocate_tensor(Uint8, cute.make_layout((d, KEYS_PER_CTA), stride=(KEYS_PER_CTA, 1)), 16)
            key = tile_start + tidx
            slot = tidx // KEY_GROUP * KEY_GROUP + slot_of_key(tidx % KEY_GROUP)
            values = cute.make_rmem_tensor((self.chunks, VECTOR), Uint8)
            if key < length:
                row = src[first + key, None]
                for c in cutlass.range_constexpr(self.chunks):
                    values[c, None].store(cute.local_tile(row, (VECTOR,), (c,)).load())
            else:
                values.fill(0)
            for c in cutlass.range_constexpr(self.chunks):
                for e in cutlass.range_constexpr(VECTOR):
                    sT[c * VECTOR + e, slot] = values[c, e]
            cute.arch.sync_threads()
            groups = KEYS_PER_CTA // VECTOR
            for j in cutlass.range_constexpr(d * groups // KEYS_PER_CTA):
                i = tidx + KEYS_PER_CTA * j
                dim, group = i // groups, i % groups
                if tile_start + group * VECTOR < padded:
                    run = cute.local_tile(sT[dim, None], (VECTOR,), (group,)).load()
                    out = cute.local_tile(dst[dim, None], (VECTOR,), ((out_first + tile_start) // VECTOR + group,))
                    out.store(run)


__all__ = ["KEYS_PER_CTA", "ValueLayoutSm90"]
