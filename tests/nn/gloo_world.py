"""Process-group worlds for tests of torch.distributed code: :func:`spawn` runs ``fn(rank, world)`` on each rank, in a
CPU ``gloo`` world (the GEMMs on the reference backend) or an ``nccl`` world of one GPU per rank (the kernels); an
exception on any rank fails the test with that rank's traceback."""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

#: Whether this torch can run a gloo world (tests skip otherwise).
AVAILABLE = dist.is_available() and dist.is_gloo_available()


def spawn(fn, world: int, backend: str = "gloo") -> None:
    """Run ``fn(rank, world)`` in ``world`` processes of one process group (``"gloo"`` or ``"nccl"``)."""
    mp.spawn(_rank_main, args=(world, _free_port(), fn, backend), nprocs=world, join=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        import torch

        # NVLink multicast stays off (it can take a shared host's GPUs out of service): NCCL, torch, NVSHMEM.
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import epicute

        with epicute.use_backend("reference" if backend == "gloo" else "kernel"):
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
