"""The causal mask, and the block ranges it cuts, for every attention kernel (forward and backward).

One convention, flash-attn's: the diagonal is aligned bottom-right, so query ``q`` sees key ``j`` when
``j <= q + seqlen_k - seqlen_q`` -- the last query sees every key, and with more queries than keys the first
``seqlen_q - seqlen_k`` see none. The forward asks it from a query tile (how many key blocks to read, where a
row's keys end), the backward from a key tile (which query blocks see it, which of their scores are hidden);
:class:`Diagonal` answers both, so the two kernels cannot disagree on a single score.
"""

from __future__ import annotations

import cutlass


class Diagonal:
    """The causal diagonal of one sequence: ``seqlen_q`` queries over ``seqlen_k`` keys (trace-time: built where
    the lengths are known, inside the kernel)."""

    def __init__(self, seqlen_q, seqlen_k):
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k

    def last_key(self, query):
        """The last key ``query`` sees (below 0: none)."""
        return query + self.seqlen_k - self.seqlen_q

    def key_end(self, query):
        """One past :meth:`last_key`: the exclusive bound of ``query``'s keys."""
        return query + 1 + self.seqlen_k - self.seqlen_q

    def first_query(self, key):
        """The first query that sees ``key`` (every later one does too)."""
        return key - self.seqlen_k + self.seqlen_q

    def hides(self, key, query):
        """Whether ``key`` lies past ``query``'s diagonal."""
        return key > self.last_key(query)


def key_blocks(seqlen_k, tile_n: int):
    """Blocks of ``tile_n`` keys that hold ``seqlen_k`` keys."""
    return (seqlen_k + tile_n - 1) // tile_n


def seen_key_blocks(diagonal: Diagonal, last_query, tile_n: int):
    """Key blocks up to ``last_query``'s diagonal (at least one): those a causal query tile reads, whose last
    query is ``last_query``; bound them by :func:`key_blocks` too."""
    return (cutlass.max(diagonal.key_end(last_query), 1) + tile_n - 1) // tile_n


def first_diagonal_block(diagonal: Diagonal, first_query, tile_n: int):
    """The key block holding the last key of a query tile's first query: the blocks before it hide no score of
    the tile, every block after it hides some, and it is masked too (a query tile reads its blocks last to
    first, so the masked ones are its first)."""
    return cutlass.max(diagonal.last_key(first_query), 0) // tile_n


def first_query_block(diagonal: Diagonal, n_block, tile_n: int, tile_m: int, m_end):
    """The first query block (of ``m_end``) that sees key block ``n_block``: every later one does too."""
    return cutlass.min(cutlass.max(diagonal.first_query(n_block * tile_n), 0) // tile_m, m_end)


def crosses_diagonal(diagonal: Diagonal, n_block, m_block, tile_n: int, tile_m: int):
    """Whether key block ``n_block`` holds a key past query block ``m_block``'s first query's diagonal: the
    pair has hidden scores."""
    return (n_block + 1) * tile_n - 1 > diagonal.last_key(m_block * tile_m)


__all__ = [
    "Diagonal", "crosses_diagonal", "first_diagonal_block", "first_query_block", "key_blocks", "seen_key_blocks",
]  # fmt: skip
