"""Per-thread asynchronous copies (``cp.async``) into a TMA-fed ring.

TMA moves boxes of a tensor; rows picked through an index (a mixture-of-experts layer's routed tokens)
are not a box, so a gathering producer issues one 16-byte ``cp.async`` per chunk instead and signals
the ring's full barrier with ``cp.async.mbarrier.arrive.noinc`` once its copies have landed. The
barrier then counts those threads' arrivals besides the TMA producer's (see
:func:`epicute.sm90.pipeline.make_tma_load_pipeline`'s ``async_copy_threads``).

A few aligned bytes per stage (a k-tile's block scale) need no tensor map either: one thread issues a
bulk copy (:func:`bulk_copy`, the TMA unit's ``cp.async.bulk``) whose bytes the stage's barrier expects.
The same unit adds contiguous shared memory into global memory (:func:`bulk_reduce_add_f32`): a staged
block that is contiguous in both needs neither a tensor map nor a swizzle.

Shared-memory addresses are computed here, not by a CuTe copy atom: a chunk's destination is a
16-byte slot of a 128-byte-swizzled K-major stage (:func:`swizzled_chunk`), the layout TMA and WGMMA
use, so the stage reads the same whichever producer filled it.
"""

from __future__ import annotations

from cutlass import AddressSpace, Int32, cute
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import dsl_user_op

#: Bytes one cp.async moves (its widest form, the one that may bypass L1).
CHUNK_BYTES = 16
#: A 128-byte swizzle line: one K-major row of a stage whose k-tile is 128 bytes.
LINE_BYTES = 128


@dsl_user_op
def copy_chunk_zero_fill(dst, src, src_bytes, *, loc=None, ip=None) -> None:
    """``cp.async.cg`` of 16 bytes from global ``src`` to shared ``dst`` (CuTe pointers), of which only the
    first ``src_bytes`` (0 or 16) are read: the rest of the chunk is written as zeros, so a chunk past
    the end of a row needs no separate store (and ``src`` must still be a valid address)."""
    nvvm.cp_async_shared_global(
        dst.to_llvm_ptr(loc=loc, ip=ip),
        src.to_llvm_ptr(loc=loc, ip=ip),
        CHUNK_BYTES,
        nvvm.LoadCacheModifierKind.CG,
        cp_size=Int32(src_bytes).ir_value(loc=loc, ip=ip),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def copy_word(dst, src, *, loc=None, ip=None) -> None:
    """``cp.async.ca`` of one 4-byte word from global ``src`` to shared ``dst`` (CuTe pointers): scales and
    other small per-stage values, whose addresses need not be 16-byte aligned."""
    nvvm.cp_async_shared_global(
        dst.to_llvm_ptr(loc=loc, ip=ip),
        src.to_llvm_ptr(loc=loc, ip=ip),
        4,
        nvvm.LoadCacheModifierKind.CA,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def bulk_copy(dst, src, size: int, barrier, *, loc=None, ip=None) -> None:
    """One thread's bulk copy of ``size`` bytes (a multiple of 16) from global ``src`` to shared ``dst`` (CuTe
    pointers, both 16-byte aligned) whose bytes complete on the mbarrier at ``barrier``, which must expect them:
    ``cp.async.bulk`` moves contiguous bytes with no tensor map, so no bounds either (``src`` must be readable)."""
    # The instruction's destination is a shared::cluster address; this CTA's own window maps into it.
    cluster_dst = llvm.addrspacecast(
        llvm.PointerType.get(AddressSpace.dsmem), dst.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip
    )
    nvvm.cp_async_bulk_shared_cluster_global(
        cluster_dst,
        src.to_llvm_ptr(loc=loc, ip=ip),
        barrier.to_llvm_ptr(loc=loc, ip=ip),
        Int32(size).ir_value(loc=loc, ip=ip),
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def bulk_reduce_add_f32(dst, src, size: int, *, loc=None, ip=None) -> None:
    """One thread's ``cp.reduce.async.bulk`` add of ``size`` bytes (a multiple of 16) of fp32 from shared ``src``
    into global ``dst`` (CuTe pointers, both 16-byte aligned), element by element and atomic per element, in the
    thread's bulk async-group (commit it; ``cp_async_bulk_wait_group(read=True)`` frees ``src``)."""
    cute.arch.inline_ptx(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{$r0}], [{$r1}], {$r2};",
        read_only_args=[dst, src, Int32(size)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def arrive_when_copied(barrier, *, loc=None, ip=None) -> None:
    """Arrive on the mbarrier at ``barrier`` once every cp.async this thread issued so far has landed, without
    raising its expected count (``.noinc``: the barrier was initialized to count this thread)."""
    nvvm.cp_async_mbarrier_arrive(barrier.to_llvm_ptr(loc=loc, ip=ip), noinc=True, loc=loc, ip=ip)


def swizzled_chunk(row, chunk):
    """Byte offset of 16-byte ``chunk`` of ``row`` inside a K-major stage of 128-byte rows under the 128-byte
    swizzle (``Swizzle<3, 4, 3>`` on byte addresses, 1024-byte aligned): row ``r`` is the line at ``128 r``
    and its chunks are permuted by XOR with ``r % 8``."""
    return row * LINE_BYTES + ((chunk ^ (row % 8)) * CHUNK_BYTES)


__all__ = [
    "CHUNK_BYTES",
    "LINE_BYTES",
    "arrive_when_copied",
    "bulk_copy",
    "bulk_reduce_add_f32",
    "copy_chunk_zero_fill",
    "copy_word",
    "swizzled_chunk",
]
