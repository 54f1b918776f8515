"""The causal diagonal and the block ranges it cuts (epicute/attention/mask.py), against brute force over every
(query, key) pair: the forward's and the backward's kernels take their block bounds and masks from these."""

from __future__ import annotations

import random

import pytest

from epicute.attention.mask import (
    Diagonal,
    crosses_diagonal,
    first_diagonal_block,
    first_query_block,
    key_blocks,
    seen_key_blocks,
)

TILES = [(64, 64), (128, 128), (128, 176), (192, 128)]


def sees(q: int, j: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Bottom-right aligned causal visibility, written independently of mask.py."""
    return j - q <= seqlen_k - seqlen_q


def lengths(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    fixed = [(1, 1), (1, 300), (300, 1), (129, 129), (17, 1000), (1000, 17), (256, 256)]
    return fixed + [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(12)]


@pytest.mark.parametrize("tile_m,tile_n", TILES)
def test_query_tiles_read_exactly_the_blocks_their_rows_see(tile_m, tile_n):
    for seqlen_q, seqlen_k in lengths(random.randrange(1 << 30)):
        diagonal = Diagonal(seqlen_q, seqlen_k)
        for m_block in range((seqlen_q + tile_m - 1) // tile_m):
            rows = range(m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q))
            seen = [n for n in range(key_blocks(seqlen_k, tile_n))
                    if any(sees(q, j, seqlen_q, seqlen_k) for q in rows
                           for j in range(n * tile_n, min((n + 1) * tile_n, seqlen_k)))]  # fmt: skip
            # The last query of the tile (rows past seqlen_q included, as the kernels count).
            count = min(key_blocks(seqlen_k, tile_n), seen_key_blocks(diagonal, (m_block + 1) * tile_m - 1, tile_n))
            assert count >= 1
            assert seen == list(range(len(seen))), "seen blocks are a prefix"
            assert count >= len(seen)
            if rows[-1] == (m_block + 1) * tile_m - 1:  # a full tile: no extra block
                assert count == max(len(seen), 1), (seqlen_q, seqlen_k, m_block)
            # A block before first_diagonal_block hides no score of the tile, every block after it hides some (the
            # block itself holds the first row's last key: masked, whether or not a later key is in it).
            first = first_diagonal_block(diagonal, m_block * tile_m, tile_n)
            for n in range(count):
                keys = range(n * tile_n, (n + 1) * tile_n)
                hidden = any(not sees(q, j, seqlen_q, seqlen_k) for q in range(m_block * tile_m, (m_block + 1) * tile_m)
                             for j in keys)  # fmt: skip
                assert (not hidden or n >= first) and (hidden or n <= first), (seqlen_q, seqlen_k, m_block, n)
            for q in rows:
                assert all(sees(q, j, seqlen_q, seqlen_k) == (j < diagonal.key_end(q)) for j in range(seqlen_k))


@pytest.mark.parametrize("tile_m,tile_n", TILES)
def test_key_tiles_see_exactly_the_query_blocks_that_see_them(tile_m, tile_n):
    for seqlen_q, seqlen_k in lengths(random.randrange(1 << 30)):
        diagonal = Diagonal(seqlen_q, seqlen_k)
        m_end = (seqlen_q + tile_m - 1) // tile_m
        for n_block in range(key_blocks(seqlen_k, tile_n)):
            keys = range(n_block * tile_n, min((n_block + 1) * tile_n, seqlen_k))
            seeing = [m for m in range(m_end)
                      if any(sees(q, j, seqlen_q, seqlen_k)
                             for q in range(m * tile_m, min((m + 1) * tile_m, seqlen_q)) for j in keys)]  # fmt: skip
            first = first_query_block(diagonal, n_block, tile_n, tile_m, m_end)
            assert seeing == list(range(first, m_end)), (seqlen_q, seqlen_k, n_block)
            for m in seeing:
                queries = range(m * tile_m, (m + 1) * tile_m)
                block = range(n_block * tile_n, (n_block + 1) * tile_n)
                hidden = any(not sees(q, j, seqlen_q, seqlen_k) for q in queries for j in block)
                assert hidden == crosses_diagonal(diagonal, n_block, m, tile_n, tile_m)
                assert all(diagonal.hides(j, q) != sees(q, j, seqlen_q, seqlen_k) for q in queries for j in keys)
