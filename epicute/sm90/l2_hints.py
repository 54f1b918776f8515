"""L2 eviction hints for TMA loads.

A TMA load may carry a 64-bit L2 cache policy (PTX ``.L2::cache_hint``). The values are those
``createpolicy.fractional.L2::<priority>.b64 policy, 1.0`` produces (CUTLASS names them
``CacheHintSm90``). A kernel marks the operand that no other CTA will read again *evict-first*: its
lines are then the first an L2 set gives up, so a stream read once (a decode GEMM's weight) recycles
its own lines instead of evicting what other kernels left in L2 -- and, where those lines are dirty,
instead of forcing their write-back to DRAM while it streams. Measure before marking a stream: decode
attention's paged K/V, read once too, lost 3-7 % with it (bench/NOTES.md).
"""

from __future__ import annotations

from cutlass import Int64

EVICT_FIRST = 0x12F0000000000000


def evict_first_if(read_once: bool) -> Int64 | None:
    """The evict-first policy for a TMA load's ``cache_policy`` where ``read_once`` (a trace-time bool), else
    None: the load keeps the default policy and the emitted code is unchanged."""
    return Int64(EVICT_FIRST) if read_once else None
