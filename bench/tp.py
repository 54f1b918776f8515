"""Tensor-parallel projections with their collectives: epicute.distributed against NCCL + cuBLAS and torch's async-TP.

Llama-3-70B's projections under sequence parallelism (hidden 8192, intermediate 28672, 64 query and 8 key/value
heads of 128), each rank holding ``tokens / TP`` tokens:

- column-parallel (all-gather the tokens, then the GEMM): ``qkv`` (N = 10240 / TP) and ``gate_up`` (57344 / TP);
- row-parallel (the GEMM, then reduce-scatter the partial sums): ``o_proj`` (K = 8192 / TP) and ``down``
  (28672 / TP).

Each in bf16 and in fp8 (e4m3, rowwise scales: the tokens' per row, the weight's per output feature, bf16 out).
Peers, every one on the same inputs in the same run, interleaved in balanced orders: ``nccl+cublas`` (the unfused
NCCL collective and ``torch.matmul``) and ``async_tp`` (``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``, their ``scaled`` forms for fp8); ``epicute_unfused`` (the NCCL collective around
epicute's GEMM: what the fusion itself gains) is a reference figure, not a peer. Each rank times every contender
(CUDA events, medians, warm-up excluded); a row gives the slowest rank's median as TFLOP/s per GPU. Every
contender's output is checked against the unfused one first.

    python bench/tp.py [--tp 2 4 8] [--tokens 8192] [--dtypes bf16 fp8] [--out bench/results/tp.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import print_table, write_result

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 8192, 28672, 64, 8, 128
#: (name, parallel style, K, N) of the whole layer; the style says which of K or N each rank splits.
PROJECTIONS = (
    ("qkv", "column", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    ("o_proj", "row", HEADS * HEAD_DIM, HIDDEN),
    ("gate_up", "column", HIDDEN, 2 * INTERMEDIATE),
    ("down", "row", INTERMEDIATE, HIDDEN),
)
TOLERANCE = 2e-2  # bf16 outputs of two orders of summation


def _contenders(style: str, x, w, group, scales=None):
    """The three ways to run one rank's share of a projection, each a function of no arguments; ``scales`` (fp8
    inputs): x's per-row ``(rows, 1)`` and w's per-output-feature ``(1, N)`` fp32 scales."""
    import torch
    import torch.distributed as dist

    import epicute
    import epicute.distributed as ED

    world, name, bf16 = group.size(), group.group_name, torch.bfloat16
    xs, ws = scales or (None, None)
    ours_scales = {"a_scale": xs, "b_scale": ws} if scales else {}

    def our_gemm(a, a_scale=None):
        return epicute.gemm(a, w.t(), **({"a_scale": a_scale, "b_scale": ws} if scales else {}))

    def matmul(a, a_scale=None):
        if scales is None:
            return a @ w.t()
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=ws, out_dtype=bf16)

    if style == "column":
        gathered = x.new_empty((world * x.shape[0], x.shape[1]))
        gathered_scales = xs.new_empty((world * xs.shape[0], 1)) if scales else None

        def gather():
            dist.all_gather_into_tensor(gathered.view(torch.uint8) if scales else gathered,
                                        x.view(torch.uint8) if scales else x, group=group)  # fmt: skip
            if scales:
                dist.all_gather_into_tensor(gathered_scales, xs, group=group)

        def unfused():
            gather()
            return matmul(gathered, gathered_scales)

        def ours_unfused():
            gather()
            return our_gemm(gathered, gathered_scales)

        def async_tp():
            if scales is None:
                return torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], gather_dim=0, group_name=name)[1][0]
            return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                x, [w.t()], xs, [ws], 0, name, [None], [None], [bf16], [False])[1][0]  # fmt: skip

        def ours():
            return ED.all_gather_gemm(x, w.t(), group, **ours_scales)
    else:
        scattered = torch.empty((x.shape[0] // world, w.shape[0]), dtype=bf16, device=x.device)

        def unfused():
            dist.reduce_scatter_tensor(scattered, matmul(x, xs), group=group)
            return scattered

        def ours_unfused():
            dist.reduce_scatter_tensor(scattered, our_gemm(x, xs), group=group)
            return scattered

        def async_tp():
            if scales is None:
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", scatter_dim=0, group_name=name)
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                x, w.t(), xs, ws, "sum", 0, 0, name, [x.shape[0], w.shape[0]], out_dtype=bf16)  # fmt: skip

        def ours():
            return ED.gemm_reduce_scatter(x, w.t(), group, **ours_scales)

    # epicute_unfused: the same NCCL collective around epicute's GEMM, what the fusion itself gains (not a peer).
    return {"epicute": ours, "nccl+cublas": unfused, "async_tp": async_tp, "epicute_unfused": ours_unfused}


def _rowwise_fp8(t):
    """``t`` in e4m3 per row, and the fp32 scales ``(rows, 1)`` that dequantize it."""
    import torch

    scale = t.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def _rank(rank: int, world: int, port: int, tokens: int, dtypes: list[str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")  # fmt: skip
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    from epicute.benchmark import time_interleaved

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # needless from torch 2.8 on, required before
        symm_mem.enable_symm_mem_for_group(group.group_name)
    rows = []
    for (case, style, k, n), dtype in itertools.product(PROJECTIONS, dtypes):
        torch.manual_seed(1234 + rank)
        shard_k, shard_n = (k, n // world) if style == "column" else (k // world, n)
        x_rows = tokens // world if style == "column" else tokens
        x = torch.randn(x_rows, shard_k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(shard_n, shard_k, device="cuda", dtype=torch.bfloat16) / shard_k**0.5
        if dtype == "fp8":
            (x, xs), (w, ws) = _rowwise_fp8(x), _rowwise_fp8(w)
            fns = _contenders(style, x, w, group, (xs, ws.reshape(1, -1)))
        else:
            fns = _contenders(style, x, w, group)
        want = fns["nccl+cublas"]().float()
        row = {"case": f"{case} {style} {dtype} TP{world} {tokens}x{n}x{k}"}
        for label, fn in fns.items():
            got = fn().float()
            error = ((got - want).norm() / want.norm()).item()
            if not error < TOLERANCE:
                row[f"{label}_error"] = f"relative error {error:.3g} against nccl+cublas"
        times = time_interleaved(fns, warmup=5, iters=20)
        flops = 2 * tokens * shard_n * shard_k
        slowest = [None] * world
        dist.all_gather_object(slowest, times)
        for label in fns:
            ms = max(t[label] for t in slowest)
            row[label] = None if f"{label}_error" in row else round(flops / ms / 1e9, 1)
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="tensor-parallel sizes (default: 2, 4, 8 "
                        "up to the GPUs there are)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"],
                        help="bf16, and fp8 e4m3 with rowwise scales")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tp.json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    sizes = args.tp or [tp for tp in (2, 4, 8) if tp <= gpus]
    if not sizes or max(sizes) > gpus:
        print(f"tensor parallelism over {sizes} GPUs needs that many; this machine has {gpus}")
        return 2
    rows = []
    context = mp.get_context("spawn")
    for world in sizes:
        queue = context.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rank = functools.partial(_rank, queue=queue)
        mp.start_processes(rank, args=(world, port, args.tokens, args.dtypes), nprocs=world, start_method="spawn")
        rows += queue.get()
    command = "python bench/tp.py " + " ".join(sys.argv[1:])
    print(f"wrote {write_result(args.out, 'tp', command.strip(), 'TFLOPS', True, rows)}")
    print_table(rows, "TFLOPS")
    return 0 if not any(key.endswith("_error") and key.startswith("epicute") for r in rows for key in r) else 1


if __name__ == "__main__":
    sys.exit(main())
