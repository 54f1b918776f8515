"""GEMMs fused with tensor parallelism's collectives: :func:`all_gather_gemm` (a column-parallel layer's input
gathered while the GEMM runs) and :func:`gemm_reduce_scatter` (a row-parallel layer's partial sums reduced inside the
GEMM of each rank's rows), on torch.distributed process groups and torch's symmetric memory.

Example (one process per GPU, ``torchrun --nproc-per-node 2``):
    >>> import torch, torch.distributed as dist, epicute.distributed as ED      # doctest: +SKIP
    >>> dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    >>> x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)         # this rank's tokens
    >>> w_up = torch.randn(14336, 8192, device="cuda", dtype=torch.bfloat16)     # this rank's output features
    >>> h = ED.all_gather_gemm(x, w_up.t(), epilogue=lambda acc: epicute.ops.silu(acc))  # every rank's tokens
    >>> w_down = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16)   # this rank's input features
    >>> y = ED.gemm_reduce_scatter(h, w_down.t())                                # this rank's tokens, summed
"""

from epicute.distributed.collective import all_gather_gemm, gemm_reduce_scatter

__all__ = ["all_gather_gemm", "gemm_reduce_scatter"]
