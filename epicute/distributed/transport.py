"""How the ranks of a process group reach each other's rows, for :mod:`epicute.distributed.collective`.

Two transports with one interface, chosen by the group and the tensors' device:

- :class:`Symmetric` (CUDA tensors, an NCCL group): torch's symmetric memory (``torch.distributed.
  _symmetric_memory``), one buffer per group mapped into every rank's address space. A peer's shard is pulled by the
  copy engine on a side stream (no SM spent on it) while the GEMMs run; partial sums are pushed to the ranks that
  own their rows by the copy engine as well, but for the last one, which its owner's GEMM reads in place.
  Cross-rank order comes from the buffer's barriers and signals, stream-ordered kernels of torch's.
- :class:`Collective` (any other group, e.g. ``gloo`` on CPU): the same schedule over plain collectives and
  point-to-point sends, with no overlap. It runs the host logic where symmetric memory does not exist (CI's CPU
  gloo world).

Both are stream-ordered: what they yield or return is ready for work issued after them on the stream current then.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Signal channels of the symmetric buffer: 0 opens a call (a barrier: peers are done with the buffer's previous
#: contents), 1 says every rank's shard is staged (a barrier), 2 says a partial sum was copied into its owner's
#: buffer, 3 that the last partial sum waits in its producer's buffer.
_OPEN, _STAGED, _PUSHED, _LEFT = 0, 1, 2, 3


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

    def partials(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> PartialExchange:
        return _SentPartials(self, shape, dtype, device)


class PartialExchange:
    """One reduce-scatter's partial sums on their way to the ranks that own their rows. At step ``i`` (``0`` to
    ``world - 2``) this rank computes into :meth:`out` the partial of the rows of rank :meth:`owner` and hands it
    over with :meth:`send`; :meth:`received` gives the ``world - 1`` partials of its own rows, step order of their
    producers, ready for work issued after it on the current stream."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def owner(self, step: int) -> int:
        """The rank whose rows step ``step`` multiplies: the next ranks around the ring, one a step."""
        return (self.rank + 1 + step) % self.world

    def source(self, step: int) -> int:
        """The rank whose step ``step`` computes this rank's partial."""
        return (self.rank - 1 - step) % self.world

    def out(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def send(self, step: int) -> None:
        raise NotImplementedError

    def received(self) -> list[torch.Tensor]:
        raise NotImplementedError


class _SentPartials(PartialExchange):
    """Partials in this rank's own tensors, sent to their owners point to point."""

    def __init__(self, transport: Collective, shape, dtype, device) -> None:
        super().__init__(transport.rank, transport.world)
        self.group = transport.group
        self.parts = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.world - 1)]
        self.pending: list = []

    def out(self, step: int) -> torch.Tensor:
        return self.parts[step]

    def send(self, step: int) -> None:
        owner = torch.distributed.get_global_rank(self.group, self.owner(step))
        self.pending.append(torch.distributed.isend(self.parts[step], owner, group=self.group))

    def received(self) -> list[torch.Tensor]:
        got = []
        for step, part in enumerate(self.parts):
            got.append(torch.empty_like(part))
            torch.distributed.recv(got[-1], torch.distributed.get_global_rank(self.group, self.source(step)),
                                   group=self.group)  # fmt: skip
        for work in self.pending:  # every peer has received, so this rank's sends are done
            work.wait()
        return got


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

    def partials(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> PartialExchange:
        return _SymmetricPartials(self, shape, dtype)


class _SymmetricPartials(PartialExchange):
    """Partials through the symmetric buffers. Each one but the last goes into a local tensor, from which the copy
    engine pushes it, on a side stream, into its owner's buffer (slot ``step``) while the next GEMMs run; a signal
    follows the copy. The last one, ready only as the owner's own GEMM is about to start, is left in this rank's
    buffer (slot ``world - 2``) and read in place by that GEMM's epilogue, over NVLink: copying it first would put
    the whole copy before the GEMM. A GEMM that stores to or loads from a peer throughout runs about half as long
    again as one on local memory (bench/NOTES.md, TP4's row-parallel timelines), so one step of ``world`` pays it."""

    def __init__(self, transport: Symmetric, shape, dtype) -> None:
        super().__init__(transport.rank, transport.world)
        self.shape, self.dtype, self.device = shape, dtype, transport.device
        self.slot = shape[0] * shape[1]
        nbytes = (self.world - 1) * self.slot * torch.empty((), dtype=dtype).element_size()
        self.handle = _buffer(transport.group, transport.device, nbytes)
        self.side = _stream(transport.device, "copy")
        self.parts: dict[int, torch.Tensor] = {}
        self.handle.barrier(channel=_OPEN)

    def _slot(self, rank: int, index: int) -> torch.Tensor:
        return self.handle.get_buffer(rank, self.shape, self.dtype, storage_offset=index * self.slot)

    def out(self, step: int) -> torch.Tensor:
        if step == self.world - 2:
            return self._slot(self.rank, step)
        self.parts[step] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.parts[step]

    def send(self, step: int) -> None:
        if step == self.world - 2:
            self.handle.put_signal(self.owner(step), channel=_LEFT)
            return
        part = self.parts.pop(step)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self._slot(self.owner(step), step).copy_(part)
            self.handle.put_signal(self.owner(step), channel=_PUSHED)
        part.record_stream(self.side)

    def received(self) -> list[torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        for step in range(self.world - 2):
            self.handle.wait_signal(self.source(step), channel=_PUSHED)
        last = self.world - 2
        self.handle.wait_signal(self.source(last), channel=_LEFT)
        # The caller's stream owns all after this: this rank's pushes too (the next call's opening barrier, on it,
        # then says that they have landed).
        current.wait_stream(self.side)
        return [self._slot(self.rank, step) for step in range(last)] + [self._slot(self.source(last), last)]


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
