"""Choosing a GEMM configuration for a problem: the planner's decisions, with reasons.

Pure Python: it runs without a GPU and is unit-tested on CPU. Each decision
appends a one-line reason to the config, which ``explain`` prints.

One rule decides what may be chosen: :func:`check_config`, the check every planned config gets. Candidate tiles
go through it before any choice among them (:func:`tile_refusal`), so the planner never picks what it would then
refuse; the refusals of the tiles it passes over are part of the reasons (``tests/test_plans_validate.py`` sweeps
``explain`` to hold it to that).

The choices, in order (measurements behind them: ``bench/results/configs*.json``):

- **swap-AB** first (:func:`choose_swap_ab`): a decode GEMM (M <= 64 rows of A against a wider N, B the
  transpose of a row-major weight) whose epilogue has a transpose runs as D^T = B^T A^T, the weight's rows on
  the MMA's M side and M in a tile N of 16-64; its own plan (:func:`_swap_ab_config`) splits K while the CTAs
  fill under half the SMs, or from M = 49 takes 64-row ping-pong tiles (bench/NOTES.md, 'Swap-AB decode GEMMs',
  'L2 evict-first for decode GEMMs'). A plain GEMM of 129-511 rows swaps into 256-row tiles of D^T where they
  run in one wave what 128-row tiles of A run in two (:func:`choose_wide_swap`; bench/NOTES.md, 'Swapped 256-row
  tiles for mid-size M'). The operand only one tile reads is loaded L2 evict-first (:func:`choose_evict_first`,
  for every plan). The choices below are the unswapped kernel's.
0. **schedule**: cooperative for a plain GEMM, unless ping-pong's 128x192 tile is
   estimated faster (it fills the last wave better on some shapes: 8192^3,
   1024x14336x4096). With a fused epilogue: cooperative when the problem has at
   most four 128x128 tiles per SM (with so few tiles per warpgroup the overlap
   does not pay for a lone warpgroup's slower mainloop); otherwise whichever
   schedule's best tile the roofline estimates faster, charging the epilogue's
   arithmetic in full to cooperative and half to ping-pong, which runs it under
   the other warpgroup's mainloop.
1. **tile_n**: cooperative from {256, 128, 64}, ping-pong from {192, 128, 64}:
   the one with the smallest estimated time (wave quantization x per-tile
   efficiency, see :mod:`epicute.gemm.roofline`). Narrow tiles win where wider
   ones leave SMs idle: 256x4096x4096 runs 64 tiles of 128x128 on 132 SMs but
   128 of 128x64 (bench/results/configs.json; bench/NOTES.md, 'Narrow tiles for
   under-filled problems').
   **epilogue code**: the epilogue is unrolled over a thread's accumulators, so
   its code grows with elements per thread x instructions per element; past
   :data:`EPILOGUE_CODE_BUDGET` it evicts the mainloop from the instruction
   cache, and the planner moves to cooperative tiles with fewer elements per
   thread.
2. **cluster**: 2x1 (B multicast to two M-neighbours, halving its L2->SM
   traffic) when there are at least two M tiles and at least half a wave of
   tiles (it pays most on small-M shapes with a long K, whose B panels stream
   from L2 with little reuse; bench/NOTES.md, 'Small M: split-K measured, and
   removed'), unless an odd count of row tiles would make the pairs take one
   more wave than single tiles (then 1x2, or 1x1: :func:`choose_cluster_pair`);
   otherwise 1x1, because an idle cluster peer costs an SM.
3. **persistent or not**: persistent when there is more than one wave of tiles
   (the epilogue of tile i then overlaps the mainloop of tile i+1, so D needs
   its own staging buffers); a single wave gains nothing from persistence, so
   its epilogue stages D in the idle A ring and the smem goes to A/B stages.
4. **stages**: as many A/B stages as the budget allows after the epilogue's
   minimum (2 D buffers), then leftover shared memory deepens the D buffers.
5. **rasterization**: bands of 8 clusters, walked so that the operand each band re-reads
   costs the fewest rows plus columns over the whole output (mostly: swept along the longer
   output dimension); when M == N, the walk whose tiles in flight cover the squarer block
   of the output.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from epicute.errors import ConfigError
from epicute.gemm.config import (
    MAX_ACC_REGS,
    MAX_SPLIT_K,
    SWAP_AB_TILE_N,
    TILE_N,
    GemmConfig,
    GemmProblem,
    b_scale_chunks,
    epi_tile_m,
    validate_block_scaled,
)
from epicute.gemm.roofline import Roofline, cluster_ctas, cta_slots, estimate_seconds, roofline
from epicute.gemm.smem import (
    NO_EPILOGUE,
    EpilogueBuffers,
    ab_stage_bytes,
    epi_fits_in_a_ring,
    epi_stage_bytes,
    epilogue_smem_bytes,
    smem_total,
)
from epicute.runtime.target import H100_SXM, Target
from epicute.sm90.tile_grid import ceil_div
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP

MAX_AB_STAGES = 8
MAX_EPI_STAGES = 4
MIN_EPI_STAGES = 2
EPI_TILE_N = 32
#: A cooperative tile width between 192 and 256, a candidate where it divides N (:func:`tile_widths`).
WAVE_FIT_TILE_N = 224
#: Unrolled epilogue instructions per consumer thread that leave the mainloop's code in
#: the SM's instruction cache. Past that (the cliff lies at 8-9k) the epilogue's code evicts
#: the mainloop's, whose warps then stall for instructions and the kernel slows several-fold
#: (bench/NOTES.md, 'The epilogue's code size: an instruction-cache cliff').
EPILOGUE_CODE_BUDGET = 8192
#: A fused epilogue gets ping-pong above this many waves of 128x128 tiles (see choose_schedule).
PINGPONG_MIN_WAVES = 4


def _num_tiles(problem: GemmProblem, tile_m: int, tile_n: int) -> int:
    return ceil_div(problem.m, tile_m) * ceil_div(problem.n, tile_n) * problem.l


def choose_schedule(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, tile_pinned: bool = False, pins: tuple = ()
) -> tuple[str, str]:
    """``(schedule, why)``; a schedule none of whose tiles can run the problem (:func:`tile_refusal`) is not
    chosen where the other's can. ``pins``: the config fields the caller pinned, as sorted items."""
    schedule, why = _preferred_schedule(problem, hw, epilogue, tile_pinned, pins)
    refusal = schedule_refusal(problem, hw, epilogue, schedule, pins)
    other = "pingpong" if schedule == "cooperative" else "cooperative"
    if refusal is not None and schedule_refusal(problem, hw, epilogue, other, pins) is None:
        return other, f"no {schedule} tile can run it ({refusal})"
    return schedule, why


def _preferred_schedule(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, tile_pinned: bool, pins: tuple
) -> tuple[str, str]:
    if not epilogue.chain:
        # A plain GEMM's ping-pong is a tile choice: its widest tile (128x192, one warpgroup's
        # accumulators) fills the last wave better than 128x256 on some shapes, reuses more per
        # byte than 128x128, and stores each tile under the other warpgroup's mainloop, which
        # pays at many waves (bench/results/configs_pingpong.json; bench/NOTES.md, 'Ping-pong
        # 128x192 for plain GEMMs', 'The cooperative store's exposed time'). A pinned tile keeps
        # the cooperative default.
        if (
            not tile_pinned
            and problem.n > 128
            and tile_refusal(problem, hw, epilogue, "pingpong", 128, 192, pins) is None
        ):
            cooperative, coop_n = best_tile_estimate(problem, hw, epilogue, "cooperative", pins)
            pingpong = estimate_seconds(problem, hw, 128, 192, schedule="pingpong")
            if pingpong < cooperative:
                return "pingpong", (
                    f"plain GEMM: ping-pong 128x192 tiles estimated {pingpong * 1e6:.0f} us vs "
                    f"{cooperative * 1e6:.0f} us for cooperative 128x{coop_n} (wave quantization; a cooperative "
                    "tile's store runs with no WGMMA in flight)"
                )
        why = "plain GEMM with a pinned tile" if tile_pinned else "plain GEMM"
        return "cooperative", f"{why}: two warpgroups on one 128-row tile"
    tiles = _num_tiles(problem, 128, 128)
    if tiles <= PINGPONG_MIN_WAVES * hw.num_sms:
        # With few tiles per CTA a ping-pong CTA's second warpgroup has little or nothing to
        # overlap, and a lone warpgroup's mainloop is slower than two on one tile: cooperative
        # wins up to ~4 tiles of 128x128 per SM, ping-pong from ~7 (bench/results/
        # configs_epilogue_{one_wave,waves}.json; bench/NOTES.md, 'Fused epilogue at few tiles per SM').
        return "cooperative", (
            f"{tiles} 128x128 tiles are at most {PINGPONG_MIN_WAVES} per SM: too few for ping-pong's overlap to pay"
        )
    # Enough tiles: compare the two schedules' best tiles. The cooperative epilogue's
    # arithmetic is exposed but runs on 128x256 tiles, which fill these waves better than
    # ping-pong's 128x192 on most shapes (fused gelu; ping-pong stays ahead at 4096x14336x4096
    # and 8192^3: bench/NOTES.md, 'Fused epilogues: the schedule by estimate').
    estimates = {
        schedule: best_tile_estimate(problem, hw, epilogue, schedule, pins) for schedule in ("pingpong", "cooperative")
    }
    best = min(estimates, key=lambda name: estimates[name][0])
    other = "cooperative" if best == "pingpong" else "pingpong"
    return best, (
        f"fused epilogue: {best} 128x{estimates[best][1]} estimated {estimates[best][0] * 1e6:.0f} us vs "
        f"{estimates[other][0] * 1e6:.0f} us for {other} 128x{estimates[other][1]} "
        + (
            "(the epilogue runs under the other warpgroup's mainloop)"
            if best == "pingpong"
            else "(wider tiles fill the waves better than the epilogue costs exposed)"
        )
    )


def epilogue_code(epilogue: EpilogueBuffers, schedule: str, tile_m: int, tile_n: int) -> int:
    """Estimated unrolled epilogue instructions per consumer thread of a tile."""
    threads = THREADS_PER_WARPGROUP * (1 if schedule == "pingpong" else 2)
    return tile_m * tile_n // threads * epilogue.instructions_per_element


def fit_epilogue_code(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, schedule: str, tile_n: int, pins: tuple = ()
) -> tuple[str, int, str]:
    """(schedule, tile_n, reason) whose 128-row tile keeps the epilogue's code within budget:
    the given pair if it fits, else the widest cooperative tile that does (else the narrowest), of those that
    can run the problem (:func:`tile_refusal`)."""
    per_element = epilogue.instructions_per_element
    code = epilogue_code(epilogue, schedule, 128, tile_n)
    note = f"epilogue code ~{per_element} instructions per element x {code // per_element} per thread = {code}"
    if code <= EPILOGUE_CODE_BUDGET:
        return schedule, tile_n, f"{note}, within the {EPILOGUE_CODE_BUDGET} budget"
    widest, _ = choose_tile_n(problem, hw, epilogue, "cooperative", 128, pins)
    widths = [w for w in (256, 128, 64) if w <= widest and tile_refusal(problem, hw, epilogue, "cooperative", 128, w,
                                                                        pins) is None] or [widest]  # fmt: skip
    width = next((w for w in widths if epilogue_code(epilogue, "cooperative", 128, w) <= EPILOGUE_CODE_BUDGET),
                 widths[-1])  # fmt: skip
    return (
        "cooperative",
        width,
        (
            f"{note}, over the {EPILOGUE_CODE_BUDGET} budget (beyond it the unrolled epilogue evicts the mainloop "
            f"from the instruction cache): cooperative 128x{width} "
            f"({epilogue_code(epilogue, 'cooperative', 128, width)}) instead of {schedule} 128x{tile_n}"
        ),
    )


def best_tile_estimate(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, schedule: str, pins: tuple = ()
) -> tuple[float, int]:
    """(estimated seconds, tile N) of ``schedule``'s best 128-row tile."""
    width, _ = choose_tile_n(problem, hw, epilogue, schedule, 128, pins)
    return estimate_seconds(problem, hw, 128, width, epilogue, schedule), width


# ---- the one rule: what the kernel runs is what the planner may choose
#
# check_config is every check a planned config must pass (the config's own, blockwise promotion, the epilogue's
# tile needs, shared memory). The planner checks its final config with it, and before that filters its candidate
# tiles through it (tile_refusal: the config the planner would build around a candidate, its stages fitted, run
# through check_config), so a choice it makes is never refused: the refusals of the tiles it passes over are
# printed among explain's reasons.


def check_config(
    cfg: GemmConfig, problem: GemmProblem, epilogue: EpilogueBuffers = NO_EPILOGUE, smem_budget: int | None = None
) -> None:
    """Raise :class:`ConfigError` for a configuration the kernel cannot run for ``problem`` (as the kernel's
    tiles see it: swapped under ``swap_ab``) with ``epilogue``, within ``smem_budget`` bytes of shared memory
    (None: not checked)."""
    cfg.validate()
    if problem.block_scaled:
        validate_block_scaled(cfg)
    out_tile_n = epilogue.out_tile_n(cfg.tile_n)
    if epilogue.gated and out_tile_n % cfg.epi_tile[1]:
        raise ConfigError(
            f"epi_tile={cfg.epi_tile} with a gated epilogue: its N must divide the output tile's {out_tile_n} "
            f"columns (tile_n={cfg.tile_n} / 2)"
        )
    group_n = epilogue.group_n
    if group_n and out_tile_n % group_n:
        raise ConfigError(
            f"tile_n={cfg.tile_n} with quantize_groups: a tile must hold whole groups of {group_n} columns of D; "
            + ("use tile_n 256 (gated: half of it is output)" if epilogue.gated else "use tile_n 128 or 256")
        )
    if cfg.tile_k != problem.tile_k:
        raise ConfigError(
            f"tile_k={cfg.tile_k} with {problem.ab_dtype} inputs: a k-tile is one 128-byte swizzle row, "
            f"tile_k={problem.tile_k}"
        )
    if cfg.split_k > 1 and epilogue.loads_tiles:
        raise ConfigError(f"split_k={cfg.split_k} with an epilogue that reads full-tile operands: they stream "
                          "in ahead of the tile, before it is known which split runs the epilogue; use "
                          "split_k=1")  # fmt: skip
    if cfg.delay_tma_store and epilogue.chain and not epilogue.delayed_chain:
        raise ConfigError("delay_tma_store=True with this epilogue: its chain loads operand tiles through the TMA "
                          "ring (whose slot release the per-subtile barrier guards) or makes two passes over the "
                          "subtiles (quantize_groups); use delay_tma_store=False")  # fmt: skip
    if cfg.reuse_smem_c and (why := reuse_smem_c_blocker(problem, epilogue)):
        raise ConfigError(f"reuse_smem_c=True: {why}; use reuse_smem_c=False")
    if cfg.epi_reuses_ab_smem and not epi_fits_in_a_ring(cfg, problem.ab_dtype, problem.d_dtype):
        raise ConfigError(
            f"{cfg.num_epi_stages} D staging buffers of {epi_stage_bytes(cfg, problem.d_dtype)} B do not fit in "
            f"the A ring they would reuse ({cfg.ab_stages} stages); raise ab_stages or lower num_epi_stages"
        )
    if smem_budget is None:
        return
    total = smem_total(cfg, problem.ab_dtype, problem.d_dtype, epilogue, problem.block_scaled)
    if total > smem_budget:
        raise ConfigError(
            f"configuration needs {total} B of shared memory, over the {smem_budget} B "
            "per CTA; lower ab_stages or num_epi_stages"
        )


def _trial_configs(
    problem: GemmProblem, epilogue: EpilogueBuffers, schedule: str, tile_m: int, tile_n: int, pins: dict
) -> list[GemmConfig]:
    """The configs the planner may build around a candidate tile (its pins kept): persistent, and for the
    cooperative schedule one tile per CTA staging D in the A ring (the planner picks one by the tile count)."""
    base = {
        "schedule": schedule, "tile_m": tile_m, "tile_n": tile_n, "tile_k": problem.tile_k,
        "epi_tile": (epi_tile_m(schedule), epi_tile_n(epilogue.out_tile_n(tile_n))),
    }  # fmt: skip
    kept = {name: value for name, value in pins.items() if name not in ("schedule", "tile_m", "tile_n", "reasons")}
    forms = [{"persistent": True, "epi_reuses_ab_smem": False}]
    if schedule == "cooperative":
        forms.append({"persistent": False, "epi_reuses_ab_smem": True})
    return [GemmConfig(**{**base, **form, **kept}) for form in forms]


@functools.lru_cache(maxsize=4096)
def tile_refusal(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, schedule: str, tile_m: int, tile_n: int,
    pins: tuple = (),
) -> str | None:  # fmt: skip
    """Why no config the planner would build around a ``schedule`` ``tile_m x tile_n`` tile (``pins``: the caller's
    pinned fields, sorted items) passes :func:`check_config` on ``hw``; None when one does."""
    pinned = dict(pins)
    refusal = None
    for cfg in _trial_configs(problem, epilogue, schedule, tile_m, tile_n, pinned):
        try:
            if not {"ab_stages", "num_epi_stages"} & pinned.keys():
                cfg = fit_stages(cfg, problem, hw.smem_per_cta_bytes, epilogue)
            check_config(cfg, problem, epilogue, hw.smem_per_cta_bytes)
            return None
        except ConfigError as exc:
            refusal = refusal or str(exc)
    return refusal


def _short(refusal: str) -> str:
    """A refusal without its advice (what follows the first ``"; "``), for explain's reasons."""
    return refusal.split("; ")[0]


def schedule_refusal(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, schedule: str, pins: tuple = ()
) -> str | None:
    """Why none of ``schedule``'s 128-row tiles can run ``problem`` (their refusals), or None when one can."""
    preferred, fallback = tile_widths(problem, schedule)
    refusals = {w: tile_refusal(problem, hw, epilogue, schedule, 128, w, pins) for w in preferred + fallback}
    if any(refusal is None for refusal in refusals.values()):
        return None
    return "; ".join(f"128x{w}: {_short(refusal)}" for w, refusal in refusals.items())


def wave_fit_widths(problem: GemmProblem) -> tuple[int, ...]:
    """:data:`WAVE_FIT_TILE_N` where it tiles N exactly (14336, 28672: 64 and 128 tiles) and the inputs are 16-bit
    (as measured), else nothing: there its tile counts can end on a fuller last wave than 256's (bench/NOTES.md,
    'Cooperative 128x224 tiles')."""
    fits = problem.n % WAVE_FIT_TILE_N == 0 and problem.ab_dtype in ("bf16", "fp16")
    return (WAVE_FIT_TILE_N,) if fits else ()


def tile_widths(problem: GemmProblem, schedule: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(preferred, fallback)`` tile widths for ``problem`` under ``schedule``: the planner chooses among the
    preferred ones that can run the problem, and only where none can among the fallback ones (narrowest first)."""
    if problem.n <= 64:
        preferred: tuple[int, ...] = (64,)
    elif problem.n <= 128:
        preferred = (128,)
    elif problem.block_scaled:
        preferred = (192, 128, 64)
    else:
        preferred = (192, 128, 64) if schedule == "pingpong" else (256, *wave_fit_widths(problem), 128, 64)
    return preferred, tuple(w for w in TILE_N if w not in preferred)


def _block_scaled_partials(width: int) -> str:
    """How a blockwise tile ``width`` wide promotes (explain's reason)."""
    if width == 256:
        return (
            f"one k-tile's partial of half the tile's columns beside the sum (128 + 64 of {MAX_ACC_REGS} registers "
            "per thread): each k-tile's WGMMAs run as two 128-column halves, one block of N each, each promoted "
            "before the next starts, while the other warpgroup's WGMMAs run"
        )
    if width == 192:
        return (
            f"one k-tile's partial beside the sum (2 x {width // 2} registers per thread): each warpgroup promotes "
            "while the other's WGMMAs run"
        )
    return f"two k-tiles' partials beside the sum (3 x {width // 2} registers per thread)"


@functools.lru_cache(maxsize=1024)
def choose_tile_n(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers = NO_EPILOGUE, schedule: str = "cooperative",
    tile_m: int = 128, pins: tuple = (),
) -> tuple[int, str]:  # fmt: skip
    """(tile N, reason) of ``schedule``'s best tile ``tile_m`` rows tall for ``problem``, among the widths whose
    tiles can run it (:func:`tile_refusal`; the others' refusals are part of the reason); decided once per
    argument set (the schedule comparison and the final choice ask for the same tiles). Estimates are of 128-row
    tiles. Where no width can run it, the first preferred one: the final check then says why."""
    preferred, fallback = tile_widths(problem, schedule)
    refusals = {w: tile_refusal(problem, hw, epilogue, schedule, tile_m, w, pins) for w in preferred}
    excluded = "".join(f"; not {tile_m}x{w}: {_short(why)}" for w, why in refusals.items() if why is not None)
    widths = tuple(w for w in preferred if refusals[w] is None)
    if not widths:
        fallbacks = {w: tile_refusal(problem, hw, epilogue, schedule, tile_m, w, pins) for w in fallback}
        runnable = [w for w in fallback if fallbacks[w] is None]
        if not runnable:
            widths = preferred  # nothing runs: the final check refuses the preferred tile, with its reason
            excluded = ""
        else:
            width = runnable[0]
            how = f"; blockwise scales: promotion holds {_block_scaled_partials(width)}" if problem.block_scaled else ""
            return width, (
                f"{tile_m}x{width}, the narrowest tile that can run it, as none of the usual widths can ("
                + "; ".join(f"{tile_m}x{w}: {_short(why)}" for w, why in refusals.items())
                + f"){how}"
            )
    if len(widths) == 1 and len(preferred) == 1:
        return widths[0], f"N={problem.n} fits one {widths[0]}-wide tile{excluded}"
    # Widest first, so that a tie keeps the tile with the most reuse per byte.
    times = {width: estimate_seconds(problem, hw, 128, width, epilogue, schedule) for width in widths}
    best = min(times, key=times.__getitem__)
    others = ", ".join(f"{seconds * 1e6:.0f} us for 128x{width}" for width, seconds in times.items() if width != best)
    others = f" vs {others}" if others else ""
    if problem.block_scaled:
        estimate = f"128x{best} estimated {times[best] * 1e6:.0f} us{others}"
        return best, f"blockwise scales: promotion holds {_block_scaled_partials(best)}; {estimate}{excluded}"
    why = {preferred[0]: "", WAVE_FIT_TILE_N: f" (wave quantization: N in whole {WAVE_FIT_TILE_N}-wide tiles)",
           128: " (wave quantization)", 64: " (too few wider tiles to fill the SMs)"}.get(best, "")  # fmt: skip
    return best, f"128x{best} tiles estimated {times[best] * 1e6:.0f} us{others}{why}{excluded}"


def raster_window(
    problem: GemmProblem, tile_mn: tuple[int, int], cluster: tuple[int, int], band: int, clusters: int, along_m: bool
) -> tuple[int, int]:
    """(rows, columns) of the output that ``clusters`` clusters in flight cover at one moment when
    the tile scheduler walks bands of ``band`` clusters (across N, swept down M if ``along_m``)."""
    rows, cols = tile_mn[0] * cluster[0], tile_mn[1] * cluster[1]
    clusters_m, clusters_n = ceil_div(problem.m, rows), ceil_div(problem.n, cols)
    if along_m:
        width = min(band, clusters_n)
        return min(ceil_div(clusters, width), clusters_m) * rows, width * cols
    height = min(band, clusters_m)
    return height * rows, min(ceil_div(clusters, height), clusters_n) * cols


def reread_rows_and_columns(
    problem: GemmProblem, tile_mn: tuple[int, int], cluster: tuple[int, int], band: int
) -> dict[bool, int]:
    """For each walk (``along_m``: bands of ``band`` clusters across N, swept down M), the rows of A plus
    columns of B read over the whole output: a band keeps its own slice of one operand and re-reads all of
    the other (bands across N re-read A once per band of columns, bands across M B once per band of rows).
    The walks differ even where the tiles are square: a 2x1 cluster of them is twice as tall as wide."""
    rows, cols = tile_mn[0] * cluster[0], tile_mn[1] * cluster[1]
    clusters_m, clusters_n = ceil_div(problem.m, rows), ceil_div(problem.n, cols)
    return {
        True: problem.m * ceil_div(clusters_n, band) + problem.n,
        False: problem.m + problem.n * ceil_div(clusters_m, band),
    }


def choose_raster(
    problem: GemmProblem, tile_mn: tuple[int, int], cluster: tuple[int, int], band: int, in_flight: int
) -> tuple[bool, str]:
    """Whether bands run across N, swept down M (True), or across M, swept across N.

    Each band re-reads the operand it sweeps: bands across N read A once per band, bands across
    M B once per band, and the walk that re-reads fewer rows plus columns wins
    (:func:`reread_rows_and_columns`: mostly the one sweeping the longer output dimension, not
    for blockwise 128x128 tiles in 2x1 clusters at 16384x4096x4096, bench/NOTES.md 'Blockwise
    fp8: B's scale by bulk copy'). When M == N that is a tie, and the walk
    whose tiles in flight cover the squarer block of the output wins: every k-step those
    tiles read (rows + columns) x 64 elements from L2, and the squarer block re-uses more
    of them. Ping-pong's 128x192 tiles, two per SM, cover 4352x1536 one way and 2048x3264
    the other at 8192^3, and the squarer walk is the faster one (bench/NOTES.md, 'Raster by
    the window in flight')."""
    if problem.m != problem.n:
        rereads = reread_rows_and_columns(problem, tile_mn, cluster, band)
        along_m = rereads[True] < rereads[False] or (rereads[True] == rereads[False] and problem.m > problem.n)
        reread = "A" if along_m else "B"
        return along_m, (
            f"{reread} is re-read per band: {rereads[along_m]} rows of A plus columns of B per k over the output, "
            f"{rereads[not along_m]} the other way"
        )
    windows = {along_m: raster_window(problem, tile_mn, cluster, band, in_flight, along_m) for along_m in (True, False)}
    if sum(windows[True]) == sum(windows[False]):
        rows, cols = windows[True]
        return True, f"M == N: either walk covers {rows}x{cols} with the {in_flight} clusters in flight"
    along_m = sum(windows[True]) < sum(windows[False])
    (rows, cols), other = windows[along_m], windows[not along_m]
    return along_m, (
        f"M == N: the {in_flight} clusters in flight cover {rows}x{cols} instead of {other[0]}x{other[1]}, "
        "fewer A rows plus B columns per k-step"
    )


#: A split reduces over at least this many k-tiles: shorter ones spend more on their partial than they save.
MIN_SPLIT_K_TILES = 16
#: The most rows per batch the planner splits K for, and the most it widens the split tiles for.
SPLIT_K_MAX_M = 64
SPLIT_K_WIDE_M = 16
#: k-tiles from which a problem of at least ``LONG_K_SPLIT_MIN_MN`` rows and columns whose 128x128 tiles fill at
#: most half the SMs splits them in two (each split at least 64 k-tiles, its partial small against them): a weight
#: gradient over many tokens, ViT's 1024 x 1024 x 12608 (bench/NOTES.md: 1.23x the unsplit 128x64 tiles, in 2x1
#: clusters). Fewer rows stay unsplit: there the stream of B, not the CTAs, set the pace when last measured.
LONG_K_SPLIT_TILES = 128
LONG_K_SPLIT_MIN_MN = 512


def choose_split_k(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, schedule: str, tile_n: int, overrides: dict,
    tile_m: int = 128,
) -> tuple[int, int, str | None]:  # fmt: skip
    """``(split_k, tile_n, why)``: K split across CTAs when a decode-shaped problem (M <= ``SPLIT_K_MAX_M`` per
    batch) has too few tiles to keep the SMs streaming B, and the tile width that goes with it; ``why`` is
    None when there is nothing to say. Each split stores its tile's rows of fp32 partials: at M = 128 that
    traffic cost more than the extra CTAs gained. At M <= ``SPLIT_K_WIDE_M``, 128-wide tiles split in two
    beat 64-wide ones, split or not, and so they do for M and N of ``LONG_K_SPLIT_MIN_MN`` or more from
    ``LONG_K_SPLIT_TILES`` k-tiles (bench/NOTES.md)."""
    if "split_k" in overrides:
        return overrides["split_k"], tile_n, "requested"
    tiles, wide_tiles = _num_tiles(problem, 128, tile_n), _num_tiles(problem, 128, 128)
    k_tiles = ceil_div(problem.k, problem.tile_k)
    if (problem.block_scaled or epilogue.loads_tiles or schedule != "cooperative" or tiles == 0
            or k_tiles < 2 * MIN_SPLIT_K_TILES):  # fmt: skip
        return 1, tile_n, None
    wide_pins = tuple(sorted((k, v) for k, v in {**overrides, "split_k": 2}.items() if k != "reasons"))
    long_k = min(problem.m, problem.n) >= LONG_K_SPLIT_MIN_MN and k_tiles >= LONG_K_SPLIT_TILES
    if ((problem.m <= SPLIT_K_WIDE_M or long_k) and "tile_n" not in overrides and 2 * wide_tiles <= hw.num_sms
            and tile_refusal(problem, hw, epilogue, schedule, tile_m, 128, wide_pins) is None):  # fmt: skip
        return (
            2,
            128,
            (
                f"M = {problem.m}: {wide_tiles} tiles of 128x128 fill {wide_tiles / hw.num_sms:.0%} of the SMs; each "
                f"tile's {k_tiles} k-tiles run as 2 splits; the last split of a tile to finish adds the fp32 "
                "partials in split order (deterministic) and runs the epilogue"
            ),
        )
    if problem.m > SPLIT_K_MAX_M:
        return 1, tile_n, None
    if 2 * tiles > hw.num_sms:
        return 1, tile_n, None
    split = min(MAX_SPLIT_K, hw.num_sms // tiles, k_tiles // MIN_SPLIT_K_TILES)
    return (
        split,
        tile_n,
        (
            f"{tiles} tiles fill {tiles / hw.num_sms:.0%} of the SMs: each tile's {k_tiles} k-tiles run as {split} "
            f"splits on {tiles * split} CTAs; the last split of a tile to finish adds the fp32 partials in split order "
            "(deterministic) and runs the epilogue"
        ),
    )


#: The most rows (M per batch) a swap-AB plan is always chosen for (its tile's N holds them all), and the most
#: it is chosen for where 128-row tiles of A would leave half the SMs idle and K is long enough to split in two.
SWAP_AB_MAX_M = 64
SWAP_AB_WIDE_MAX_M = 128
#: k-tiles each of the two splits of a wide swapped tile runs at least: its 128 x M fp32 partial costs more than
#: the extra CTAs gain over shorter splits (bench/NOTES.md: 128x4096x4096 lost 8 %, K = 8192 and more gained).
SWAP_AB_WIDE_SPLIT_K_TILES = 64
#: Swapped tiles at least this wide (M > 48 rows of A) are 64-row ping-pong tiles: at M = 64 a 128-row CTA's stages
#: carry half as many activation bytes as weight bytes, and twice the CTAs (no split) kept the weight stream
#: faster than 128-row tiles split in two (bench/NOTES.md, 'L2 evict-first for decode GEMMs').
SWAP_AB_PINGPONG_MIN_N = 64
#: A swapped plan splits K until its CTAs fill this share of the SMs: with the weight loaded evict-first, half of
#: them keep HBM streaming, and each further split only adds partials and the last split's serial reduction.
SWAP_AB_SPLIT_SM_SHARE = 0.5
#: Widths of the swapped 256-row tile (the weight's rows as the MMA's M, two warpgroups of 128 rows each): M in a few
#: tiles of one of these where 128-row tiles of A would take a wave more (cuBLAS runs 1000 x 14336 x 4096 as
#: 256 x 144). Wider ones need more than the 192 accumulator registers a thread may hold.
WIDE_SWAP_TILE_N = tuple(range(128, 193, 16))
#: A plain GEMM of fewer rows than this (A in at most 3 tiles of 128 rows) takes a swapped 256-row tile where the
#: roofline puts it :data:`WIDE_SWAP_MIN_GAIN` ahead of cooperative 128x256 tiles of A: there a whole wave is saved
#: (300 x 14336 x 4096: 29 % estimated, 35-42 % measured over the planned ping-pong tiles). From 512 rows the estimate
#: misleads: 1000 x 5000 x 3000 lost 9 % to the planned ping-pong tiles, 2000 x 14336 x 4096 2 % (bench/NOTES.md,
#: 'Swapped 256-row tiles for mid-size M').
WIDE_SWAP_MAX_M = 512
WIDE_SWAP_MIN_GAIN = 0.25
#: From :data:`WIDE_SWAP_MAX_M` to this many rows a plain GEMM takes a swapped cooperative 128-row tile whose width
#: fits M in the fewest tiles of at most 256 (:func:`fitted_swap_width`; cuBLAS runs 777 rows as 128 x 200 tiles)
#: where 128-row tiles of A pad M by :data:`FITTED_SWAP_MIN_FIT` times as many rows or more, the width is at most
#: :data:`FITTED_SWAP_MAX_WIDTH`, K has :data:`FITTED_SWAP_MIN_K_TILES` k-tiles and the swapped tiles fill half the
#: SMs. Measured (bench/NOTES.md, 'Swapped 128-row tiles that fit M'), against the unswapped plan: 777 rows as 4 x 208
#: (896 / 832 = 1.077) 1.02-1.18x at N of 4096 to 28672 and K of 4096 or 14336, 800 rows 1.14x, 513 and 520 rows as
#: 3 x 176 1.29-1.40x; but 240-wide tiles lost (700 rows 0.86x, 900 rows 0.95x; 960 x 8192 x 8192 1.04x), as did
#: 777 x 1024 x 4096 (32 tiles, 0.82x) and K = 264 (0.92x), and 1000 rows (5 x 208 against 8 x 128) 0.63-0.89x. The
#: roofline is not the judge here: it misranked these.
FITTED_SWAP_MAX_M = 1024
FITTED_SWAP_MIN_FIT = 1.06
FITTED_SWAP_MAX_WIDTH = 208
FITTED_SWAP_MIN_K_TILES = 16
#: In the same range, swapped 256-row tiles of one of these widths replace the plan where the roofline puts them
#: :data:`WAVE_SWAP_MIN_GAIN` ahead of it: their count fills the last wave (cuBLAS runs 777 x 14336 x 4096 as
#: 392 tiles of 256 x 112, 2.97 waves, where 128 x 208 tiles take 448, 3.39). Measured against the plan they
#: replaced (bench/NOTES.md, 'Swapped 256-row tiles that fill the last wave'): 777 x 14336 x 4096 as 256 x 112
#: 1.16-1.17x, 520 x 8192 x 4096 as 256 x 144 1.14-1.19x, 600 x 14336 x 4096 as 256 x 160 1.20-1.23x; where the
#: roofline puts them behind they lost (0.81-0.98x). Narrower tiles lost wherever the roofline put them ahead
#: (600 rows as 256 x 96 1.00x, 1024 rows as 256 x 64 0.66x): they are no candidates.
WAVE_SWAP_TILE_N = tuple(range(112, 193, 16))
WAVE_SWAP_MIN_GAIN = 0.05
#: Pins that fix the unswapped kernel's tile shape: the planner swaps only where they are not given.
_TILE_PINS = frozenset(("schedule", "tile_m", "tile_n", "cluster_m", "cluster_n", "epi_tile"))


def swap_ab_refusal(problem: GemmProblem, epilogue: EpilogueBuffers) -> str | None:
    """Why a swap-AB kernel cannot run ``problem`` with ``epilogue``, or None when it can."""
    if problem.ab_dtype not in ("bf16", "fp16") or problem.d_dtype not in ("bf16", "fp16", "fp32"):
        return f"{problem.ab_dtype} inputs with {problem.d_dtype} D (swap-AB takes 16-bit inputs and a 16/32-bit D)"
    if problem.l != 1:
        return f"L = {problem.l} batches (swap-AB plans one)"
    if epilogue.transposed() is None:
        return "an epilogue with tile operands, aux tiles, reductions, group quantization or gating"
    return None


def choose_cluster_pair(
    problem: GemmProblem, hw: Target, schedule: str, tile_m: int, tile_n: int
) -> tuple[tuple[int, int], str]:
    """``(cluster, why)`` for a problem of enough tiles to pair them: 2x1 (B multicast to two M-neighbours) unless
    pairing an odd number of row tiles adds a wave of clusters (the last pair's idle peer holds an SM all the
    while): then 1x2 (A multicast to two N-neighbours) where that adds none, else 1x1."""
    tiles_m, tiles_n = ceil_div(problem.m, tile_m), ceil_div(problem.n, tile_n)
    in_flight = hw.num_sms * (2 if schedule == "pingpong" else 1)  # a ping-pong CTA holds two tiles

    def waves(cluster_m: int, cluster_n: int) -> int:
        cluster = (cluster_m, cluster_n)
        return ceil_div(cluster_ctas(problem, tile_m, tile_n, cluster), cta_slots(in_flight, cluster))

    alone, paired = waves(1, 1), waves(2, 1)
    if paired <= alone:
        return (2, 1), "cluster 2x1: B tiles multicast to 2 CTAs, halving B's L2->SM traffic"
    padded = (f"pairs along M would pad {tiles_m} rows of tiles to {tiles_m + 1}: {paired} waves of clusters "
              f"against {alone} unpaired")  # fmt: skip
    if tiles_n >= 2 and waves(1, 2) <= alone:
        return (1, 2), f"cluster 1x2: A tiles multicast to 2 CTAs, halving A's L2->SM traffic ({padded})"
    return (1, 1), f"cluster 1x1: {padded}, and pairs along N too"


def choose_persistent(tiles: int, cluster_ctas: int, hw: Target, overrides: dict) -> tuple[bool, str]:
    """``(persistent, why)`` for ``tiles`` work units (every split of every tile) run by clusters of
    ``cluster_ctas``: persistent when they outnumber the clusters the SMs hold at once."""
    if "persistent" in overrides:
        persistent = overrides["persistent"]
        return persistent, f"{'persistent' if persistent else 'one tile per CTA'}: requested"
    max_clusters = hw.num_sms // cluster_ctas
    if ceil_div(tiles, cluster_ctas) > max_clusters:
        return True, (
            f"persistent grid of {max_clusters * cluster_ctas} CTAs over {tiles} tiles: "
            "tile i's epilogue overlaps tile i+1's mainloop, so D gets its own smem"
        )
    return False, f"one tile per CTA ({tiles} tiles <= {hw.num_sms} SMs): D staging reuses the idle A ring"


def choose_swap_ab(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, overrides: dict) -> tuple[bool, str]:
    """``(swap, why)``: whether the kernel computes D^T = B^T A^T. Chosen for decode shapes -- at most
    :data:`SWAP_AB_MAX_M` rows of A against a wider N (up to :data:`SWAP_AB_WIDE_MAX_M` where 128x64 tiles would
    leave half the SMs idle and K splits in two long halves), B the transpose of a row-major weight, A row-major --
    where the epilogue has a transpose (:meth:`EpilogueBuffers.transposed`) and no pin fixes the unswapped tile:
    a 128-row tile of A would compute 128 - M rows of zeros and carry them through shared memory, while B^T's
    N fills the MMA's 128 rows and the few rows of A a narrow N tile."""
    if "swap_ab" in overrides:
        refusal = swap_ab_refusal(problem, epilogue) if overrides["swap_ab"] else None
        if refusal:
            raise ConfigError(f"swap_ab=True with {refusal}; use swap_ab=False")
        return overrides["swap_ab"], "requested"
    if (_TILE_PINS & set(overrides) or not 0 < problem.m <= SWAP_AB_WIDE_MAX_M or problem.n <= problem.m
            or (problem.a_major, problem.b_major) != ("k", "k") or problem.block_scaled
            or swap_ab_refusal(problem, epilogue)):  # fmt: skip
        return False, ""
    if problem.m > SWAP_AB_MAX_M:
        tiles, k_tiles = _num_tiles(problem, 128, 64), ceil_div(problem.k, problem.tile_k)
        if 2 * tiles > hw.num_sms or k_tiles < 2 * SWAP_AB_WIDE_SPLIT_K_TILES:
            return False, ""
        return True, (
            f"M = {problem.m} rows against N = {problem.n}, K = {problem.k}: 128x64 tiles of A would be {tiles}, "
            f"half the SMs idle, each CTA reading all {problem.m} rows of A for 64 weight rows; the kernel computes "
            "D^T = B^T A^T, 128 weight rows by M per tile, K split in two; D^T's tiles are stored column-major "
            "into D, row and column vectors trade places"
        )
    return True, (
        f"M = {problem.m} rows against N = {problem.n}: the kernel computes D^T = B^T A^T, so B^T's rows fill the "
        f"MMA's M side and A's {problem.m} rows a narrow N (a 128-row tile of A would compute "
        f"{128 - problem.m} rows of zeros); D^T's tiles are stored column-major into D, row and column vectors "
        "trade places"
    )


def _swap_ab_config(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, swap_why: str, overrides: dict, planned: str = ""
) -> GemmConfig:
    """The swap-AB plan: the kernel's problem is D^T = B^T A^T (``problem.swapped()``), 128 rows of B^T by M
    rounded up to 16 (cooperative, K split across CTAs while they fill under half the SMs), or for M > 48 64-row
    ping-pong tiles, unsplit; no cluster. ``planned``: why :func:`choose_wide_swap` chose the tile ``overrides``
    holds (they are its, not the caller's pins; its tiles are never split)."""
    kernel, kernel_epi = problem.swapped(), epilogue.transposed()
    tile_n = overrides.get("tile_n", min(n for n in SWAP_AB_TILE_N if n >= min(kernel.n, SWAP_AB_TILE_N[-1])))
    k_tiles = ceil_div(problem.k, problem.tile_k)
    pingpong = overrides.get("schedule", "pingpong" if (
        tile_n >= SWAP_AB_PINGPONG_MIN_N and problem.m <= SWAP_AB_MAX_M and overrides.get("split_k", 1) == 1
    ) else "cooperative") == "pingpong"  # fmt: skip
    tile_m = overrides.get("tile_m", 64 if pingpong else 128)
    reasons = [f"swap_ab: {swap_why}"]
    if pingpong:
        reasons.append(
            f"schedule pingpong: 64-row tiles, so {_num_tiles(kernel, 64, tile_n)} CTAs stream the weight without "
            f"a split's partials (at M = {problem.m} a 128-row tile's stages carry {tile_n} activation rows per "
            "128 weight rows)"
        )
    else:
        rows = tile_m // 2
        reasons.append(f"schedule cooperative: the two consumer warpgroups take {rows} rows of B^T each")
    if planned:
        reasons.append(f"tile {tile_m}x{tile_n}x{kernel.tile_k} of D^T: {planned}")
    else:
        reasons.append(
            f"tile {tile_m}x{tile_n}x{kernel.tile_k} of D^T: {tile_m} of N's {problem.n} rows by M = {problem.m} "
            "rounded up to a multiple of 16 (WGMMA N; one stmatrix atom of the transposed store)"
        )
    reasons.append("cluster 1x1: a cluster peer would share only the few rows of A")
    tiles = _num_tiles(kernel, tile_m, tile_n)
    if "split_k" in overrides:
        split_k = overrides["split_k"]
        reasons.append(f"split_k {split_k}: requested")
    elif pingpong or planned:
        split_k = 1
    elif problem.m > SWAP_AB_MAX_M:  # choose_swap_ab swaps these for two long splits (a pinned swap may be short)
        split_k = 2 if k_tiles >= 2 * SWAP_AB_WIDE_SPLIT_K_TILES else 1
        if split_k == 2:
            reasons.append(
                f"split_k 2: {tiles} tiles of {k_tiles} k-tiles run as 2 splits on {2 * tiles} CTAs; a split's "
                f"partial is a 128x{tile_n} fp32 tile, and more splits cost more in partials than their CTAs gained "
                "(measured)"
            )
    else:
        streaming = int(hw.num_sms * SWAP_AB_SPLIT_SM_SHARE)
        split_k = max(1, min(MAX_SPLIT_K, streaming // max(tiles, 1), k_tiles // MIN_SPLIT_K_TILES))
        if split_k > 1:
            reasons.append(
                f"split_k {split_k}: {tiles} tiles fill {tiles / hw.num_sms:.0%} of the SMs: each tile's {k_tiles} "
                f"k-tiles run as {split_k} splits on {tiles * split_k} CTAs (up to {streaming}, half the SMs, keep "
                "the weight streaming); the last split of a tile to finish adds the fp32 partials in split order "
                "(deterministic) and runs the epilogue"
            )
    work = tiles * split_k
    if pingpong and "persistent" not in overrides:
        persistent, why = True, "persistent: the ping-pong warpgroups take alternate tiles of each CTA"
    else:
        persistent, why = choose_persistent(work, 1, hw, overrides)
    reasons.append(why)
    if "raster_along_m" in overrides:
        raster_along_m, raster_why = overrides["raster_along_m"], "requested"
    else:
        raster_along_m, raster_why = True, "B^T, the weight, is read once per band of D^T's rows"
    cfg = GemmConfig(  # pins of the tile M or cluster are kept for validate() to refuse
        schedule="pingpong" if pingpong else "cooperative",
        tile_m=tile_m,
        tile_n=tile_n,
        tile_k=overrides.get("tile_k", kernel.tile_k),
        cluster_m=overrides.get("cluster_m", 1),
        cluster_n=overrides.get("cluster_n", 1),
        persistent=persistent,
        epi_tile=overrides.get(
            "epi_tile", (epi_tile_m("pingpong" if pingpong else "cooperative"), epi_tile_n(tile_n))
        ),
        epi_reuses_ab_smem=overrides.get("epi_reuses_ab_smem", not persistent),
        raster_along_m=raster_along_m,
        swizzle=overrides.get("swizzle", 8),
        split_k=split_k,
        swap_ab=True,
    )
    return _fit_and_check(cfg, kernel, hw, kernel_epi, overrides, reasons, raster_why)


def fit_stages(cfg: GemmConfig, problem: GemmProblem, budget: int, epi: EpilogueBuffers = NO_EPILOGUE) -> GemmConfig:
    """Largest A/B ring, then deepest D staging, that fit in ``budget`` bytes.

    The fused epilogue's buffers (``epi``: operand rings, aux staging, vectors)
    are paid first; they scale with ``num_epi_stages`` too, so deeper D staging
    is only bought when every output's ring still fits.
    """
    ab, d, scaled = problem.ab_dtype, problem.d_dtype, problem.block_scaled
    best = None
    for ab_stages in range(MAX_AB_STAGES, 1, -1):
        trial = replace(cfg, ab_stages=ab_stages, num_epi_stages=MIN_EPI_STAGES)
        if trial.epi_reuses_ab_smem and not epi_fits_in_a_ring(trial, ab, d):
            continue
        if smem_total(trial, ab, d, epi, scaled) <= budget:
            best = trial
            break
    if best is None:
        raise ConfigError(
            f"tile {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} does not fit 2 A/B stages in "
            f"{budget} bytes of shared memory next to the epilogue's "
            f"{epilogue_smem_bytes(cfg, ab, d, epi, scaled)} B; use a smaller tile (config={{'tile_n': 128}})"
        )
    for epi_stages in range(MAX_EPI_STAGES, MIN_EPI_STAGES, -1):
        trial = replace(best, num_epi_stages=epi_stages)
        if trial.epi_reuses_ab_smem and not epi_fits_in_a_ring(trial, ab, d):
            continue
        if smem_total(trial, ab, d, epi, scaled) <= budget:
            return trial
    return best


#: K = 0 with an epilogue is an elementwise pass over the epilogue's operands (a backward's gradient pass). No
#: mainloop runs to hide an epilogue under, so both warpgroups work on one tile's epilogue, and the shared memory
#: the A/B ring would take deepens the operand loads instead. Measured on the H200 (bench/NOTES.md, issue 57's
#: gradient pass): ping-pong 128x128 with 2 operand stages 644 us, cooperative 128x256 with 4 444 us, cooperative
#: 128x128 with 6 366 us.
EPILOGUE_PASS_WHY = "K = 0: an elementwise pass, both warpgroups on one tile's epilogue (no mainloop to overlap)"
EPILOGUE_PASS_C_STAGES = 6


def fit_epilogue_pass_stages(cfg: GemmConfig, problem: GemmProblem, budget: int, epi: EpilogueBuffers) -> GemmConfig:
    """A K = 0 pass's stages: the fewest A/B stages, the deepest operand-load ring up to
    :data:`EPILOGUE_PASS_C_STAGES` that fits, then the deepest D staging."""
    ab, d, scaled = problem.ab_dtype, problem.d_dtype, problem.block_scaled
    for c_stages in range(EPILOGUE_PASS_C_STAGES, 0, -1):
        trial = replace(cfg, ab_stages=2, num_c_stages=c_stages, num_epi_stages=MIN_EPI_STAGES)
        if smem_total(trial, ab, d, epi, scaled) <= budget:
            break
    for epi_stages in range(MAX_EPI_STAGES, MIN_EPI_STAGES, -1):
        deeper = replace(trial, num_epi_stages=epi_stages)
        if smem_total(deeper, ab, d, epi, scaled) <= budget:
            return deeper
    return trial


def choose_config(
    problem: GemmProblem, hw: Target = H100_SXM, epilogue: EpilogueBuffers = NO_EPILOGUE, **overrides
) -> GemmConfig:
    """The planner's configuration for ``problem``; keyword overrides pin any field.

    ``epilogue`` is what a fused epilogue needs in shared memory; the A/B ring
    gives way to it.

    Overridden fields are kept as given (and validated); the planner still fits
    whatever the caller left open (e.g. stages) around them.
    """
    unknown = set(overrides) - set(GemmConfig.__dataclass_fields__) - {"reasons"}
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {sorted(unknown)}; known: {sorted(GemmConfig.__dataclass_fields__)}"
        )
    swap, swap_why = choose_swap_ab(problem, hw, epilogue, overrides)
    if swap:
        return _swap_ab_config(problem, hw, epilogue, swap_why, overrides)
    if overrides:
        return _unswapped_config(problem, hw, epilogue, overrides)
    planned = choose_wide_swap(problem, hw, epilogue) or _unswapped_config(problem, hw, epilogue, overrides)
    return choose_wave_swap(problem, hw, epilogue, planned) or planned


def wide_swap_refusal(problem: GemmProblem, epilogue: EpilogueBuffers = NO_EPILOGUE) -> str | None:
    """Why a swapped 256-row tile is no candidate for ``problem`` (None when it is): M past a wide swap-AB plan's
    rows and under N, and nothing swap-AB refuses (one batch of 16-bit inputs, a 16/32-bit D)."""
    if problem.m <= SWAP_AB_WIDE_MAX_M or problem.n <= problem.m:
        return f"M = {problem.m} is not between {SWAP_AB_WIDE_MAX_M} and N = {problem.n}"
    return swap_ab_refusal(problem, epilogue)


def fitted_swap_width(m: int) -> int:
    """The narrowest swapped tile width (a multiple of 16) that fits ``m`` rows in the fewest tiles of at most 256."""
    tiles = ceil_div(m, SWAP_AB_TILE_N[-1])
    return ceil_div(ceil_div(m, tiles), 16) * 16


def _plain_mid_m_swappable(problem: GemmProblem, epilogue: EpilogueBuffers) -> bool:
    """Whether the mid-M swap rules (:func:`choose_wide_swap`, :func:`choose_wave_swap`) may consider ``problem``: a
    plain GEMM (no epilogue chain, no block scales) of row-major A, at most :data:`FITTED_SWAP_MAX_M` rows, that a
    swapped 256-row tile could run (:func:`wide_swap_refusal`)."""
    return not (epilogue.chain or problem.a_major != "k" or problem.block_scaled or problem.m > FITTED_SWAP_MAX_M
                or wide_swap_refusal(problem, epilogue))  # fmt: skip


def choose_wide_swap(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers) -> GemmConfig | None:
    """A swapped plan for a plain GEMM of mid-size M, else None. Under :data:`WIDE_SWAP_MAX_M` rows: cooperative
    256-row tiles where their roofline beats cooperative 128x256 tiles of A by :data:`WIDE_SWAP_MIN_GAIN` (a wave
    saved), the :data:`WIDE_SWAP_TILE_N` width estimated fastest. Up to :data:`FITTED_SWAP_MAX_M`: cooperative
    128-row tiles :func:`fitted_swap_width` wide, where they pad M :data:`FITTED_SWAP_MIN_FIT` times less than
    128-row tiles of A. A row-major; B a weight's transpose or ``(K, N)`` row-major (the swapped 256 x 144 ran alike
    on both at 1000 rows)."""
    if not _plain_mid_m_swappable(problem, epilogue):
        return None
    if problem.m >= WIDE_SWAP_MAX_M:
        return _fitted_swap(problem, hw, epilogue)
    planned = roofline(problem, hw, 128, 256).predicted_s
    width, best = _fastest_swapped_256(problem, hw, epilogue, WIDE_SWAP_TILE_N)
    if best.predicted_s > (1 - WIDE_SWAP_MIN_GAIN) * planned:
        return None
    why = (
        f"M = {problem.m} rows against N = {problem.n}: 256 x {width} tiles of D^T = B^T A^T (M in "
        f"{ceil_div(problem.m, width)} tiles of {width}) estimated {best.predicted_s * 1e6:.0f} us vs "
        f"{planned * 1e6:.0f} us for cooperative 128x256 tiles of A (a wave saved); D^T's tiles are stored "
        "column-major into D"
    )
    return _swapped_256_config(problem, hw, epilogue, width, WIDE_SWAP_TILE_N, why)


def choose_wave_swap(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, planned: GemmConfig
) -> GemmConfig | None:
    """Swapped 256-row tiles for a plain GEMM of :data:`WIDE_SWAP_MAX_M` to :data:`FITTED_SWAP_MAX_M` rows where
    their count fills the last wave: the :data:`WAVE_SWAP_TILE_N` width the roofline estimates fastest, where it
    puts it :data:`WAVE_SWAP_MIN_GAIN` ahead of ``planned`` (else None)."""
    if (problem.m < WIDE_SWAP_MAX_M or ceil_div(problem.k, problem.tile_k) < FITTED_SWAP_MIN_K_TILES
            or not _plain_mid_m_swappable(problem, epilogue)):  # fmt: skip
        return None
    width, best = _fastest_swapped_256(problem, hw, epilogue, WAVE_SWAP_TILE_N)
    before = predicted(problem, hw, planned, epilogue)
    if best.predicted_s > (1 - WAVE_SWAP_MIN_GAIN) * before.predicted_s:
        return None
    was = "swapped " if planned.swap_ab else ""
    why = (
        f"M = {problem.m} rows against N = {problem.n}: {best.waves:.2f} waves of 256 x {width} tiles of D^T = B^T A^T "
        f"estimated {best.predicted_s * 1e6:.0f} us against {before.predicted_s * 1e6:.0f} us for {before.waves:.2f} "
        f"waves of {was}{planned.tile_m} x {planned.tile_n} tiles (the last wave filled; measured 1.09-1.43x at "
        "520-960 rows); D^T's tiles are stored column-major into D"
    )
    return _swapped_256_config(problem, hw, epilogue, width, WAVE_SWAP_TILE_N, why)


def _fastest_swapped_256(
    problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, widths: tuple
) -> tuple[int, Roofline]:
    """The width of ``widths`` whose swapped 256-row tiles the roofline estimates fastest, and that estimate."""
    kernel, kernel_epi = problem.swapped(), epilogue.transposed()
    estimates = {w: roofline(kernel, hw, 256, w, epilogue=kernel_epi) for w in widths}
    width = min(estimates, key=lambda w: estimates[w].predicted_s)
    return width, estimates[width]


def _swapped_256_config(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, width: int, widths: tuple,
                        why: str) -> GemmConfig:  # fmt: skip
    tile_why = f"M = {problem.m} in {ceil_div(problem.m, width)} tiles of {width} (estimated fastest of {widths})"
    return _swap_ab_config(problem, hw, epilogue, why, {"schedule": "cooperative", "tile_m": 256, "tile_n": width},
                           planned=tile_why)  # fmt: skip


def predicted(
    problem: GemmProblem, hw: Target, config: GemmConfig, epilogue: EpilogueBuffers = NO_EPILOGUE
) -> Roofline:
    """The roofline of ``config`` running ``problem`` (D^T's, where it swaps), as ``explain`` prints it."""
    kernel, kernel_epi = (problem.swapped(), epilogue.transposed()) if config.swap_ab else (problem, epilogue)
    return roofline(kernel, hw, config.tile_m, config.tile_n, config.tile_k, kernel_epi, config.schedule,
                    config.split_k, (config.cluster_m, config.cluster_n))  # fmt: skip


def _fitted_swap(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers) -> GemmConfig | None:
    """:func:`choose_wide_swap`'s 128-row tiles of D^T that fit M (see :data:`FITTED_SWAP_MAX_M`), or None."""
    width = fitted_swap_width(problem.m)
    tiles = ceil_div(problem.m, width)
    padded, fitted = ceil_div(problem.m, 128) * 128, tiles * width
    if (padded < FITTED_SWAP_MIN_FIT * fitted or width > FITTED_SWAP_MAX_WIDTH
            or ceil_div(problem.k, problem.tile_k) < FITTED_SWAP_MIN_K_TILES
            or 2 * ceil_div(problem.n, 128) * tiles < hw.num_sms):  # fmt: skip
        return None
    why = (
        f"M = {problem.m} rows against N = {problem.n}: 128 x {width} tiles of D^T = B^T A^T hold M in {tiles} tiles "
        f"({fitted} rows) where 128-row tiles of A pad it to {padded} ({padded / fitted:.3f}x the work; measured "
        "1.02-1.40x at 513-800 rows); D^T's tiles are stored column-major into D"
    )
    tile_why = f"M = {problem.m} in {tiles} tiles of {width}: the fewest of at most 256, as narrow as they fit"
    return _swap_ab_config(problem, hw, epilogue, why, {"schedule": "cooperative", "tile_m": 128, "tile_n": width},
                           planned=tile_why)  # fmt: skip


def _unswapped_config(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, overrides: dict) -> GemmConfig:
    """The plan of A's rows as the MMA's M (:func:`choose_config` without swap-AB)."""
    # The pins every candidate of the planner keeps (tile_refusal builds its configs around them).
    pins = tuple(sorted((name, value) for name, value in overrides.items() if name != "reasons"))
    if "schedule" in overrides:
        schedule, schedule_why = overrides["schedule"], "requested"
    elif problem.block_scaled:
        schedule, schedule_why = (
            "cooperative",
            (
                "blockwise scales: a ping-pong warpgroup's 128x128 accumulators, tripled for promotion, exceed its "
                "registers, and its 64-row tiles halve the reuse of B"
            ),
        )
    elif overrides.get("tile_n") == 256:
        schedule, schedule_why = "cooperative", "a 128x256 tile needs both warpgroups' registers"
    elif overrides.get("persistent") is False or overrides.get("epi_reuses_ab_smem"):
        schedule, schedule_why = "cooperative", "one tile per CTA leaves a ping-pong warpgroup idle"
    elif problem.k == 0:
        schedule, schedule_why = "cooperative", EPILOGUE_PASS_WHY
    else:
        tile_pinned = bool({"tile_m", "tile_n", "epi_tile"} & set(overrides))
        schedule, schedule_why = choose_schedule(problem, hw, epilogue, tile_pinned, pins)
    tile_m = overrides.get("tile_m", 128)
    tile_n = overrides.get("tile_n")
    if tile_n is None and problem.k == 0:
        tile_n, tile_why = 128, "K = 0: 128 columns (faster than 256 for an elementwise pass, bench/NOTES.md)"
    elif tile_n is None:
        tile_n, tile_why = choose_tile_n(problem, hw, epilogue, schedule, tile_m, pins)
    else:
        tile_why = "requested"
    code_why = None
    if epilogue.instructions_per_element and tile_m == 128 and problem.k:
        pinned = {"schedule", "tile_n"} & set(overrides)
        if pinned:
            code = epilogue_code(epilogue, schedule, tile_m, tile_n)
            code_why = (f"epilogue code ~{code} instructions per thread ({EPILOGUE_CODE_BUDGET} budget; "
                        f"{' and '.join(sorted(pinned))} requested)")  # fmt: skip
        else:
            fitted_schedule, fitted_n, code_why = fit_epilogue_code(problem, hw, epilogue, schedule, tile_n, pins)
            if (fitted_schedule, fitted_n) != (schedule, tile_n):
                schedule, tile_n = fitted_schedule, fitted_n
                schedule_why = tile_why = "the epilogue's code (below)"
    reasons = [f"schedule {schedule}: {schedule_why}", f"tile {tile_m}x{tile_n}x{problem.tile_k}: {tile_why}"]
    if code_why:
        reasons.append(code_why)
    tiles = _num_tiles(problem, tile_m, tile_n)
    tiles_m = ceil_div(problem.m, tile_m)

    if "cluster_m" in overrides or "cluster_n" in overrides:
        cluster = (overrides.get("cluster_m", 1), overrides.get("cluster_n", 1))
        reasons.append(f"cluster {cluster[0]}x{cluster[1]}: requested")
    elif tiles_m >= 2 and 2 * tiles >= hw.num_sms:
        cluster, cluster_why = choose_cluster_pair(problem, hw, schedule, tile_m, tile_n)
        reasons.append(cluster_why)
    else:
        cluster = (1, 1)
        reasons.append(
            f"cluster 1x1: {tiles} tile(s) in {tiles_m} row(s) of tiles fill under half a wave; "
            "a cluster peer would idle an SM"
        )

    split_k, split_tile_n, split_why = choose_split_k(problem, hw, epilogue, schedule, tile_n, overrides, tile_m)
    if split_tile_n != tile_n:
        tile_n = split_tile_n
        reasons[1] = f"tile {tile_m}x{tile_n}x{problem.tile_k}: split K (below)"
    if split_why:
        reasons.append(f"split_k {split_k}: {split_why}")
    tiles = _num_tiles(problem, tile_m, tile_n) * split_k  # work units below: every split of every tile
    max_clusters = hw.num_sms // (cluster[0] * cluster[1])
    if schedule == "pingpong" and "persistent" not in overrides:
        persistent = True
        reasons.append("persistent: the ping-pong warpgroups take alternate tiles of each CTA")
    else:
        persistent, why = choose_persistent(tiles, cluster[0] * cluster[1], hw, overrides)
        reasons.append(why)

    if "raster_along_m" in overrides:
        raster_along_m, raster_why = overrides["raster_along_m"], "requested"
    else:
        # A ping-pong CTA has two tiles in flight, so its clusters count twice.
        in_flight = max_clusters * (2 if schedule == "pingpong" else 1)
        raster_along_m, raster_why = choose_raster(
            problem, (tile_m, tile_n), cluster, overrides.get("swizzle", 8), in_flight
        )
    cfg = GemmConfig(
        schedule=schedule,
        tile_m=tile_m,
        tile_n=tile_n,
        tile_k=overrides.get("tile_k", problem.tile_k),
        cluster_m=cluster[0],
        cluster_n=cluster[1],
        persistent=persistent,
        epi_tile=overrides.get(
            "epi_tile", (epi_tile_m(schedule), epi_tile_n(epilogue.out_tile_n(tile_n)))
        ),
        epi_reuses_ab_smem=overrides.get("epi_reuses_ab_smem", not persistent),
        raster_along_m=raster_along_m,
        swizzle=overrides.get("swizzle", 8),
        split_k=split_k,
    )
    return _fit_and_check(cfg, problem, hw, epilogue, overrides, reasons, raster_why)


#: The operand ring's depths tried when D is staged in it (ReuseSmemC), deepest first: one stage more than the
#: stores in flight (CUTLASS's builder takes ``max(min(subtiles, 4), stages_d + 1)``).
REUSE_C_STAGES = (4, 3)


def reuse_smem_c_blocker(problem: GemmProblem, epilogue: EpilogueBuffers) -> str:
    """Why this epilogue cannot stage D in its first operand tile's ring ('' where it can)."""
    if not epilogue.tile_inputs:
        return "the epilogue loads no operand tile to stage D in"
    if epilogue.tile_inputs[0] != problem.d_dtype:
        return f"operand tile 0 is {epilogue.tile_inputs[0]} and D {problem.d_dtype}: their subtiles must match"
    if epilogue.aux_outputs:
        return "the epilogue stores aux tiles, whose staging ring D shares its position with"
    if epilogue.gated or epilogue.paired or epilogue.group_n:
        return "a gated, paired or group-quantized D is staged in its own layout"
    return ""


def fit_reuse_smem_c(cfg: GemmConfig, problem: GemmProblem, budget: int, epilogue: EpilogueBuffers) -> GemmConfig:
    """``cfg`` with D staged in operand tile 0's ring: the ring one of :data:`REUSE_C_STAGES` deep and
    ``num_epi_stages`` one fewer (``num_c_stages - 2`` stores in flight), then the most A/B stages that fit (the
    deepest ring among equals)."""
    ab, d, scaled = problem.ab_dtype, problem.d_dtype, problem.block_scaled
    best = None
    for c_stages in REUSE_C_STAGES:
        # D lives in the ring, not in the A ring a CTA of one tile would lend it.
        reused = replace(cfg, reuse_smem_c=True, num_c_stages=c_stages, num_epi_stages=c_stages - 1,
                         epi_reuses_ab_smem=False)  # fmt: skip
        fits = [s for s in range(MAX_AB_STAGES, 1, -1) if smem_total(replace(reused, ab_stages=s), ab, d, epilogue,
                                                                     scaled) <= budget]  # fmt: skip
        if fits and (best is None or fits[0] > best.ab_stages):
            best = replace(reused, ab_stages=fits[0])
    if best is None:
        raise ConfigError(f"reuse_smem_c=True: tile {cfg.tile_m}x{cfg.tile_n} fits no 2 A/B stages beside the "
                          "epilogue's buffers; use a smaller tile")  # fmt: skip
    return best


def choose_reuse_smem_c(
    cfg: GemmConfig, problem: GemmProblem, budget: int, epilogue: EpilogueBuffers
) -> tuple[GemmConfig, str]:
    """``cfg`` with D staged in the operand ring where that buys an A/B stage (CUTLASS's ``ReuseSmemC``), and why
    (``""``: not applicable): D's own staging buffers are freed (:func:`fit_reuse_smem_c`). Measured on the H200
    (``bench/results/configs_reuse_smem_c.json``, gelu(acc + bias) + residual on cooperative 128x192 tiles, 5 A/B
    stages against 4): 0.99-1.01x, geomean 1.002x: the stage costs nothing and buys little there."""
    if (reuse_smem_c_blocker(problem, epilogue) or cfg.schedule != "cooperative" or cfg.split_k > 1 or cfg.swap_ab
            or cfg.epi_reuses_ab_smem or problem.k == 0):  # fmt: skip
        return cfg, ""
    try:
        reused = fit_reuse_smem_c(cfg, problem, budget, epilogue)
    except ConfigError:  # the ring, deeper than an operand's own, crowds out the second A/B stage
        return cfg, ("D keeps its own staging buffers: operand tile 0's ring made deep enough to stage D "
                     "(ReuseSmemC) leaves no room for 2 A/B stages")  # fmt: skip
    if reused.ab_stages <= cfg.ab_stages:
        return cfg, (f"D keeps its own staging buffers: staging it in operand tile 0's ring (ReuseSmemC) buys no "
                     f"A/B stage beyond {cfg.ab_stages}")  # fmt: skip
    ab, d, scaled = problem.ab_dtype, problem.d_dtype, problem.block_scaled
    freed = smem_total(cfg, ab, d, epilogue, scaled) - smem_total(replace(reused, ab_stages=cfg.ab_stages), ab, d,
                                                                  epilogue, scaled)  # fmt: skip
    return reused, (f"ReuseSmemC: D staged in operand tile 0's ring ({reused.num_c_stages} stages, "
                    f"{reused.num_epi_stages - 1} store(s) in flight) frees {freed} B: {reused.ab_stages} A/B stages "
                    f"instead of {cfg.ab_stages}")  # fmt: skip


def choose_delay_tma_store(cfg: GemmConfig, epilogue: EpilogueBuffers) -> tuple[bool, str]:
    """Whether each epilogue subtile's TMA store waits for the next subtile's math (``delay_tma_store``), and why.
    Measured on the H200 (``bench/results/configs_store_delay.json``): fused epilogues 0.99-1.03x, geomean 1.007x;
    a plain GEMM 0.98-1.03x, geomean 1.000x, so it keeps the store per subtile."""
    if cfg.reuse_smem_c:
        return False, "TMA store per subtile: D is staged in the operand ring (ReuseSmemC; CUTLASS forbids both)"
    if not epilogue.chain:
        return False, ("TMA store per subtile: a plain GEMM measured the same delayed (0.98-1.03x, geomean 1.00x on "
                       "the H200)")  # fmt: skip
    if not epilogue.delayed_chain:
        return False, ("TMA store per subtile, not delayed: the chain loads operand tiles or makes two passes over "
                       "the subtiles")  # fmt: skip
    return True, ("TMA store delayed one subtile (after the next subtile's math): the barrier before it waits for "
                  "staging writes that have had a subtile's arithmetic to land (fused epilogues 0.99-1.03x, "
                  "geomean 1.007x on the H200)")  # fmt: skip


def choose_evict_first(problem: GemmProblem, cfg: GemmConfig) -> tuple[str, str]:
    """``(operand, why)``: the kernel operand ("a" or "b", "" for neither) that only one tile reads, loaded
    evict-first from L2 (:mod:`epicute.sm90.l2_hints`). A is read once where D is one tile wide, B where it is
    one tile tall, as in a decode GEMM whose weight streams past a few rows of activations; when both hold (a
    single tile) neither is worth a hint."""
    tiles_m, tiles_n = ceil_div(problem.m, cfg.tile_m), ceil_div(problem.n, cfg.tile_n)
    if (tiles_m == 1) == (tiles_n == 1):
        return "", ""
    operand, other, extent, side = ("a", "b", problem.n, "columns") if tiles_n == 1 else ("b", "a", problem.m, "rows")
    name = operand.upper() + (f" (the caller's {other.upper()})" if cfg.swap_ab else "")
    return operand, (
        f"L2 evict-first on {name}: one tile spans all {extent} {side} of {'D^T' if cfg.swap_ab else 'D'}, so each "
        f"k-tile of {operand.upper()} is read by one CTA and streams through L2 without evicting what other kernels "
        "left there (nor forcing dirty lines' write-back to DRAM while it streams)"
    )


def epi_tile_n(out_tile_n: int) -> int:
    """An epilogue subtile's columns: :data:`EPI_TILE_N` (or the whole tile, if narrower), else 16 (one stmatrix
    atom) where that does not divide the output tile (a swap-AB tile of 48 columns)."""
    width = min(EPI_TILE_N, out_tile_n)
    return width if out_tile_n % width == 0 else 16


def block_scale_loads(problem: GemmProblem, tile_n: int) -> str:
    """How the load warp fetches a blockwise plan's scales each k-tile, and what a faster way would take."""
    if problem.a_scales_tma:
        a = "A block scales: one TMA copy per k-tile (M-major, 16-byte aligned strides)"
    else:
        a = (
            "A block scales: a word per row by cp.async (M-major scales with 16-byte aligned strides, "
            "torch._scaled_mm's layout with M a multiple of 4, take one TMA copy per k-tile, ~10 % faster)"
        )
    if b_scale_chunks(tile_n) != 1:
        b = (f"B's by cp.async, one per {tile_n // b_scale_chunks(tile_n)}-column chunk (a {tile_n}-wide tile "
             "straddles blocks of N)")  # fmt: skip
    elif problem.b_scales_bulk:
        b = "B's by one bulk copy of 16 bytes (K-major, 16-byte aligned rows)"
    else:
        b = "B's by one cp.async (K-major scales with 16-byte aligned rows take one 16-byte bulk copy, 0-4 % faster)"
    return f"{a}; {b}"


def _fit_and_check(
    cfg: GemmConfig, problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers, overrides: dict, reasons: list,
    raster_why: str,
) -> GemmConfig:  # fmt: skip
    """``cfg`` with its stages fitted (unless pinned), the pins the planner has no opinion on, its reasons, and
    checked; ``problem`` and ``epilogue`` as the kernel's tiles see them (swapped under ``swap_ab``)."""
    cfg = replace(cfg, num_c_stages=overrides.get("num_c_stages", cfg.num_c_stages))
    if problem.k == 0 and not {"ab_stages", "num_epi_stages", "num_c_stages"} & set(overrides):
        cfg = fit_epilogue_pass_stages(cfg, problem, hw.smem_per_cta_bytes, epilogue)
        reasons.append(f"stages: {cfg.num_c_stages} of the epilogue's operand loads, the A/B ring at its least "
                       f"({cfg.ab_stages}: K = 0 reads one k-tile of zeros), {cfg.num_epi_stages} D buffers")
    elif "ab_stages" in overrides or "num_epi_stages" in overrides:
        cfg = replace(
            cfg,
            ab_stages=overrides.get("ab_stages", cfg.ab_stages),
            num_epi_stages=overrides.get("num_epi_stages", cfg.num_epi_stages),
        )
        reasons.append("stages: requested")
    else:
        cfg = fit_stages(cfg, problem, hw.smem_per_cta_bytes, epilogue)
        extra = epilogue_smem_bytes(cfg, problem.ab_dtype, problem.d_dtype, epilogue, problem.block_scaled)
        total = smem_total(cfg, problem.ab_dtype, problem.d_dtype, epilogue, problem.block_scaled)
        reasons.append(
            f"{cfg.ab_stages} A/B stages of {ab_stage_bytes(cfg, problem.ab_dtype)} B and "
            f"{cfg.num_epi_stages} D buffers of {epi_stage_bytes(cfg, problem.d_dtype)} B"
            + (f" next to the fused epilogue's {extra} B" if extra else "")
            + (
                f": {total} of the {hw.smem_per_cta_bytes} B budget, the ring at its cap of {MAX_AB_STAGES} stages"
                if cfg.ab_stages == MAX_AB_STAGES
                else f" fill the {hw.smem_per_cta_bytes} B budget"
            )
        )
    if overrides.get("reuse_smem_c") and not {"ab_stages", "num_epi_stages", "num_c_stages"} & set(overrides):
        if why := reuse_smem_c_blocker(problem, epilogue):
            raise ConfigError(f"reuse_smem_c=True: {why}; use reuse_smem_c=False")
        cfg = fit_reuse_smem_c(cfg, problem, hw.smem_per_cta_bytes, epilogue)
        reasons.append(f"ReuseSmemC: requested; {cfg.num_c_stages} ring stages, {cfg.ab_stages} A/B stages")
    elif "reuse_smem_c" in overrides:
        cfg = replace(cfg, reuse_smem_c=overrides["reuse_smem_c"])
    elif not {"ab_stages", "num_epi_stages", "num_c_stages"} & set(overrides):
        cfg, why = choose_reuse_smem_c(cfg, problem, hw.smem_per_cta_bytes, epilogue)
        if why:
            reasons.append(why)
    if "delay_tma_store" in overrides:
        cfg = replace(cfg, delay_tma_store=overrides["delay_tma_store"])
    else:
        delay, why = choose_delay_tma_store(cfg, epilogue)
        cfg = replace(cfg, delay_tma_store=delay)
        reasons.append(why)
    reasons.append(
        f"raster: bands of {cfg.swizzle} clusters along "
        f"{'N, swept down M' if cfg.raster_along_m else 'M, swept across N'} ({raster_why})"
    )
    if "evict_first" in overrides:
        cfg = replace(cfg, evict_first=overrides["evict_first"])
    else:
        operand, why = choose_evict_first(problem, cfg)
        cfg = replace(cfg, evict_first=operand)
        if why:
            reasons.append(why)
    if problem.block_scaled:
        reasons.append(block_scale_loads(problem, cfg.tile_n))
    # Fields the planner has no opinion on (register budgets, schedule) pass through.
    passthrough = {k: v for k, v in overrides.items() if k not in GemmConfig.planned_fields()}
    cfg = replace(cfg, **passthrough, reasons=tuple(reasons))
    check_config(cfg, problem, epilogue, hw.smem_per_cta_bytes)
    return cfg
