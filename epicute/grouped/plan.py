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
from epicute.sm90.tile_grid import ceil_div, cluster_counts, grouped_cluster_bound, launched


@dataclass(frozen=True)
class GroupedProblem:
    """``D[rows of g] = A[rows of g] @ B[g]`` for ``groups`` groups of ``total_m`` rows in all:
    A ``(total_M, K)``, B ``(G, K, N)``, D ``(total_M, N)``; majors as in
    :class:`~epicute.gemm.config.GemmProblem`.

    ``ragged="k"`` is the variable-K mode: ``D[g] = A[:, rows of g] @ B[rows of g, :]`` with A ``(M, K)``
    (``total_m`` is then M, every group's), B ``(K, N)``, D ``(G, M, N)``, the ``K`` rows split into groups.

    fp8 inputs (``ab_dtype``/``b_dtype`` as for the GEMM) come with blockwise scales (``block_scaled``):
    A's per row and 128-wide block of K over all rows, B's per 128x128 block of each group's weight (variable
    K: of the whole ``(N, K)`` B, both operands K-major, every group on whole 128-row blocks of K).

    ``gathered``: A's rows are read through an index, row ``r`` being ``x[a_index[r]]`` (row-major ``x``; groups
    split M; fp8 A scales per token of ``x``)."""

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
    #: which dimension the groups split: "m" (rows of A and D) or "k" (the reduction)
    ragged: str = "m"
    b_dtype: str = ""
    block_scaled: bool = False
    gathered: bool = False

    def __post_init__(self) -> None:
        if self.gathered and (self.ragged != "m" or self.a_major != "k"):
            raise ConfigError("gathered rows (a_index) take a row-major A with the groups splitting M")
        if self.ab_dtype not in ("bf16", "fp16") and not self.block_scaled:
            raise ConfigError(
                f"grouped GEMM with ab_dtype={self.ab_dtype!r}: supported are 'bf16', 'fp16' and fp8 with blockwise "
                "scales (block_scaled=True)"
            )
        if self.block_scaled and self.ragged == "k" and (self.a_major, self.b_major) != ("k", "k"):
            raise ConfigError("variable K with fp8 inputs: WGMMA reads 8-bit operands K-major only (a_major and "
                              "b_major 'k')")  # fmt: skip
        if self.groups < 1:
            raise ConfigError(f"groups={self.groups}: a grouped GEMM has at least one group")
        if self.ragged not in ("m", "k"):
            raise ConfigError(f"ragged={self.ragged!r}: groups split 'm' (rows) or 'k' (the reduction)")
        self.mean_group()  # checks dtypes and majors

    @property
    def d_n(self) -> int:
        """D's columns."""
        return output_columns(self.n, self.gated)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """D's shape as the kernel writes it: ``(1, total_M, N)``, or ``(G, M, N)`` with variable K."""
        return (self.groups, self.total_m, self.d_n) if self.ragged == "k" else (1, self.total_m, self.d_n)

    def mean_group(self) -> GemmProblem:
        """The dense problem the config is planned for: ``G`` GEMMs of the mean group's rows (or K)."""
        if self.ragged == "k":
            m, k = self.total_m, max(1, ceil_div(self.k, self.groups))
        else:
            m, k = max(1, ceil_div(self.total_m, self.groups)), self.k
        return GemmProblem(m, self.n, k, self.groups, self.ab_dtype, self.d_dtype, self.a_major, self.b_major,
                           self.b_dtype, self.block_scaled)  # fmt: skip


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
        (:func:`~epicute.sm90.tile_grid.grouped_cluster_bound`, as the kernel computes it); variable K: every
        group's ``(M, N)`` tiles."""
        p, c = self.problem, self.config
        if p.ragged == "k":
            return cluster_counts(ceil_div(p.total_m, c.tile_m), ceil_div(p.n, c.tile_n), p.groups,
                                  (c.cluster_m, c.cluster_n))[2]  # fmt: skip
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
    except the cluster. A fixed cluster of two CTAs along M pads every group to two tiles' rows (on random
    routing, a tile's worth of wasted rows per group), and one along N multicasts only A, the smaller operand
    of small groups. So where the planner wants a 2-CTA cluster and N has two tiles or more, the cluster pairs
    its tiles per group (:attr:`~epicute.gemm.config.GemmConfig.pair_tiles`): along M while the group has two
    row tiles left, along N for an odd last one. Otherwise (gathered rows, which cannot multicast A; one tile
    of N), below :data:`PAIR_ALONG_M_MIN_TILES` tiles per mean group a 2x1 cluster becomes 1x2 (or 1x1).
    Ping-pong tiles (the dense planner's pick where many waves make the cooperative tile's store cost more than
    its wider tile saves) stay unpaired, and gathered rows stay cooperative: both as measured. Keyword overrides
    pin config fields."""
    hw = resolve_target(target)
    mean = problem.mean_group()
    # Group sizes stay on the GPU, so no operand is known to be read by one tile: the dense planner's L2
    # evict-first hint, judged on the mean group, cost up to 17 % where groups span several tiles (bench/NOTES.md).
    # The grouped kernels schedule their own tiles: the dense planner's split-K and swap-AB for small mean groups
    # are theirs to refuse (GemmSm90's constructor), so they are not planned.
    # D staged in an operand ring (ReuseSmemC) has run on the GPU for dense tiles only: not planned here.
    split_pinned = "split_k" in overrides
    overrides = {"evict_first": "", "split_k": 1, "swap_ab": False, "reuse_smem_c": False, **overrides}
    if overrides.get("pair_tiles") and problem.ragged == "k":
        raise ConfigError("pair_tiles=True with variable K: paired tiles split groups of rows; use pair_tiles=False")
    if problem.ragged == "k":
        return GroupedPlan(problem, _unsplit_reason(choose_config(mean, hw, epilogue, **overrides), split_pinned), hw,
                           epilogue)  # fmt: skip
    if overrides.get("pair_tiles") and "cluster_m" not in overrides and "cluster_n" not in overrides:
        overrides = {**overrides, "cluster_m": 2, "cluster_n": 1}  # paired tiles take a 2x1 cluster: pinned with them
    pinned = "cluster_m" in overrides or "cluster_n" in overrides
    if problem.gathered and overrides.get("pair_tiles"):
        raise ConfigError(
            "pair_tiles=True with gathered rows: a paired cluster multicasts A by TMA, and gathered rows are copied "
            "with cp.async; use pair_tiles=False"
        )
    if problem.gathered and overrides.get("cluster_n", 1) != 1:
        raise ConfigError(
            f"cluster_n={overrides['cluster_n']} with gathered rows: the producer copies A's rows with cp.async, "
            "which cannot multicast them to a cluster peer; use cluster_n=1"
        )
    gathered_cooperative = problem.gathered and "schedule" not in overrides
    if gathered_cooperative:
        overrides = {**overrides, "schedule": "cooperative"}
    config = choose_config(mean, hw, epilogue, **overrides)
    if gathered_cooperative:
        why = ("schedule cooperative: gathered rows (the producer warps' cp.async copies of A feed the ring; ping-pong "
               "128x192 tiles measured 6 % slower there)")  # fmt: skip
        config = replace(config, reasons=tuple(why if r.startswith("schedule ") else r for r in config.reasons))
    pairable = (not problem.gathered and ceil_div(problem.n, config.tile_n) > 1 and "pair_tiles" not in overrides
                and config.schedule == "cooperative")  # fmt: skip
    if not pinned and pairable and config.cluster_size == 2:
        # tile_n kept: the pairing along N was judged on it.
        pins = {"tile_n": config.tile_n, **overrides, "cluster_m": 2, "cluster_n": 1, "pair_tiles": True}
        config = choose_config(mean, hw, epilogue, **pins)
        reason = (
            "cluster 2x1 with paired tiles: its two CTAs take two row tiles of a group (B multicast) while the group "
            "has two left, and its last, odd row tile's neighbouring column tiles (A multicast), so no group is "
            f"padded to {2 * config.tile_m} rows"
        )
        config = replace(config, reasons=(*config.reasons, reason))
    elif not pinned and config.cluster_m > 1 and mean.m < PAIR_ALONG_M_MIN_TILES * config.tile_m:
        cluster_n = 1 if problem.gathered or ceil_div(problem.n, config.tile_n) == 1 else 2
        config = choose_config(mean, hw, epilogue, **{**overrides, "cluster_m": 1, "cluster_n": cluster_n})
        reason = (
            f"cluster 1x{cluster_n}: groups of {mean.m} rows on average are fewer than {PAIR_ALONG_M_MIN_TILES} "
            f"tiles; two CTAs along M would pad each group to {2 * config.tile_m} rows"
            + (", so they pair along N" if cluster_n == 2 else "")
        )
        config = replace(config, reasons=(*config.reasons, reason))
    elif not pinned and config.cluster_size == 2 and config.schedule == "pingpong" and "pair_tiles" not in overrides:
        reason = (
            "cluster 2x1 unpaired: ping-pong tiles measured 1-2 % faster without pairing on groups many tiles long "
            f"(groups of {mean.m} rows on average)"
        )
        config = replace(config, reasons=(*config.reasons, reason))
    if problem.gathered:
        reason = "no cluster along N: gathered A rows are copied per CTA (cp.async cannot multicast)"
        config = replace(config, reasons=(*config.reasons, reason))
    return GroupedPlan(problem, _unsplit_reason(config, split_pinned), hw, epilogue)


def _unsplit_reason(config: GemmConfig, split_pinned: bool) -> GemmConfig:
    """``config`` without the dense planner's "requested" for the ``split_k=1`` the caller did not pin."""
    if split_pinned:
        return config
    return replace(config, reasons=tuple(r for r in config.reasons if r != "split_k 1: requested"))


def render_grouped_plan(plan: GroupedPlan) -> str:
    """The text ``explain_grouped`` prints: the grouped schedule, then the tile plan of the mean group."""
    p, c = plan.problem, plan.config
    # The mean group's tile plan, less its dense grid and tile count (the grouped schedule above sets those).
    dense = [
        re.sub(r"   \(\d+ output tiles\)$", "", line)
        for line in render_plan(GemmPlan(p.mean_group(), c, plan.target, plan.epilogue)).splitlines()
        if not line.startswith("  grid ")
    ]
    if p.gathered:  # A is copied per CTA (cp.async), never multicast
        dense = [line.replace("TMA multicast: A to 1, B to", "TMA multicast: B to") for line in dense]
    if c.pair_tiles:  # the shared operand is chosen per tile (the grouped schedule's "tiles" line)
        dense = [line.replace("TMA multicast: A to 1, B to 2 CTAs", "TMA multicast: B or A to 2 CTAs, per tile")
                 for line in dense]  # fmt: skip
    gated_line = (
        f"  gated           B's columns interleave gate and up in blocks of {GATE_BLOCK}; each output column gets its "
        "gate and up accumulators (same thread's registers)"
    )
    inputs = [gated_line] if p.gated else []  # what the header's product does not say
    if p.block_scaled and p.ragged == "k":
        inputs.append(
            "  fp8 scales      blockwise over the whole K: A's per row and 128 K rows, B's per 128x128 block; a "
            "group's k-tiles read the blocks they load"
        )
    elif p.block_scaled:  # the grouped part of blockwise scaling; the dense plan below says how it promotes
        inputs.append(
            "  fp8 scales      blockwise: A's per row (read at the tile's global rows) and 128 of K, B's per 128x128 "
            "block of the tile's group's weight"
        )
    bound = f"{plan.cluster_bound} cluster tiles"
    grid = f"  grid            {plan.grid}: " + (bound if p.ragged == "k" else f"at most {bound} for any routing")
    grid += f", {plan.max_active_clusters} persistent clusters walk them" if c.persistent else ""
    product = (
        f"A[{p.total_m}x(rows of g)] @ B[(rows of g)x{p.n}]"
        if p.ragged == "k"
        else f"A[{p.total_m}x{p.k}] @ B[group][{p.k}x{p.n}]"
    )
    product = f"gated({product})" if p.gated else product
    if p.ragged == "k":
        lines = [
            (
                f"epicute grouped GEMM plan, variable K: {p.groups} groups, D[group][{p.total_m}x{p.d_n}] = {product} "
                f"({p.k} K rows sorted by group; offsets read on the GPU, never by the host)"
            ),
            *inputs,
            "grouped schedule",
            (
                f"  tiles           each group's {ceil_div(p.total_m, c.tile_m)} x {ceil_div(p.n, c.tile_n)} tiles of "
                "D, the groups as the batch (the GEMM's static schedule)"
            ),
            grid,
            (
                f"  k-loop          {'' if p.block_scaled else 'ceil'}(rows_g / {c.tile_k}) k-tiles per tile, from "
                "the group's first K row (none for an empty group: D is the epilogue of zeros)"
                + (
                    "; each ping-pong warpgroup steps its ring over the other's tiles by their groups' k-tiles"
                    if c.schedule == "pingpong"
                    else ""
                )
            ),
            (
                "  A, B            one TMA descriptor each over the whole K, K-major: every group starts and ends on "
                f"a {c.tile_k}-row k-tile (offsets checked where read; a group that does not gets NaN), so nothing is "
                "clipped"
                if p.block_scaled
                else "  A, B            one ragged TMA descriptor each (K's extent ends at each group's end): a tile's "
                "loads start at its group's first K row, and its last k-tile's rows past the group's end arrive as "
                "zeros"
            ),
            f"  config          planned for the mean group, {p.mean_group().k} K rows (below)",
            "",
        ]
    else:
        lines = [
            (
                f"epicute grouped GEMM plan: {p.groups} groups, D[{p.total_m}x{p.d_n}] = {product} (rows sorted by "
                "group; offsets read on the GPU, never by the host)"
            ),
            *inputs,
            "grouped schedule",
            (
                f"  tiles           never straddle groups: group g has ceil(rows_g / {c.tile_m * c.cluster_m}) x "
                f"{ceil_div(ceil_div(p.n, c.tile_n), c.cluster_n)} cluster tiles, numbered group by group"
                if not c.pair_tiles
                else f"  tiles           never straddle groups, nor pad them: group g's t = ceil(rows_g / {c.tile_m}) "
                f"row tiles make (t // 2) x {ceil_div(p.n, c.tile_n)} clusters of two row tiles (B multicast), then "
                f"for an odd t {ceil_div(ceil_div(p.n, c.tile_n), 2)} clusters of its last row tile and two column "
                "tiles (A multicast); numbered group by group"
            ),
            grid,
            "  group lookup    each warp: a prefix sum over 32 groups' tile counts per step (shuffles, no sync)",
            (
                "  A               rows gathered through a_index: 2 producer warps copy each k-tile's rows with "
                "16-byte cp.async into the swizzled stages (B by TMA)"
                if p.gathered
                else "  A               one 2-D TMA descriptor; each tile's loads start at its group's first row"
            ),
            "  D, aux outputs  one ragged TMA descriptor: stores clip at the group's end (no predicates)",
            f"  config          planned for the mean group, {p.mean_group().m} rows (below)",
            "",
        ]
    return "\n".join(lines + dense[1:])


__all__ = ["PAIR_ALONG_M_MIN_TILES", "GroupedPlan", "GroupedProblem", "plan_grouped", "render_grouped_plan"]
