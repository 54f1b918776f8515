"""A grouped GEMM's problem and plan: the tile config, the grouped schedule, and the text ``explain`` prints.

The host never reads the offsets (they stay on the GPU, so a call neither syncs nor breaks CUDA
graph capture): the config is planned for the *mean* group, ``total_M / G`` rows of
``K x N`` (the dense planner's choice for a batch of ``G`` such GEMMs), and the grid for the
worst routing, the bound on cluster tiles any split of ``total_M`` rows into ``G`` groups needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from epicute.epilogue.gated import GATE_BLOCK, output_columns
from epicute.errors import ConfigError
from epicute.gemm.config import GemmConfig, GemmProblem
from epicute.gemm.heuristics import choose_config
from epicute.gemm.plan import GemmPlan
from epicute.gemm.report import render_plan
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.runtime.target import Target, resolve_target
from epicute.sm90.tile_grid import ceil_div, grouped_cluster_bound, launched


@dataclass(frozen=True)
class GroupedProblem:
    """``D[rows of g] = A[rows of g] @ B[g]`` for ``groups`` groups of ``total_m`` rows in all:
    A ``(total_M, K)``, B ``(G, K, N)``, D ``(total_M, N)``; majors as in
    :class:`~epicute.gemm.config.GemmProblem`."""

    total_m: int
    n: int
    k: int
    groups: int
    ab_dtype: str = "bf16"
    d_dtype: str = "bf16"
    a_major: str = "k"
    b_major: str = "n"
    #: a gated epilogue's problem: B's ``n`` columns interleave gate and up, D has ``n / 2``
    gated: bool = False

    def __post_init__(self) -> None:
        if self.ab_dtype not in ("bf16", "fp16"):
            raise ConfigError(f"grouped GEMM with ab_dtype={self.ab_dtype!r}: supported are 'bf16' and 'fp16'")
        if self.groups < 1:
            raise ConfigError(f"groups={self.groups}: a grouped GEMM has at least one group")
        self.mean_group()  # checks dtypes and majors

    @property
    def d_n(self) -> int:
        """D's columns."""
        return output_columns(self.n, self.gated)

    def mean_group(self) -> GemmProblem:
        """The dense problem the config is planned for: ``G`` GEMMs of the mean group's rows."""
        return GemmProblem(
            max(1, ceil_div(self.total_m, self.groups)), self.n, self.k, self.groups, self.ab_dtype, self.d_dtype,
            self.a_major, self.b_major,
        )  # fmt: skip


@dataclass(frozen=True, repr=False)
class GroupedPlan:
    problem: GroupedProblem
    config: GemmConfig
    target: Target
    epilogue: EpilogueBuffers = NO_EPILOGUE

    def __repr__(self) -> str:
        p, c = self.problem, self.config
        return (
            f"<GroupedPlan G={p.groups} {p.total_m}x{p.n}x{p.k} {p.ab_dtype}->{p.d_dtype}: {c.schedule} "
            f"{c.tile_m}x{c.tile_n}x{c.tile_k} cluster {c.cluster_m}x{c.cluster_n}, grid {self.grid}>"
        )

    @property
    def max_active_clusters(self) -> int:
        return max(1, self.target.num_sms // self.config.cluster_size)

    @property
    def cluster_bound(self) -> int:
        """The most cluster tiles any routing of ``total_M`` rows into ``G`` groups needs
        (:func:`~epicute.sm90.tile_grid.grouped_cluster_bound`, as the kernel computes it)."""
        p, c = self.problem, self.config
        clusters_n = ceil_div(ceil_div(p.n, c.tile_n), c.cluster_n)
        return grouped_cluster_bound(p.total_m, p.groups, c.tile_m * c.cluster_m, clusters_n)

    @property
    def grid(self) -> tuple[int, int, int]:
        c = self.config
        return (c.cluster_m, c.cluster_n, launched(self.cluster_bound, self.max_active_clusters, c.persistent))


#: Below this many mean rows per group (in tiles), clusters pair tiles along N, not M (see :func:`plan_grouped`).
PAIR_ALONG_M_MIN_TILES = 5


def plan_grouped(
    problem: GroupedProblem, target: Target | str | None = None, epilogue: EpilogueBuffers = NO_EPILOGUE, **overrides
) -> GroupedPlan:
    """Plan ``problem``: the dense planner's config for its mean group (:meth:`GroupedProblem.mean_group`),
    except the cluster when groups are small. A cluster of two CTAs along M pads every group to two
    tiles' rows (on random routing, a tile's worth of wasted rows per group), so below
    :data:`PAIR_ALONG_M_MIN_TILES` tiles per mean group its two CTAs take neighbouring tiles along N
    instead and multicast A. Keyword overrides pin config fields."""
    hw = resolve_target(target)
    mean = problem.mean_group()
    config = choose_config(mean, hw, epilogue, **overrides)
    pinned = "cluster_m" in overrides or "cluster_n" in overrides
    if not pinned and config.cluster_m > 1 and mean.m < PAIR_ALONG_M_MIN_TILES * config.tile_m:
        cluster_n = 2 if ceil_div(problem.n, config.tile_n) > 1 else 1
        config = choose_config(mean, hw, epilogue, **{**overrides, "cluster_m": 1, "cluster_n": cluster_n})
        reason = (
            f"cluster 1x{cluster_n}: groups of {mean.m} rows on average are fewer than {PAIR_ALONG_M_MIN_TILES} "
            f"tiles; two CTAs along M would pad each group to {2 * config.tile_m} rows, so they pair along N"
        )
        config = replace(config, reasons=(*config.reasons, reason))
    return GroupedPlan(problem, config, hw, epilogue)


def render_grouped_plan(plan: GroupedPlan) -> str:
    """The text ``explain_grouped`` prints: the grouped schedule, then the tile plan of the mean group."""
    p, c = plan.problem, plan.config
    # The mean group's tile plan, less its dense grid and tile count (the grouped schedule above sets those).
    dense = [
        re.sub(r"   \(\d+ output tiles\)$", "", line)
        for line in render_plan(GemmPlan(p.mean_group(), c, plan.target, plan.epilogue)).splitlines()
        if not line.startswith("  grid ")
    ]
    lines = [
        (
            f"epicute grouped GEMM plan: {p.groups} groups, D[{p.total_m}x{p.d_n}] = "
            + ("gated(" if p.gated else "")
            + f"A[{p.total_m}x{p.k}] @ B[group][{p.k}x{p.n}]"
            + (")" if p.gated else "")
            + " (rows sorted by group; offsets read on the GPU, never by the host)"
        ),
        *(
            [
                (
                    f"  gated           B's columns interleave gate and up in blocks of {GATE_BLOCK}; each output "
                    "column gets its gate and up accumulators (same thread's registers)"
                )
            ]
            if p.gated
            else []
        ),
        "grouped schedule",
        (
            f"  tiles           never straddle groups: group g has ceil(rows_g / {c.tile_m * c.cluster_m}) x "
            f"{ceil_div(ceil_div(p.n, c.tile_n), c.cluster_n)} cluster tiles, numbered group by group"
        ),
        (
            f"  grid            {plan.grid}: at most {plan.cluster_bound} cluster tiles for any routing"
            + (f", {plan.max_active_clusters} persistent clusters walk them" if c.persistent else "")
        ),
        "  group lookup    each warp: a prefix sum over 32 groups' tile counts per step (shuffles, no sync)",
        "  A               one 2-D TMA descriptor; each tile's loads start at its group's first row",
        "  D, aux outputs  one ragged TMA descriptor: stores clip at the group's end (no predicates)",
        "  config          planned for the mean group, " + f"{p.mean_group().m} rows (below)",
        "",
    ]
    return "\n".join(lines + dense[1:])


__all__ = ["PAIR_ALONG_M_MIN_TILES", "GroupedPlan", "GroupedProblem", "plan_grouped", "render_grouped_plan"]
