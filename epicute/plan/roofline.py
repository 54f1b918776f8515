"""A small performance model: roofline bounds plus wave quantization.

Used by the planner to compare tile shapes and by ``explain`` to predict time.
The sustained-efficiency factors are what a warp-specialized WGMMA mainloop of
each tile width reaches on an H100 (the wider the tile, the fewer shared-memory
bytes per FLOP); they rank candidates, they do not promise a number.

A fused epilogue adds its operand tiles and aux outputs to the bytes moved.
The cooperative schedule runs the epilogue while no WGMMA is in flight, so each
tile pays the time its SM needs to move those extra bytes at its share of HBM
bandwidth; the ping-pong schedule runs it under the other warpgroup's
mainloop, so only what exceeds that mainloop shows (the plain D store is
asynchronous and hides behind the next mainloop in both).
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.plan.config import DTYPE_BYTES, GemmProblem
from epicute.plan.hardware import Hardware
from epicute.plan.smem import NO_EPILOGUE, EpilogueBuffers

#: Fraction of the tensor-core peak a mainloop sustains, by tile N (tile M is 128);
#: calibrated against bench/results/configs.json and configs_pingpong.json (H100 SXM,
#: bf16; TFLOPS over wave fill: 128x128 reaches 0.65-0.72, 128x192 0.74-0.80).
MAINLOOP_EFFICIENCY = {256: 0.82, 192: 0.78, 128: 0.70, 64: 0.55}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Roofline:
    flops: int
    min_bytes: int
    compute_s: float
    memory_s: float
    #: compute time with wave quantization and tile efficiency, or memory time
    predicted_s: float
    waves: float
    bound: str
    #: bytes the fused epilogue adds (operand tiles read, aux tiles written)
    epilogue_bytes: int = 0
    #: per-tile time the fused epilogue's extra traffic takes
    epilogue_tile_s: float = 0.0
    #: whether that time adds to the tile's (cooperative) or overlaps another tile's mainloop (ping-pong)
    epilogue_exposed: bool = True

    @property
    def intensity(self) -> float:
        return self.flops / max(self.min_bytes, 1)


def estimate_seconds(
    problem: GemmProblem,
    hw: Hardware,
    tile_m: int,
    tile_n: int,
    epilogue: EpilogueBuffers = NO_EPILOGUE,
    schedule: str = "cooperative",
) -> float:
    return roofline(problem, hw, tile_m, tile_n, epilogue=epilogue, schedule=schedule).predicted_s


def roofline(
    problem: GemmProblem,
    hw: Hardware,
    tile_m: int,
    tile_n: int,
    tile_k: int = 64,
    epilogue: EpilogueBuffers = NO_EPILOGUE,
    schedule: str = "cooperative",
) -> Roofline:
    flops = problem.flops
    extra_per_elem = sum(DTYPE_BYTES[d] for d in epilogue.tile_inputs + epilogue.aux_outputs)
    epilogue_bytes = problem.l * problem.m * problem.n * extra_per_elem
    min_bytes = problem.min_bytes + epilogue_bytes
    compute_s = flops / (hw.peak_tflops_16bit * 1e12)
    memory_s = min_bytes / (hw.hbm_tb_per_s * 1e12)
    tiles = _ceil_div(problem.m, tile_m) * _ceil_div(problem.n, tile_n) * problem.l
    waves = _ceil_div(tiles, hw.num_sms) if tiles else 0
    k_padded = _ceil_div(problem.k, tile_k) * tile_k
    per_sm_flops = hw.peak_tflops_16bit * 1e12 / hw.num_sms * MAINLOOP_EFFICIENCY.get(tile_n, 0.5)
    epilogue_tile_s = tile_m * tile_n * extra_per_elem / (hw.hbm_tb_per_s * 1e12 / hw.num_sms)
    mainloop_s = 2 * tile_m * tile_n * k_padded / per_sm_flops
    if schedule == "pingpong":
        # Two tiles in flight per SM, each mainloop with the tensor cores to itself:
        # an epilogue costs only what outlasts the other warpgroup's mainloop.
        tile_s = max(mainloop_s, epilogue_tile_s)
    else:
        tile_s = mainloop_s + epilogue_tile_s
    quantized_s = waves * tile_s
    predicted = max(quantized_s, memory_s)
    return Roofline(
        flops=flops,
        min_bytes=min_bytes,
        compute_s=compute_s,
        memory_s=memory_s,
        predicted_s=predicted,
        waves=tiles / hw.num_sms if tiles else 0.0,
        bound="compute" if quantized_s >= memory_s else "memory",
        epilogue_bytes=epilogue_bytes,
        epilogue_tile_s=epilogue_tile_s,
        epilogue_exposed=schedule != "pingpong",
    )
