"""TMA loads of a tensor whose extent along one dimension ends per work unit (a group's K rows): the rows past a
unit's end lie outside the descriptor's bounds, so TMA zero-fills them, with the descriptor's base at the tensor
itself (a view whose base lies before the tensor, as ragged stores use, is unsafe for loads: bench/NOTES.md).

:func:`ragged_load_view` gives dimension ``dim`` (stride ``s`` elements) the extent :data:`ROWS` and appends two
modes of extent :data:`EXTENT` with strides ``WRAP - s`` and ``s`` (``WRAP = 2^64 / ROWS``). :func:`ragged_rows`
addresses a unit's rows ``[first, first + length)`` as coordinates ``ROWS - length + i`` of ``dim`` with the two
extra modes at ``(ROWS, first + length)``:

    (ROWS - length + i) s + ROWS (WRAP - s) + (first + length) s = (first + i) s + ROWS WRAP = (first + i) s

modulo 2^64, the width of TMA's address arithmetic; and rows ``i >= length`` have coordinates ``>= ROWS``, out of
bounds. Every coordinate stays below 2^31, every stride below 2^40 bytes for tensors of any real size. The
technique is Triton's ``ragged_tma`` (quack's varlen-K GEMM loads its operands the same way).
"""

from __future__ import annotations

from cutlass import cute

#: The ragged dimension's extent in the view. A unit's rows are coordinates ``ROWS - length`` on, so a unit may be
#: up to ROWS rows long; a tile reaching past ``ROWS`` reads zeros.
ROWS = 2**30
#: ``ROWS * WRAP = 2^64``: the first extra mode's step wraps the address around to where it started.
WRAP = 2**64 // ROWS
#: The extra modes' extents (a TMA coordinate is a signed 32-bit value).
EXTENT = 2**31 - 1


def ragged_load_view(t: cute.Tensor, dim: int) -> cute.Tensor:
    """``t`` (rank <= 3) as the rank + 2 view its TMA loads are built over (host side, before the atom)."""
    rank = cute.rank(t)
    assert rank <= 3, "TMA takes at most 5 modes: a ragged load view adds two"
    shape, stride = tuple(t.shape), tuple(t.stride)
    step = stride[dim]
    shape = (*shape[:dim], ROWS, *shape[dim + 1 :], EXTENT, EXTENT)
    stride = (*stride, WRAP - step, step)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def ragged_rows(t: cute.Tensor, dim: int, first, length) -> cute.Tensor:
    """Rows ``[first, first + length)`` along ``dim`` of a :func:`ragged_load_view`'s TMA coordinate tensor, as
    a tensor of the original rank whose coordinates past ``length`` rows lie out of bounds."""
    rank = cute.rank(t) - 2
    unit = t[(*(None,) * rank, ROWS, first + length)]
    return cute.domain_offset((*(0,) * dim, ROWS - length, *(0,) * (rank - dim - 1)), unit)


__all__ = ["EXTENT", "ROWS", "WRAP", "ragged_load_view", "ragged_rows"]
