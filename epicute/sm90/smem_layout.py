"""A kernel's shared memory as one object: the storage struct the kernel allocates and the
table ``explain`` prints are both generated from it, so they cannot disagree.

A :class:`SmemLayout` is an ordered list of :class:`SmemBuffer` (a struct field: element
dtype, count, alignment, and what it holds). Offsets follow the C struct rules that
``cute.struct`` applies: each field starts at the next multiple of its alignment (at least
its element size), and the struct's size is rounded up to its strictest alignment. Data
buffers are 1024-aligned: the 128-byte swizzle pattern repeats every 1024 bytes, and TMA
and WGMMA descriptors assume that alignment. A buffer may alias another (``alias_of``): it
takes no bytes of its own and the kernel views the other's bytes with its own layout.

Plain Python: the planner sizes stages from :meth:`SmemLayout.total_bytes` without
importing the DSL; :meth:`SmemLayout.struct` imports it to build the kernel's struct.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from epicute.epilogue.dtypes import DTYPE_BYTES

BUFFER_ALIGN = 1024
MBARRIER_BYTES = 8

#: Element sizes of the field dtypes, by name: the value dtypes and the struct's bookkeeping ones.
ELEMENT_BYTES = {**DTYPE_BYTES, "int64": 8, "int32": 4, "uint8": 1}


def round_up(x: int, align: int) -> int:
    return (x + align - 1) // align * align


@dataclass(frozen=True)
class SmemItem:
    """One row of ``explain``'s shared-memory table."""

    name: str
    bytes: int
    what: str


@dataclass(frozen=True)
class SmemBuffer:
    """One field of a kernel's shared storage."""

    #: the struct field (the kernel reads ``storage.<field>``)
    field: str
    #: explain's row name
    name: str
    #: element dtype (:data:`ELEMENT_BYTES`)
    dtype: str
    #: elements (0: an empty field, which still marks its aligned position)
    count: int
    #: what it holds, for explain
    what: str
    align: int = BUFFER_ALIGN
    #: the field whose bytes this buffer reuses (it takes none of its own)
    alias_of: str = ""

    @property
    def bytes(self) -> int:
        return self.count * ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class SmemLayout:
    buffers: tuple[SmemBuffer, ...]

    def _owned(self) -> list[SmemBuffer]:
        return [b for b in self.buffers if not b.alias_of]

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field (an alias: its target's)."""
        offsets, end = {}, 0
        for b in self._owned():
            offsets[b.field] = round_up(end, max(b.align, ELEMENT_BYTES[b.dtype]))
            end = offsets[b.field] + b.bytes
        for b in self.buffers:
            if b.alias_of:
                offsets[b.field] = offsets[b.alias_of]
        return offsets

    @property
    def alignment(self) -> int:
        return max((max(b.align, ELEMENT_BYTES[b.dtype]) for b in self._owned()), default=1)

    @property
    def total_bytes(self) -> int:
        owned = self._owned()
        if not owned:
            return 0
        last = owned[-1]
        return round_up(self.offsets()[last.field] + last.bytes, self.alignment)

    def buffer(self, field: str) -> SmemBuffer:
        return next(b for b in self.buffers if b.field == field)

    def table(self) -> list[SmemItem]:
        """Rows that sum to :attr:`total_bytes`, in struct order. The padding before a
        1024-aligned buffer counts to the buffer before it when that one is also a data
        buffer (its size rounded up), and is its own row after bookkeeping (barriers, slots)."""
        owned, offsets, total = self._owned(), self.offsets(), self.total_bytes
        ends = {b.field: offsets[n.field] for b, n in itertools.pairwise(owned)}
        rows: list[SmemItem] = []
        for b in self.buffers:
            if b.alias_of:  # its bytes are its target's
                rows.append(SmemItem(b.name, 0, b.what))
                continue
            padding = ends.get(b.field, total) - offsets[b.field] - b.bytes
            if b.align >= BUFFER_ALIGN or not padding:
                rows.append(SmemItem(b.name, b.bytes + padding, b.what))
            else:
                rows += [SmemItem(b.name, b.bytes, b.what),
                         SmemItem("alignment padding", padding, f"buffers start {BUFFER_ALIGN}-aligned")]  # fmt: skip
        return rows

    def struct(self):
        """The kernel's ``cute.struct``: one field per owned buffer, in order, aligned as above."""
        import cutlass
        from cutlass import cute

        from epicute.sm90.epilogue_emit import DSL_DTYPES

        dsl = {**DSL_DTYPES, "int64": cutlass.Int64, "int32": cutlass.Int32, "uint8": cutlass.Uint8}
        fields = {}
        for b in self._owned():
            field = cute.struct.MemRange[dsl[b.dtype], b.count]
            fields[b.field] = cute.struct.Align[field, b.align] if b.align > ELEMENT_BYTES[b.dtype] else field
        storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        assert storage.size_in_bytes() == self.total_bytes, (storage.size_in_bytes(), self.total_bytes)
        return storage


__all__ = ["BUFFER_ALIGN", "ELEMENT_BYTES", "MBARRIER_BYTES", "SmemBuffer", "SmemItem", "SmemLayout", "round_up"]
