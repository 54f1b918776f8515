"""A :class:`GemmPlan`: problem + chosen config + everything derived from them.

This is what ``explain`` prints and what the runtime compiles and launches.
"""

from __future__ import annotations

from dataclasses import dataclass

from epicute.epilogue.gated import output_columns
from epicute.errors import ConfigError
from epicute.gemm.config import GemmConfig, GemmProblem
from epicute.gemm.heuristics import choose_config, predicted
from epicute.gemm.roofline import Roofline
from epicute.gemm.smem import NO_EPILOGUE, EpilogueBuffers, SmemItem, smem_table
from epicute.runtime.target import Target, resolve_target
from epicute.sm90.tile_grid import ceil_div, cluster_counts, launched


@dataclass(frozen=True, repr=False)
class GemmPlan:
    problem: GemmProblem
    config: GemmConfig
    #: the GPU planned for: its SM count sets the persistent grid (a launch argument, not code)
    target: Target
    #: shared memory the fused epilogue needs (none without an epilogue)
    epilogue: EpilogueBuffers = NO_EPILOGUE

    def __hash__(self) -> int:
        # Computed once: every launch looks its kernel up by plan (a deep hash of config and target otherwise).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.problem, self.config, self.target, self.epilogue))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __repr__(self) -> str:
        # One line, so a REPL echoing explain()'s result does not bury the text explain printed.
        p, c = self.problem, self.config
        return (
            f"<GemmPlan {p.m}x{p.n}x{p.k} L={p.l} {p.ab_dtype}->{p.d_dtype}: {c.schedule} {c.tile_m}x{c.tile_n}"
            f"x{c.tile_k} cluster {c.cluster_m}x{c.cluster_n}, {c.ab_stages} stages, grid {self.grid} "
            "(epicute.gemm.render_plan(plan) prints it all)>"
        )

    @property
    def kernel_problem(self) -> GemmProblem:
        """The problem the kernel's tiles cover: D^T = B^T A^T under ``swap_ab``, else :attr:`problem`."""
        return self.problem.swapped() if self.config.swap_ab else self.problem

    @property
    def kernel_epilogue(self) -> EpilogueBuffers:
        """The fused epilogue as the kernel runs it (over D^T under ``swap_ab``: row and column vectors swapped)."""
        return self.epilogue.transposed() if self.config.swap_ab else self.epilogue

    @property
    def d_n(self) -> int:
        """D's columns: N, or half of it under a gated epilogue (B interleaves gate and up)."""
        return output_columns(self.problem.n, self.epilogue.gated)

    @property
    def out_tile_n(self) -> int:
        """D's columns per tile (half of ``tile_n`` under a gated epilogue)."""
        return self.epilogue.out_tile_n(self.config.tile_n)

    @property
    def smem(self) -> list[SmemItem]:
        p = self.kernel_problem
        return smem_table(self.config, p.ab_dtype, p.d_dtype, self.kernel_epilogue, p.block_scaled)

    @property
    def smem_bytes(self) -> int:
        return sum(item.bytes for item in self.smem)

    @property
    def num_tiles(self) -> int:
        p, c = self.kernel_problem, self.config
        return ceil_div(p.m, c.tile_m) * ceil_div(p.n, c.tile_n) * p.l

    @property
    def max_active_clusters(self) -> int:
        """The persistent kernel's cluster budget on :attr:`target`: its launch argument
        (``GemmSm90.__call__``'s ``max_active_clusters``), never part of its compile key."""
        return max(1, self.target.num_sms // self.config.cluster_size)

    @property
    def grid(self) -> tuple[int, int, int]:
        """Launch grid (cluster_m, cluster_n, clusters), as the kernel computes it on the device
        (the same :mod:`epicute.sm90.tile_grid` functions, given :attr:`max_active_clusters` at launch)."""
        c = self.config
        return (c.cluster_m, c.cluster_n, launched(self.clusters * c.split_k, self.max_active_clusters, c.persistent))

    @property
    def clusters(self) -> int:
        """Clusters of output tiles (the kernel's :func:`~epicute.sm90.tile_grid.cluster_counts`)."""
        p, c = self.kernel_problem, self.config
        return cluster_counts(ceil_div(p.m, c.tile_m), ceil_div(p.n, c.tile_n), p.l, (c.cluster_m, c.cluster_n))[2]

    @property
    def split_workspace_shape(self) -> tuple[int, int]:
        """Split-K's flat fp32 partials and int32 counters (``GemmSm90._reduce_splits``): per output tile slot
        (every CTA of every cluster) ``split_k`` partial tiles and one counter."""
        c = self.config
        slots = self.clusters * c.cluster_size
        return slots * c.split_k * c.tile_m * c.tile_n, slots

    @property
    def roofline(self) -> Roofline:
        return predicted(self.problem, self.target, self.config, self.epilogue)


def plan_gemm(
    problem: GemmProblem,
    target: Target | str | None = None,
    epilogue: EpilogueBuffers = NO_EPILOGUE,
    **overrides,
) -> GemmPlan:
    """Plan ``problem`` for ``target`` (a :class:`Target` or its name; default: the visible GPU,
    else an H100 SXM).

    ``epilogue`` is the fused epilogue's shared-memory needs; keyword overrides
    pin :class:`GemmConfig` fields, e.g. ``tile_n=128``.
    """
    hw = resolve_target(target)
    if overrides.get("pair_tiles"):
        raise ConfigError("pair_tiles=True: paired tiles are a grouped GEMM's schedule (epicute.grouped_gemm); a dense "
                          "GEMM takes cluster_m=2 or cluster_n=2")  # fmt: skip
    return GemmPlan(problem, choose_config(problem, hw, epilogue, **overrides), hw, epilogue)
