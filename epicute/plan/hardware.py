"""What the planner needs to know about the GPU.

Plans are made on machines without a GPU too (CI, ahead-of-time compiles), so
the H100 SXM figures are the default and a present Hopper GPU overrides the
ones it can report (SM count, opt-in shared memory per block).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    num_sms: int
    #: Dynamic shared memory one CTA may opt into (227 KiB on H100).
    smem_per_cta_bytes: int
    #: Dense bf16/fp16 tensor-core peak, TFLOP/s.
    peak_tflops_16bit: float
    #: HBM bandwidth, TB/s.
    hbm_tb_per_s: float
    l2_bytes: int
    arch: str = "sm_90a"
    detected: bool = False

    @property
    def tensor_clock_hz(self) -> float:
        """The SM clock the tensor-core peak assumes (4096 dense 16-bit FLOP per SM per cycle)."""
        return self.peak_tflops_16bit * 1e12 / (self.num_sms * 4096)


H100_SXM = Hardware(
    name="NVIDIA H100 SXM (assumed)",
    num_sms=132,
    smem_per_cta_bytes=227 * 1024,
    peak_tflops_16bit=989.0,
    hbm_tb_per_s=3.35,
    l2_bytes=50 * 1024 * 1024,
)


@functools.lru_cache(maxsize=None)
def current_hardware() -> Hardware:
    """The visible Hopper GPU's figures, or :data:`H100_SXM` when there is none."""
    try:
        import torch

        if not torch.cuda.is_available():
            return H100_SXM
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:  # no usable CUDA runtime: plan for the default part
        return H100_SXM
    if (props.major, props.minor) != (9, 0):
        return H100_SXM
    smem = getattr(props, "shared_memory_per_block_optin", H100_SXM.smem_per_cta_bytes)
    return replace(
        H100_SXM,
        name=props.name,
        num_sms=props.multi_processor_count,
        smem_per_cta_bytes=int(smem),
        l2_bytes=int(getattr(props, "L2_cache_size", H100_SXM.l2_bytes)),
        detected=True,
    )
