"""Pipeline pieces every warp-specialized SM90 kernel of epicute shares.

- :class:`NamedBarriers`: the hardware barrier ids, allocated in one place so two
  kernel parts can never collide on an id (id 0 is ``__syncthreads``).
- :func:`make_tma_load_pipeline`: a multi-stage TMA load ring (full/empty
  mbarriers) with the consumer arrive count that TMA multicast needs;
  :func:`make_local_tma_load_pipeline`: the same for a CTA-private ring (the
  GEMM epilogue's operand tiles).
- :class:`TmaStoreEpilogue`: the register -> smem -> TMA-store hand-off of seed
  000: fence, named barrier over the epilogue threads (``fence_and_sync``), one
  elected thread issues the bulk stores and commits/acquires the store group,
  barrier again (``issue``): the epilogue chain's ``fence_barrier`` and
  ``tma_store`` stages.
- :class:`WarpgroupTurns`: ping-pong turn-taking between consumer warpgroups
  (seed 002), used by attention for its GEMMs and by the ping-pong GEMM for
  its mainloops and its epilogues.
- :func:`release_after`: a ring release pinned after a value is computed, so
  ptxas cannot hoist it (and a WGMMA wait behind it) above that computation.
- :class:`RingState`: the one ring-position type of every ring (compact: one
  counter; tracked: count, index and phase), and :func:`wait_full`, a consumer
  wait whose retry loop stays off the hot path.
- :func:`meet_unaligned`: a named barrier that threads may reach from different
  instructions (roles meeting from their own code).
"""

from __future__ import annotations

import dataclasses
import enum

import cutlass
from cutlass import Int32, cute, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


class NamedBarriers(enum.IntEnum):
    """Hardware named-barrier ids (0 is reserved for ``__syncthreads``)."""

    EPILOGUE = 1
    #: Tensor-core turns of consumer warpgroups 1..3 (see WarpgroupTurns).
    MMA_TURN_WG1 = 2
    MMA_TURN_WG2 = 3
    MMA_TURN_WG3 = 4
    #: Epilogue turns of ping-pong GEMM warpgroups 1..2: their epilogues share
    #: the staging buffers, so they take turns.
    EPILOGUE_TURN_WG1 = 5
    EPILOGUE_TURN_WG2 = 6
    #: Dynamic persistent tiles: the producer warp and the consumers meet at each announced tile,
    #: the producer once it has written the tile to shared memory, the consumers before they read it.
    TILE_ANNOUNCED = 7
    #: Attention backward: both consumer warpgroups have staged their half of a dS tile, which
    #: each then reads whole (dQ = dS K).
    SCORES_STAGED = 8
    #: Attention backward: a consumer warpgroup's private dQ staging buffer has been read by
    #: the previous step's TMA reduce-add (the dQ writer warp arrives, the warpgroup waits).
    DQ_EMPTY_WG1 = 9
    DQ_EMPTY_WG2 = 10
    #: Attention backward: a consumer warpgroup has filled its dQ staging buffer (it arrives,
    #: the dQ writer warp waits, then issues the reduce-add).
    DQ_FULL_WG1 = 11
    DQ_FULL_WG2 = 12


@dsl_user_op
def meet_unaligned(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """``barrier.cta.sync barrier_id, number_of_threads`` without ``.aligned``.

    ``cute.arch.barrier`` emits ``bar.sync``, which is ``.aligned``: the PTX ISA then requires
    every participating thread to execute the *same* barrier instruction. Roles that meet from
    their own code (a producer warp after its write, consumers before their read) break that
    rule, and synccheck reports "Divergent thread(s) in block"; the unaligned form allows it.
    """
    llvm.inline_asm(
        None,
        [Int32(int(barrier_id)).ir_value(loc=loc, ip=ip), Int32(int(number_of_threads)).ir_value(loc=loc, ip=ip)],
        "barrier.cta.sync $0, $1;",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def make_tma_load_pipeline(
    barrier_storage,
    num_stages: int,
    tx_bytes: int,
    num_consumer_warps: int,
    cluster_shape_mn: tuple[int, int],
    mcast_ctas: int,
    defer_sync: bool = False,
    async_copy_threads: int = 0,
) -> pipeline.PipelineTmaAsync:
    """A producer/consumer ring fed by TMA.

    The producer is one thread (it arms the full barrier with ``tx_bytes``), plus
    ``async_copy_threads`` threads that fill part of each stage with cp.async and
    arrive on its full barrier when their copies land (:mod:`epicute.sm90.cp_async`).
    Every consumer warp releases a stage by arriving on the empty barrier of each CTA
    whose TMA multicast wrote into that stage, so the arrive count is
    ``consumer warps x CTAs multicasting into us``. With ``defer_sync`` the caller
    fences and syncs once after creating all its rings.
    """
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + async_copy_threads)
    consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_warps * mcast_ctas)
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=num_stages,
        producer_group=producer,
        consumer_group=consumer,
        tx_count=tx_bytes,
        cta_layout_vmnk=cute.make_layout((1, *cluster_shape_mn, 1)),
        defer_sync=defer_sync,
    )


class TmaStoreEpilogue:
    """Publishes one staged smem subtile to global memory with a TMA store.

    ``PipelineTmaStore`` has no consumer: it is a bulk-async commit group driven
    by a single thread. ``acquire`` waits until at most ``num_stages - 1`` stores
    are in flight, so the buffer we are about to overwrite next has been read.
    """

    def __init__(self, num_stages: int, num_threads: int):
        self.num_stages = num_stages
        self.barrier = pipeline.NamedBarrier(barrier_id=int(NamedBarriers.EPILOGUE), num_threads=num_threads)
        self.store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_threads),
        )

    # No runtime state: the DSL may carry it through loops as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def fence_and_sync(self):
        """The staged registers become visible to the TMA unit: stmatrix and st.shared write through
        the generic proxy, TMA reads through the async proxy, so each writing thread fences, then
        every epilogue thread meets (the chain's ``fence_barrier``)."""
        cute.arch.fence_proxy("async.shared", space="cta")
        self.barrier.arrive_and_wait()

    @cute.jit
    def issue(self, is_store_warp, copies):
        """The chain's ``tma_store``: the store warp issues ``copies`` (``(atom, smem, gmem)`` each) as
        one bulk group, commits it and waits until at most ``num_stages - 1`` groups are in flight,
        so the buffer it stages next has been read; then every epilogue thread meets, as nobody may
        overwrite a staging buffer before that wait."""
        if is_store_warp:
            for atom, src, dst in copies:
                cute.copy(atom, src, dst)
            self.store_pipeline.producer_commit()
            self.store_pipeline.producer_acquire()
        self.barrier.arrive_and_wait()

    def sync(self):
        """All epilogue threads meet (e.g. before reusing the A/B ring as staging)."""
        self.barrier.arrive_and_wait()

    @cute.jit
    def drain(self, is_store_warp):
        """Wait for every outstanding store before the CTA exits."""
        if is_store_warp:
            self.store_pipeline.producer_tail()


class WarpgroupTurns:
    """Consumer warpgroups taking turns at something (the tensor cores, the epilogue's buffers).

    Warpgroup ``wg`` owns named barrier ``first + wg``, counted over two
    warpgroups: it *waits* there before its turn (its 128 threads sync) and,
    after its turn, *passes* to the next warpgroup by arriving (128 threads) at
    that one's barrier. :meth:`grant_first` pre-arms warpgroup 0, which has no
    predecessor for its first turn. A pass nobody waits for (the last tile)
    is harmless: barrier state does not outlive the CTA. With ``enabled=False``
    (a schedule without turns) every call emits nothing.
    """

    def __init__(self, first: NamedBarriers, num_warpgroups: int, enabled: bool = True):
        self.first = int(first)
        self.num_warpgroups = num_warpgroups
        self.num_threads = 2 * 128  # two warpgroups meet at each barrier
        self.enabled = enabled

    # No runtime state: the DSL may carry it through loops as-is.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def wait(self, wg):
        """Block until it is warpgroup ``wg``'s turn."""
        if self.enabled:
            cute.arch.barrier(barrier_id=self.first + wg, number_of_threads=self.num_threads)

    def pass_on(self, wg):
        """End ``wg``'s turn: the next warpgroup may go."""
        if self.enabled:
            nxt = (wg + 1) % self.num_warpgroups
            cute.arch.barrier_arrive(barrier_id=self.first + nxt, number_of_threads=self.num_threads)

    @cute.jit
    def grant_first(self, wg):
        """Called once by every warpgroup: warpgroup 0's first turn needs no predecessor."""
        if cutlass.const_expr(self.enabled):  # noqa: SIM102 - compile-time guard around a dynamic if
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=self.first, number_of_threads=self.num_threads)


def make_local_tma_load_pipeline(barrier_storage, num_stages: int, tx_bytes: int, num_consumer_warps: int):
    """A TMA load ring private to this CTA (no multicast), even inside a cluster.

    The stock constructor decides which lanes release a stage from the cluster
    layout; for a CTA-local ring exactly one lane per consumer warp must arrive
    on our own empty barrier, whatever our rank in the cluster. The caller's
    later barrier-init fence and sync (the mainloop ring's) covers this ring too.
    """
    ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_warps),
        tx_count=tx_bytes,
        defer_sync=True,
    )
    lane = cute.arch.lane_idx()
    return dataclasses.replace(ring, is_signaling_thread=lane == 0)


@cute.jit
def release_after(ring: pipeline.PipelineTmaAsync, state, anchor):
    """``ring.consumer_release(state)``, issued only once ``anchor`` (an fp32 value) is computed.

    ptxas moves an mbarrier arrive up to where its operands are ready and keeps a later
    ``wgmma.wait_group`` below the arrives before it; a release written after a stretch
    of register math can thus drag the wait for an in-flight WGMMA up above that math and
    serialize what was meant to overlap. Predicating the arrive on ``not anchor < 0`` --
    true for any value the caller passes that is never negative, NaN included -- makes it
    depend on ``anchor`` without changing what it does.
    """
    if ring.is_signaling_thread and not anchor < cutlass.Float32(0.0):
        ring.sync_object_empty.arrive(state.index, ring.consumer_mask)


@cute.jit
def release_if(ring: pipeline.PipelineTmaAsync, state, due):
    """``ring.consumer_release(state)`` where the runtime predicate ``due`` holds (a slot given back only once
    what still reads it is done)."""
    if ring.is_signaling_thread and due:
        ring.sync_object_empty.arrive(state.index, ring.consumer_mask)


class RingState:
    """A position in a ring of ``stages`` buffers: the ring state of every epicute kernel.

    The ring methods (``PipelineTmaAsync``'s acquire, wait, release) read only ``index``
    and ``phase``. Two carried forms, chosen per ring by what its loop pays for:

    - *compact* (the default): one ``Int32`` count; ``index = count % stages`` and
      ``phase = (count // stages) % 2`` are derived where used, a mask and a shift for
      power-of-two rings, so a loop carries a single register (attention's K/V rings);
    - *tracked* (``tracked=True``): count, index and phase advanced step by step as
      ``cutlass.pipeline.PipelineState`` does, a compare and two selects per step, no
      division whatever the depth (the GEMM's 3-7 stage mainloop rings).

    Producers start one phase ahead (every buffer starts empty). ``RingState(stages, n)``
    is the ``n``-th use of a ring that no loop carries (a staging buffer's slot).
    """

    def __init__(self, stages: int, count, tracked: pipeline.PipelineState | None = None):
        self.stages = stages
        self.count = count
        self._tracked = tracked

    @staticmethod
    def producer(stages: int, tracked: bool = False) -> RingState:
        if tracked:
            return RingState(stages, None, pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages))
        return RingState(stages, cutlass.Int32(stages))

    @staticmethod
    def consumer(stages: int, tracked: bool = False) -> RingState:
        if tracked:
            return RingState(stages, None, pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages))
        return RingState(stages, cutlass.Int32(0))

    @property
    def index(self):
        if self._tracked is not None:
            return self._tracked.index
        if self.stages & (self.stages - 1) == 0:  # count >= 0: a mask, no signed remainder
            return self.count & (self.stages - 1)
        return self.count % self.stages

    @property
    def phase(self):
        if self._tracked is not None:
            return self._tracked.phase
        if self.stages & (self.stages - 1) == 0:
            return (self.count >> (self.stages.bit_length() - 1)) & 1
        return (self.count // self.stages) % 2

    def clone(self) -> RingState:
        if self._tracked is not None:
            return RingState(self.stages, None, self._tracked.clone())
        return RingState(self.stages, self.count)

    def advance(self, steps=1, **loc) -> None:
        """Move ``steps`` uses on (an int or a runtime ``Int32``); ``loc``: the DSL's location keywords,
        which the stock ring methods pass (``producer_tail`` advances the state it is given)."""
        if self._tracked is not None:
            self._tracked.advance(steps, **loc)
        else:
            self.count = self.count + steps

    def __extract_mlir_values__(self):
        if self._tracked is not None:
            return self._tracked.__extract_mlir_values__()
        return [self.count.ir_value()]

    def __new_from_mlir_values__(self, values):
        if self._tracked is not None:
            return RingState(self.stages, None, self._tracked.__new_from_mlir_values__(values))
        return RingState(self.stages, cutlass.Int32(values[0]))


@cute.jit
def wait_full(ring, state):
    """``ring.consumer_wait(state)``, polling once first: when the stage has already
    landed (the steady state) only that probe runs, and ptxas moves the blocking
    retry loop out of line."""
    ring.consumer_wait(state, ring.consumer_try_wait(state))
