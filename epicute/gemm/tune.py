"""Opt-in autotuning: time the planner's candidate configs on the GPU, keep the fastest.

The planner's choice comes from a model (:mod:`epicute.gemm.roofline`); tuning
measures. The candidates are every configuration the planner accepts for the
problem when the schedule, tile N, the cluster shape and persistence are pinned (it still
fits the stages around each), deduplicated, the planner's own choice first.
Each one is compiled once (through the compile cache) and timed by CUDA-event
medians on the caller's own inputs. The winner's overrides are stored in
``tuned.json`` in the cache directory, keyed like the compile cache (problem,
epilogue semantic hash, GPU name, code versions), so later calls and processes
reuse it: ``epicute.gemm(..., tune=True)`` and ``epicute.explain`` look it up.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

from epicute.errors import ConfigError
from epicute.gemm import GemmProblem
from epicute.gemm.heuristics import (
    FITTED_SWAP_MAX_M,
    SWAP_AB_WIDE_MAX_M,
    WAVE_FIT_TILE_N,
    WIDE_SWAP_TILE_N,
    choose_config,
    fitted_swap_width,
    wave_fit_widths,
    wide_swap_refusal,
)
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.runtime.cache import JsonTable, code_versions
from epicute.runtime.target import Target

#: The axes tuning explores; stages are fitted by the planner for each point.
SCHEDULE_TILE_N = (("cooperative", (64, 128, 192, 224, 256)), ("pingpong", (64, 128, 192)))
CLUSTERS = ((1, 1), (2, 1), (1, 2))
PERSISTENT = (True, False)


@dataclass(frozen=True)
class TuneResult:
    """The fastest overrides, every candidate's median milliseconds, and the planner's own pick."""

    best: dict
    times_ms: dict[str, float]
    planner: dict

    @property
    def speedup_over_planner(self) -> float:
        return self.times_ms[label(self.planner)] / self.times_ms[label(self.best)]


def label(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))


def candidates(problem: GemmProblem, hw: Target, epilogue: EpilogueBuffers = NO_EPILOGUE) -> list[dict]:
    """Override dicts of every distinct config the planner accepts; the planner's own choice first."""
    own = choose_config(problem, hw, epilogue)
    seen = {own.key()}
    result = [_overrides_of(own)]
    points = [(schedule, n) for schedule, widths in SCHEDULE_TILE_N for n in widths]
    for (schedule, tile_n), (cm, cn), persistent in itertools.product(points, CLUSTERS, PERSISTENT):
        if tile_n == 64 and problem.n > 128:  # a 64-wide tile only pays off on narrow N
            continue
        if tile_n == WAVE_FIT_TILE_N and not wave_fit_widths(problem):  # the planner's rule
            continue
        if schedule == "pingpong" and not persistent:  # its warpgroups take alternate tiles of a CTA
            continue
        pins = {"schedule": schedule, "tile_n": tile_n, "cluster_m": cm, "cluster_n": cn, "persistent": persistent}
        try:
            cfg = choose_config(problem, hw, epilogue, **pins)
        except ConfigError:
            continue
        if cfg.key() not in seen:
            seen.add(cfg.key())
            result.append(_overrides_of(cfg))
    for swapped in (wide_swap_pins(problem, epilogue), fitted_swap_pins(problem, epilogue)):
        if swapped is None:
            continue
        try:
            cfg = choose_config(problem, hw, epilogue, **swapped)
        except ConfigError:
            continue
        if cfg.key() not in seen:
            seen.add(cfg.key())
            result.append(_overrides_of(cfg))
    return result


def wide_swap_pins(problem: GemmProblem, epilogue: EpilogueBuffers = NO_EPILOGUE) -> dict | None:
    """The swapped cooperative 256-row tile whose width (:data:`WIDE_SWAP_TILE_N`) pads M least, for an M of more
    than one such tile against a wider N; None where swap-AB cannot run the problem."""
    if problem.m <= WIDE_SWAP_TILE_N[-1] or wide_swap_refusal(problem, epilogue):
        return None
    width = min(reversed(WIDE_SWAP_TILE_N), key=lambda w: -problem.m % w)
    return {"swap_ab": True, "schedule": "cooperative", "tile_m": 256, "tile_n": width, "persistent": True}


def fitted_swap_pins(problem: GemmProblem, epilogue: EpilogueBuffers = NO_EPILOGUE) -> dict | None:
    """The swapped cooperative 128-row tile as narrow as fits M in the fewest tiles of at most 256
    (:func:`~epicute.gemm.heuristics.fitted_swap_width`), for an M of more than one swap-AB tile and at most
    ``FITTED_SWAP_MAX_M`` against a wider N; None where swap-AB cannot run the problem. The planner takes it only
    where it was measured faster (widths to 208); the tuner measures the rest."""
    if not SWAP_AB_WIDE_MAX_M < problem.m <= FITTED_SWAP_MAX_M or wide_swap_refusal(problem, epilogue):
        return None
    width = fitted_swap_width(problem.m)
    return {"swap_ab": True, "schedule": "cooperative", "tile_m": 128, "tile_n": width, "persistent": True}


def _overrides_of(cfg) -> dict:
    """The pins that give ``cfg`` again (the planner's swap-AB plan is pinned as one; the tile pins of the other
    candidates keep the unswapped kernel)."""
    pins = {
        "schedule": cfg.schedule, "tile_n": cfg.tile_n, "cluster_m": cfg.cluster_m, "cluster_n": cfg.cluster_n,
        "persistent": cfg.persistent,
    }  # fmt: skip
    return {**pins, "swap_ab": True, "tile_m": cfg.tile_m} if cfg.swap_ab else pins


def pick_fastest(
    options: list[dict], measure: Callable[[dict], float], progress: Callable[[str], None] | None = None
) -> TuneResult:
    """Time every option with ``measure`` (median ms); options that fail to build or run are skipped."""
    times: dict[str, float] = {}
    by_label = {}
    for overrides in options:
        name = label(overrides)
        if progress is not None:
            progress(name)
        try:
            times[name] = measure(overrides)
        except Exception as exc:
            if overrides is options[0]:
                raise ConfigError(f"the planner's own config ({name}) failed to run: {exc}") from exc
            continue
        by_label[name] = overrides
    best = min(times, key=times.__getitem__)
    return TuneResult(best=by_label[best], times_ms=times, planner=options[0])


# ----------------------------------------------------------------- the store
def tune_key(problem: GemmProblem, epilogue_hash: str | None, device_name: str) -> str:
    """Stable text key of one tuned problem (sizes included: the winner depends on them)."""
    text = json.dumps(
        {"problem": asdict(problem), "epilogue": epilogue_hash, "device": device_name, "code": code_versions()},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


#: The winners, keyed by :func:`tune_key`.
TUNED = JsonTable("tuned.json")


def stored_entry(key: str) -> dict | None:
    """What tuning stored for ``key`` (``best``, ``times_ms``, ``planner``), or None (never tuned, or caching
    disabled)."""
    return TUNED.get(key)


def store_winner(key: str, result: TuneResult) -> None:
    TUNED.put(key, {"best": result.best, "times_ms": result.times_ms, "planner": result.planner})
