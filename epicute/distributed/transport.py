"""How the ranks of a process group reach each other's rows, for :mod:`epicute.distributed.collective`.

Two transports with one interface, chosen by the group and the tensors' device:

- :class:`Symmetric` (CUDA tensors, an NCCL group): torch's symmetric memory (``torch.distributed.
  _symmetric_memory``), one buffer per group mapped into every rank's address space. A peer's shard is pulled by the
  copy engine on a side stream (no SM spent on it) while the GEMMs run; a neighbour's running sum is read in place,
  from its buffer, by the GEMM that adds to it. Cross-rank order comes from the buffer's barriers and signals,
  stream-ordered kernels of torch's.
- :class:`Collective` (any other group, e.g. ``gloo`` on CPU): the same schedule over plain collectives and
  point-to-point sends, with no overlap. It runs the host logic where symmetric memory does not exist (CI's CPU
  gloo world).

Both are stream-ordered: what they yield or return is ready for work issued after them on the stream current then.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Signal channels of the symmetric buffer: 0 opens a call (a barrier: peers are done with the buffer's previous
#: contents), 1 says every rank's shard is staged (a barrier), 2 passes a ring's running sum to the next rank.
_OPEN, _STAGED, _RING = 0, 1, 2


class Collective:
    """The schedule's data movement over a process group's own collectives (no overlap): the host logic's
    reference, and the path for groups without symmetric memory."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()

    def gather(self, shards: list[torch.Tensor], gathered: list[torch.Tensor]) -> Iterator[int]:
        """Fill each of ``gathered`` (``world`` row blocks, rank order) with every rank's shard of the same place in
        ``shards`` (a GEMM's rows and their scales), yielding each source rank once its blocks may be read, the own
        rank first, then the next ranks in ring order. The caller issues each block's work on the stream current
        when it is yielded."""
        for shard, out in zip(shards, gathered, strict=True):
            _all_gather(out, shard.contiguous(), self.group)
        yield from ring(self.rank, self.world)

    def reduce_ring(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> ReduceRing:
        return _SentRing(self, shape, dtype, device)


class ReduceRing:
    """A ring reduction's data movement, one call's worth: at step ``t`` this rank writes its running sum into
    :meth:`out` and passes it to the next rank (:meth:`send`); it reads the previous rank's running sum of step
    ``t - 1`` from :meth:`received`."""

    def out(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def send(self, step: int) -> None:
        raise NotImplementedError

    def received(self, step: int) -> torch.Tensor:
        raise NotImplementedError


class _SentRing(ReduceRing):
    """Running sums in this rank's own tensors, sent to the next rank point to point."""

    def __init__(self, transport: Collective, shape, dtype, device) -> None:
        self.group, self.rank, self.world = transport.group, transport.rank, transport.world
        self.slots = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.world - 1)]
        self.pending: list = []

    def out(self, step: int) -> torch.Tensor:
        return self.slots[step]

    def send(self, step: int) -> None:
        right = torch.distributed.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.pending.append(torch.distributed.isend(self.slots[step], right, group=self.group))

    def received(self, step: int) -> torch.Tensor:
        left = torch.distributed.get_global_rank(self.group, (self.rank - 1) % self.world)
        incoming = torch.empty_like(self.slots[step])
        torch.distributed.recv(incoming, left, group=self.group)
        if step == self.world - 2:  # this call's last receive: its sends complete (the next rank's last takes one)
            for work in self.pending:
                work.wait()
        return incoming


class Symmetric:
    """The schedule's data movement through torch's symmetric memory (module docstring)."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.device = device

    def gather(self, shards: list[torch.Tensor], gathered: list[torch.Tensor]) -> Iterator[int]:
        """:meth:`Collective.gather`, overlapped. The shards are staged in the symmetric buffer and the ranks meet
        at two barriers (on the caller's stream: there a barrier's kernel runs before the GEMMs, which fill every SM
        and would hold it back); then the own blocks are yielded at once while a side stream pulls each peer's
        blocks with the copy engine. Each peer's blocks are yielded under a compute stream that waits for them
        only, two streams in turn, so that one GEMM's last partial wave overlaps the next one's start."""
        offsets, end = [], 0
        for shard in shards:  # each shard at a 256-byte boundary of the buffer
            offsets.append(end)
            end += -(-shard.numel() * shard.element_size() // 256) * 256
        handle = _buffer(self.group, self.device, end)

        def staged(rank: int, i: int) -> torch.Tensor:
            shard = shards[i]
            return handle.get_buffer(rank, tuple(shard.shape), shard.dtype, offsets[i] // shard.element_size())

        current, side = torch.cuda.current_stream(self.device), _stream(self.device, "copy")
        computes = (current, _stream(self.device, "compute"))
        handle.barrier(channel=_OPEN)
        for i, shard in enumerate(shards):
            staged(self.rank, i).copy_(shard)
        handle.barrier(channel=_STAGED)
        side.wait_stream(current)
        computes[1].wait_stream(current)
        arrived = {}
        with torch.cuda.stream(side):
            for src in [*ring(self.rank, self.world)[1:], self.rank]:
                for i, (shard, out) in enumerate(zip(shards, gathered, strict=True)):
                    rows = shard.shape[0]
                    out[src * rows : (src + 1) * rows].copy_(shard if src == self.rank else staged(src, i))
                arrived[src] = torch.cuda.Event()
                arrived[src].record(side)
        try:
            yield self.rank
            for turn, src in enumerate(ring(self.rank, self.world)[1:], start=1):
                stream = computes[turn % 2]
                stream.wait_event(arrived[src])
                with torch.cuda.stream(stream):
                    yield src
        finally:
            # The caller's stream owns everything after this call: both streams' work, and so the peers' buffers'
            # reads (the next call's opening barrier waits for them).
            current.wait_stream(side)
            current.wait_stream(computes[1])

    def reduce_ring(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> ReduceRing:
        return _SymmetricRing(self, shape, dtype)


class _SymmetricRing(ReduceRing):
    """Running sums in the symmetric buffer, a slot per step; the next rank reads them in place, told by a signal."""

    def __init__(self, transport: Symmetric, shape, dtype) -> None:
        self.rank, self.world, self.shape, self.dtype = transport.rank, transport.world, shape, dtype
        self.slot = shape[0] * shape[1]
        nbytes = (self.world - 1) * self.slot * torch.empty((), dtype=dtype).element_size()
        self.handle = _buffer(transport.group, transport.device, nbytes)
        self.handle.barrier(channel=_OPEN)

    def out(self, step: int) -> torch.Tensor:
        return self.handle.get_buffer(self.rank, self.shape, self.dtype, storage_offset=step * self.slot)

    def send(self, step: int) -> None:
        self.handle.put_signal((self.rank + 1) % self.world, channel=_RING)

    def received(self, step: int) -> torch.Tensor:
        left = (self.rank - 1) % self.world
        self.handle.wait_signal(left, channel=_RING)
        return self.handle.get_buffer(left, self.shape, self.dtype, storage_offset=step * self.slot)


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single.
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:  # fp8: bytes to gloo, which has no fp8 type
        out, tensor = out.view(torch.uint8), tensor.view(torch.uint8)
    gather(out, tensor, group=group)


def ring(rank: int, world: int) -> list[int]:
    """The ranks in the order ``rank`` visits them: itself, then the next ones around the ring."""
    return [(rank + step) % world for step in range(world)]


def transport(group, tensor: torch.Tensor) -> Collective | Symmetric:
    """The transport for ``group`` and tensors like ``tensor``: symmetric memory for CUDA tensors over NCCL."""
    if tensor.is_cuda and torch.distributed.get_backend(group) == "nccl":
        return Symmetric(group, tensor.device)
    return Collective(group)


_BUFFERS: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
_OUTGROWN: list[tuple[torch.Tensor, object]] = []
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def _buffer(group, device: torch.device, nbytes: int):
    """The group's symmetric buffer on ``device``, at least ``nbytes`` long (grown, collectively, when a call needs
    more: every rank of the group makes the same calls)."""
    from torch.distributed import _symmetric_memory as symm_mem

    key = (group.group_name, device.index)
    found = _BUFFERS.get(key)
    if found is None or found[0].numel() < nbytes:
        if found is not None:  # a peer may still read it (its stream behind this rank's): never freed
            _OUTGROWN.append(found)
        tensor = symm_mem.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
        found = _BUFFERS[key] = (tensor, symm_mem.rendezvous(tensor, group.group_name))
    return found[1]


def _stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """This module's own stream for ``role`` on ``device`` (made once)."""
    stream = _STREAMS.get((device.index, role))
    if stream is None:
        stream = _STREAMS[device.index, role] = torch.cuda.Stream(device)
    return stream
