"""A small performance model: roofline bounds plus wave quantization.

Used by the planner to compare tile shapes and by ``explain`` to predict time.
The sustained-efficiency factors are what a warp-specialized WGMMA mainloop of
each tile width reaches on an H100 (the wider the tile, the fewer shared-memory
bytes per FLOP); they rank candidates, they do not promise a number.

A fused epilogue adds its operand tiles and aux outputs to the bytes moved, and
its arithmetic: the planner's instruction estimate per element, issued at the
SM's 128 thread-instructions per cycle. Its operand tiles are fetched by TMA
while the mainloop runs and its outputs stored asynchronously, so per tile its
bytes show only where they outlast the mainloop. Its arithmetic is exposed in
the cooperative schedule, which runs the epilogue with no WGMMA in flight; the
ping-pong schedule runs it under the other warpgroup's mainloop, which then
loses about half of the epilogue's issue time (ncu: the tensor pipe is less
active with a gelu epilogue beside the mainloop). Charged this way, the model matches the
measured cost of the cooperative gelu epilogue (bench/NOTES.md, 'Fused epilogues:
the schedule by estimate'). A plain GEMM's cooperative tile exposes its store of D the
same way, where the target has measured it (:attr:`~epicute.runtime.target.Target.cooperative_store_cycles`).
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.gemm.config import GemmProblem
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.runtime.target import Target
from epicute.sm90.tile_grid import ceil_div

#: Fraction of the tensor-core peak a mainloop sustains, by tile N (tile M is 128): achieved
#: TFLOPS over the useful share of the waves' tiles, calibrated on H100 SXM, bf16
#: (bench/results/configs.json, configs_pingpong.json; bench/NOTES.md, 'Ping-pong 128x192 for
#: plain GEMMs' and 'Ping-pong 128x192 for plain 8192³').
MAINLOOP_EFFICIENCY = {256: 0.82, 224: 0.82, 192: 0.81, 128: 0.70, 64: 0.55}
#: The same for fp8 with blockwise scales, whose mainloop promotes every k-tile: 128x128 (two partials) and
#: 128x192 (one partial) calibrated at full waves on the do_bench method with A's scales TMA-loaded
#: (bench/NOTES.md, 'Blockwise fp8: A scales by TMA'); 64 keeps the bf16 table's ratio to 128.
BLOCK_SCALED_EFFICIENCY = {192: 0.585, 128: 0.58, 64: 0.46}
#: The same for 256-row tiles (each warpgroup two 64-row WGMMA blocks), whatever their width: swapped 256x160
#: one wave at 300 x 14336 x 4096 sustained 0.746 of the peak over its useful share, 256x176 at 777 x 5000 x 3000
#: 0.73 (bench/NOTES.md, 'Swapped 256-row tiles for mid-size M').
TALL_TILE_EFFICIENCY = 0.74
#: Thread-instructions an SM issues per cycle: four schedulers, one warp (32 threads) each.
SM_ISSUE_PER_CYCLE = 128
#: Share of a ping-pong epilogue's issue time that the other warpgroup's mainloop loses.
PINGPONG_EPILOGUE_SHARE = 0.5


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
    #: per-tile time the SM spends issuing the fused epilogue's arithmetic
    epilogue_alu_s: float = 0.0
    #: whether that time adds to the tile's (cooperative) or overlaps another tile's mainloop (ping-pong)
    epilogue_exposed: bool = True

    @property
    def intensity(self) -> float:
        return self.flops / max(self.min_bytes, 1)


def width_efficiency(table: dict[int, float], tile_n: int) -> float:
    """``table``'s efficiency of a ``tile_n``-wide tile: its own, else interpolated between the calibrated widths
    around it (a swapped tile's N is any multiple of 16); 0.5 outside them."""
    if tile_n in table:
        return table[tile_n]
    below = max((w for w in table if w < tile_n), default=None)
    above = min((w for w in table if w > tile_n), default=None)
    if below is None or above is None:
        return 0.5
    return table[below] + (table[above] - table[below]) * (tile_n - below) / (above - below)


def cluster_ctas(problem: GemmProblem, tile_m: int, tile_n: int, cluster: tuple[int, int]) -> int:
    """CTAs' worth of work of the problem's tiles in ``cluster``-shaped clusters: a ragged last cluster's idle peers
    hold their SMs too."""
    cluster_m, cluster_n = cluster
    clusters = ceil_div(ceil_div(problem.m, tile_m), cluster_m) * ceil_div(ceil_div(problem.n, tile_n), cluster_n)
    return clusters * cluster_m * cluster_n * problem.l


def cta_slots(in_flight: int, cluster: tuple[int, int]) -> int:
    """Of ``in_flight`` CTA slots, those whole clusters of ``cluster`` fill."""
    size = cluster[0] * cluster[1]
    return in_flight // size * size


def estimate_seconds(
    problem: GemmProblem,
    hw: Target,
    tile_m: int,
    tile_n: int,
    epilogue: EpilogueBuffers = NO_EPILOGUE,
    schedule: str = "cooperative",
) -> float:
    return roofline(problem, hw, tile_m, tile_n, epilogue=epilogue, schedule=schedule).predicted_s


def roofline(
    problem: GemmProblem,
    hw: Target,
    tile_m: int,
    tile_n: int,
    tile_k: int | None = None,
    epilogue: EpilogueBuffers = NO_EPILOGUE,
    schedule: str = "cooperative",
    split_k: int = 1,
    cluster: tuple[int, int] = (1, 1),
) -> Roofline:
    """The plan's time as the explain text shows it: compute-bound tiles in waves over the SMs (each of ``split_k``
    CTAs of a tile runs its share of the k-tiles and stores an fp32 partial, which the tile's last split reads back;
    a ``cluster`` of tiles holds its SMs whole, the padded tiles of a ragged last cluster included), or the HBM
    traffic, whichever is longer."""
    tile_k = tile_k or problem.tile_k
    flops = problem.flops
    # A gated epilogue's outputs and operand tiles have half of B's columns (gate and up pair into one).
    out_n, out_tile_n = epilogue.out_tile_n(problem.n), epilogue.out_tile_n(tile_n)
    extra_per_elem = sum(DTYPE_BYTES[d] for d in epilogue.tile_inputs + epilogue.aux_outputs)
    epilogue_bytes = problem.l * problem.m * out_n * extra_per_elem
    unstored_d = problem.l * problem.m * (problem.n - out_n) * DTYPE_BYTES[problem.d_dtype]
    min_bytes = problem.min_bytes - unstored_d + epilogue_bytes
    peak_flops = hw.peak_tflops(problem.ab_dtype) * 1e12
    compute_s = flops / peak_flops
    memory_s = min_bytes / (hw.hbm_tb_per_s * 1e12)
    units = cluster_ctas(problem, tile_m, tile_n, cluster) * split_k  # each split of a tile is a CTA's work
    slots = cta_slots(hw.num_sms, cluster)
    waves = ceil_div(units, slots) if units else 0
    k_padded = ceil_div(ceil_div(problem.k, tile_k), split_k) * tile_k  # one split's k-tiles
    efficiency = BLOCK_SCALED_EFFICIENCY if problem.block_scaled else MAINLOOP_EFFICIENCY
    share = TALL_TILE_EFFICIENCY if tile_m == 256 and not problem.block_scaled else width_efficiency(efficiency, tile_n)
    per_sm_flops = peak_flops / hw.num_sms * share
    epilogue_tile_s = tile_m * out_tile_n * extra_per_elem / (hw.hbm_tb_per_s * 1e12 / hw.num_sms)
    epilogue_alu_s = tile_m * out_tile_n * epilogue.instructions_per_element / (SM_ISSUE_PER_CYCLE * hw.tensor_clock_hz)
    mainloop_s = 2 * tile_m * tile_n * k_padded / per_sm_flops
    if split_k > 1:  # its fp32 partial stored, and read back by the tile's last split: twice, at the SM's HBM share
        mainloop_s += 2 * tile_m * tile_n * 4 / (hw.hbm_tb_per_s * 1e12 / hw.num_sms)
    if schedule == "pingpong":
        # Two tiles in flight per SM, each mainloop with the tensor cores to itself: an
        # epilogue slows the other warpgroup's mainloop by its share of the issue slots,
        # and its bytes cost only what outlasts that mainloop.
        tile_s = max(mainloop_s + PINGPONG_EPILOGUE_SHARE * epilogue_alu_s, epilogue_tile_s + epilogue_alu_s)
    else:
        tile_s = max(mainloop_s, epilogue_tile_s) + epilogue_alu_s
        if not epilogue.chain:  # a fused epilogue's calibration (above) was fit with its store in it
            tile_s += tile_m * out_tile_n * hw.cooperative_store_cycles / hw.tensor_clock_hz
    quantized_s = waves * tile_s
    predicted = max(quantized_s, memory_s)
    return Roofline(
        flops=flops,
        min_bytes=min_bytes,
        compute_s=compute_s,
        memory_s=memory_s,
        predicted_s=predicted,
        waves=units / slots if units else 0.0,
        bound="compute" if quantized_s >= memory_s else "memory",
        epilogue_bytes=epilogue_bytes,
        epilogue_tile_s=epilogue_tile_s,
        epilogue_alu_s=epilogue_alu_s,
        epilogue_exposed=schedule != "pingpong",
    )
