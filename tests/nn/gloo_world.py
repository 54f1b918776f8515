"""A CPU ``gloo`` world for tests of torch.distributed code: :func:`spawn` runs ``fn(rank, world)`` on each rank,
the GEMMs on the reference backend; an exception on any rank fails the test with that rank's traceback."""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

#: Whether this torch can run a gloo world (tests skip otherwise).
AVAILABLE = dist.is_available() and dist.is_gloo_available()


def spawn(fn, world: int) -> None:
    """Run ``fn(rank, world)`` in ``world`` processes of one gloo process group."""
    mp.spawn(_rank_main, args=(world, _free_port(), fn), nprocs=world, join=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import epicute

        with epicute.use_backend("reference"):
            fn(rank, world)
        # No rank tears its group down while another still talks to it (gloo aborts the process if one does); a
        # rank that raised is past this, and spawn ends the others.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that got here passed: it leaves without running C++ static destructors, where gloo's threads, still
    # joinable at exit, aborted one run in a few ("terminate called without an active exception", SIGABRT). A rank
    # that raised never gets here: spawn reports its traceback.
    sys.stdout.flush()
    os._exit(0)
