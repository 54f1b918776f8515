"""CTAs taking turns through a counter in global memory: sums in a fixed order across CTAs.

Floating-point addition is not associative, so when several CTAs add their parts into one
buffer, the result's bits depend on the order the adds land in. A deterministic kernel gives
each buffer a zeroed int32 counter and each contributing CTA a fixed turn ``0, 1, ...``: a CTA
waits until the counter reads its turn (:func:`wait_turn`, an acquire load), adds its part,
waits for the add to complete, and passes the turn on (:func:`pass_turn`, a release increment).

Deadlock freedom is the kernel's job: a CTA may only wait for CTAs launched before it (a lower
linear block index), which are resident or done, so the earliest waiting CTA can always go on.

Both run on one warp (the lane 0 polls and signals; the warp meets around it) and fence the
async proxy: the parts are TMA reduce-adds, whose writes are not ordered with the counter's
generic-proxy accesses otherwise.
"""

from __future__ import annotations

from cutlass import Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """``*ptr`` (int32, global memory) with acquire semantics at GPU scope."""
    value = llvm.inline_asm(
        T.i32(),
        [ptr.toint(loc=loc, ip=ip).ir_value()],
        "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@cute.jit
def wait_turn(counter: cute.Pointer, turn: Int32, lane: Int32):
    """Return once ``counter`` reads ``turn``: the earlier turns' adds are complete and visible."""
    if lane == 0:
        seen = load_acquire(counter)
        while seen != turn:
            seen = load_acquire(counter)
    cute.arch.sync_warp()
    # Our TMA adds (async proxy) come after the acquire (generic proxy).
    cute.arch.fence_proxy("async.global")


@cute.jit
def pass_turn(counter: cute.Pointer, lane: Int32):
    """Hand the turn to the next CTA; the warp's bulk async operations must have completed
    (``cp_async_bulk_wait_group(0, read=False)`` by every lane that issued one)."""
    cute.arch.fence_proxy("async.global")
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")


__all__ = ["load_acquire", "pass_turn", "wait_turn"]
