"""Pipeline pieces every warp-specialized SM90 kernel of epicute shares.

- :class:`NamedBarriers`: the hardware barrier ids, allocated in one place so two
  kernel parts can never collide on an id (id 0 is ``__syncthreads``).
- :func:`make_tma_load_pipeline`: a multi-stage TMA load ring (full/empty
  mbarriers) with the consumer arrive count that TMA multicast needs.
- :class:`TmaStoreEpilogue`: the register -> smem -> TMA-store hand-off of seed
  000: fence, named barrier over the epilogue threads, one elected thread issues
  the bulk store and commits/acquires the store group, barrier again.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline


class NamedBarriers(enum.IntEnum):
    """Hardware named-barrier ids (0 is reserved for ``__syncthreads``)."""

    EPILOGUE = 1


def make_tma_load_pipeline(
    barrier_storage,
    num_stages: int,
    tx_bytes: int,
    num_consumer_warps: int,
    cluster_shape_mn: tuple[int, int],
    mcast_ctas: int,
) -> pipeline.PipelineTmaAsync:
    """A producer/consumer ring fed by TMA.

    The producer is one thread (it arms the full barrier with ``tx_bytes``). Every
    consumer warp releases a stage by arriving on the empty barrier of each CTA
    whose TMA multicast wrote into that stage, so the arrive count is
    ``consumer warps x CTAs multicasting into us``.
    """
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_warps * mcast_ctas)
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=num_stages,
        producer_group=producer,
        consumer_group=consumer,
        tx_count=tx_bytes,
        cta_layout_vmnk=cute.make_layout((1, *cluster_shape_mn, 1)),
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

    @cute.jit
    def publish(self, is_store_warp, tma_atom, smem_src, gmem_dst):
        # stmatrix writes through the generic proxy; TMA reads through the async
        # proxy: each writing thread fences before the barrier makes it visible.
        cute.arch.fence_proxy("async.shared", space="cta")
        self.barrier.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_atom, smem_src, gmem_dst)
            self.store_pipeline.producer_commit()
            self.store_pipeline.producer_acquire()
        # Nobody may overwrite a staging buffer until the store warp has seen
        # that the store which read it (num_stages ago) completed.
        self.barrier.arrive_and_wait()

    def sync(self):
        """All epilogue threads meet (e.g. before reusing the A/B ring as staging)."""
        self.barrier.arrive_and_wait()

    @cute.jit
    def drain(self, is_store_warp):
        """Wait for every outstanding store before the CTA exits."""
        if is_store_warp:
            self.store_pipeline.producer_tail()


def stage_of(count, num_stages: int):
    """Ring slot of the ``count``-th use of a ``num_stages``-deep buffer."""
    return count % cutlass.Int32(num_stages)
