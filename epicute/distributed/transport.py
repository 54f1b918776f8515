"""How the ranks of a process group reach each other's rows, for :mod:`epicute.distributed.collective`.

Two transports with one interface, chosen by the group and the tensors' device:

- :class:`Symmetric` (CUDA tensors, an NCCL group): torch's symmetric memory (``torch.distributed.
  _symmetric_memory``), one buffer per group mapped into every rank's address space. A peer's shard is pulled by the
  copy engine on a side stream (no SM spent on it) while the GEMM runs on the caller's stream; a peer's partial sums
  are read in place, from its buffer, by the GEMM that reduces them. Cross-rank order comes from the buffer's
  barriers, stream-ordered kernels of torch's.
- :class:`Collective` (any other group, e.g. ``gloo`` on CPU): the same schedule over plain collectives, with no
  overlap. It runs the host logic where symmetric memory does not exist (CI's CPU gloo world).

Both are stream-ordered on the caller's current stream: what they return is ready for work issued after them there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

#: Barrier channels of the symmetric buffer: 0 opens a call (peers are done with the buffer's previous contents),
#: 1 says every rank's contents for this call are in place.
_OPEN, _STAGED = 0, 1


class Collective:
    """The schedule's data movement over a process group's own collectives (no overlap): the host logic's
    reference, and the path for groups without symmetric memory."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()

    def gather(self, shard: torch.Tensor, gathered: torch.Tensor) -> Iterator[int]:
        """Fill ``gathered`` (``world`` row blocks, rank order) with every rank's ``shard``, yielding each source
        rank once its block may be read: the own rank first, then the next ranks in ring order."""
        _all_gather(gathered, shard.contiguous(), self.group)
        yield from ring(self.rank, self.world)

    def exchange(self, produce: Callable[[int, torch.Tensor], None], shape: tuple[int, int],
                 dtype: torch.dtype) -> list[torch.Tensor]:  # fmt: skip
        """Call ``produce(dst, out)`` for every other rank ``dst`` (ring order), ``out`` a ``shape`` tensor, and
        return the tensors the other ranks produced for this one."""
        mine = torch.zeros((self.world, *shape), dtype=dtype, device=self._device())
        for dst in ring(self.rank, self.world)[1:]:
            produce(dst, mine[dst])
        everyone = torch.empty((self.world * self.world, *shape), dtype=dtype, device=mine.device)
        _all_gather(everyone, mine, self.group)
        return [everyone[src * self.world + self.rank] for src in ring(self.rank, self.world)[1:]]

    def _device(self) -> torch.device:
        return torch.device("cpu") if torch.distributed.get_backend(self.group) == "gloo" else torch.device("cuda")


class Symmetric:
    """The schedule's data movement through torch's symmetric memory (module docstring)."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.device = device

    def gather(self, shard: torch.Tensor, gathered: torch.Tensor) -> Iterator[int]:
        """:meth:`Collective.gather`, overlapped: the own shard is staged in the symmetric buffer and read at once;
        each peer's block is pulled by the copy engine on a side stream, and the caller's stream waits for that
        block only when it reads it."""
        handle = _buffer(self.group, self.device, shard.numel() * shard.element_size())
        current, side = torch.cuda.current_stream(self.device), _side_stream(self.device)
        handle.barrier(channel=_OPEN)
        handle.get_buffer(self.rank, tuple(shard.shape), shard.dtype).copy_(shard)
        handle.barrier(channel=_STAGED)
        side.wait_stream(current)
        rows = shard.shape[0]
        arrived = {}
        with torch.cuda.stream(side):
            for src in ring(self.rank, self.world)[1:]:
                gathered[src * rows : (src + 1) * rows].copy_(handle.get_buffer(src, tuple(shard.shape), shard.dtype))
                arrived[src] = torch.cuda.Event()
                arrived[src].record(side)
            gathered[self.rank * rows : (self.rank + 1) * rows].copy_(shard)
        try:
            yield self.rank
            for src in ring(self.rank, self.world)[1:]:
                current.wait_event(arrived[src])
                yield src
        finally:
            # The caller's stream owns everything after this call: the copies, and so the peers' buffers' reads.
            current.wait_stream(side)

    def exchange(self, produce: Callable[[int, torch.Tensor], None], shape: tuple[int, int],
                 dtype: torch.dtype) -> list[torch.Tensor]:  # fmt: skip
        """:meth:`Collective.exchange` in place: each ``out`` is a slot of this rank's symmetric buffer, and what
        comes back are the peers' slots for this rank, views of their memory, readable once the barrier issued here
        has passed on the caller's stream (they stay valid until the next call on this group's buffer)."""
        slot = shape[0] * shape[1]
        handle = _buffer(self.group, self.device, (self.world - 1) * slot * torch.empty((), dtype=dtype).element_size())
        handle.barrier(channel=_OPEN)
        for step, dst in enumerate(ring(self.rank, self.world)[1:]):
            produce(dst, handle.get_buffer(self.rank, shape, dtype, storage_offset=step * slot))
        handle.barrier(channel=_STAGED)
        # The peer ``src`` produced this rank's rows at its step (rank - src) % world, in that slot of its buffer.
        return [handle.get_buffer(src, shape, dtype, storage_offset=((self.rank - src) % self.world - 1) * slot)
                for src in ring(self.rank, self.world)[1:]]  # fmt: skip


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single.
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
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
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


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


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device.index)
    if stream is None:
        stream = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream
