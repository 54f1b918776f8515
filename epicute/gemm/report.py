"""Rendering a plan as the text ``epicute.explain`` and ``epicute explain`` print.

Plain text on purpose: it reads the same in a terminal, a log file and a test.
"""

from __future__ import annotations

from epicute.epilogue.gated import GATE_BLOCK
from epicute.gemm.plan import GemmPlan
from epicute.gemm.smem import ab_stage_bytes
from epicute.sm90.warp_roles import THREADS_PER_WARPGROUP


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def render_plan(plan: GemmPlan) -> str:
    p, c, hw = plan.problem, plan.config, plan.target
    a_desc = "row-major (K contiguous)" if p.a_major == "k" else "column-major (M contiguous)"
    b_desc = "row-major (N contiguous)" if p.b_major == "n" else "column-major (K contiguous)"
    product = f"A[{p.l}x{p.m}x{p.k}] @ B[{p.l}x{p.k}x{p.n}]"
    if plan.epilogue.gated:
        product = f"gated({product}): B interleaves gate and up in blocks of {GATE_BLOCK}"
    d_desc = f"D[{p.l}x{p.m}x{plan.d_n}]"
    if plan.epilogue.paired:
        d_desc = (f"D[{p.l}x{p.m}x{2 * plan.d_n}] (D and D_up interleaved in blocks of {GATE_BLOCK}, as a gated B's "
                  f"columns), each")  # fmt: skip
    lines = [
        f"epicute GEMM plan: {d_desc} = {product}",
        f"  A {p.ab_dtype} {a_desc}; B {p.b_elem} {b_desc}; D {p.d_dtype} row-major; accumulate fp32"
        + (
            " (fp8 WGMMA, promoted: each 128-wide k-tile's partial is scaled by its blockwise scales and added "
            "into a second fp32 accumulator in registers)"
            if p.block_scaled
            else " (fp8 WGMMA: no promotion; scales applied to the accumulator in the epilogue)"
            if p.fp8
            else ""
        ),
        f"  target          {hw.describe()}",
    ]
    if c.swap_ab:
        lines.append(
            "  swap-AB         the kernel computes D^T = B^T A^T: the tiles, grid and epilogue chain below are "
            "D^T's (N x M), stored column-major into D"
        )
    lines += [
        "",
        "tiles",
        f"  CTA tile        {c.tile_m} x {c.tile_n} x {c.tile_k}   ({plan.num_tiles} output tiles"
        + (" of D^T)" if c.swap_ab else ")"),
        f"  cluster         {c.cluster_m} x {c.cluster_n}"
        + (f"   (TMA multicast: A to {c.cluster_n}, B to {c.cluster_m} CTAs)" if c.cluster_size > 1 else ""),
        f"  schedule        {c.schedule}, {'persistent' if c.persistent else 'one tile per CTA'}",
        f"  grid            {plan.grid}  x {c.num_threads} threads, cluster {(c.cluster_m, c.cluster_n, 1)}"
        + (
            f"; at most {plan.max_active_clusters} clusters on {hw.num_sms} SMs (a launch argument)"
            if c.persistent
            else ""
        ),
        f"  rasterization   bands of {c.swizzle} clusters, "
        + ("along N swept down M" if c.raster_along_m else "along M swept across N"),
        (
            f"  epilogue tile   {c.epi_tile[0]} x {c.epi_tile[1]}  "
            f"({c.tile_m // c.epi_tile[0] * (plan.out_tile_n // c.epi_tile[1])} subtiles per tile, row-major order"
            + (f"; {plan.out_tile_n} output columns, gated)" if plan.epilogue.gated else ")")
        ),
        "",
        "warp roles",
        f"  warpgroup 0     producer: warp 0 issues TMA loads of A and B   setmaxnreg {c.producer_regs}",
    ]
    e = plan.kernel_epilogue
    if e.loads_tiles:
        lines.append(
            f"                  warp 1 issues TMA loads of the epilogue's {len(e.tile_inputs)} tile operand(s)"
        )
    for wg in range(c.num_mma_warpgroups):
        if c.schedule == "pingpong":
            work = (
                f"WGMMA on whole tiles {wg}, {wg + 2}, ... of the CTA, then their epilogues; "
                f"takes turns with warpgroup {2 - wg} (named barriers {2 + wg} mainloop, {5 + wg} epilogue)"
            )
        else:
            rows = c.tile_m // c.num_mma_warpgroups
            work = f"WGMMA on rows {wg * rows}-{(wg + 1) * rows - 1}, then epilogue"
        lines.append(f"  warpgroup {wg + 1}     consumer: {work}   setmaxnreg {c.consumer_regs}")
    regs = THREADS_PER_WARPGROUP * (c.producer_regs + c.num_mma_warpgroups * c.consumer_regs)
    lines += [
        f"  registers       {regs} of 65536 per SM",
        "",
        "pipelines",
        (
            f"  A/B load ring   PipelineTmaAsync, {c.ab_stages} stages, full+empty mbarriers, "
            f"{ab_stage_bytes(c, p.ab_dtype)} B per stage"
        ),
        "  D store         PipelineTmaStore, "
        + (f"D staged in operand tile 0's ring slot (ReuseSmemC, {c.num_c_stages} slots)" if c.reuse_smem_c
           else f"{c.num_epi_stages} buffers")
        + f", one elected thread commits and waits until <= {c.num_epi_stages - 1} stores are in flight"
        + (f" (D and {len(e.aux_outputs)} aux output(s) per commit group)" if e.aux_outputs else "")
        + ("; each subtile's store issued after the next subtile's math" if c.delay_tma_store else ""),
    ]
    if e.loads_tiles:
        lines.append(
            f"  epilogue loads  PipelineTmaAsync, {c.num_c_stages} stages of one {c.epi_tile[0]}x{c.epi_tile[1]} "
            "subtile per tile operand, released by each consumer warp "
            + ("once D's store from the slot has been read" if c.reuse_smem_c
               else "after its smem -> register copy")
        )  # fmt: skip
    lines += [
        f"  epilogue sync   named barrier 1 over the {c.tile_threads} threads of a tile, "
        "fence.proxy.async.shared::cta before each store"
        + ("; stores drained before the epilogue turn passes" if c.schedule == "pingpong" else ""),
        "",
        "shared memory",
    ]
    width = max(len(item.name) for item in plan.smem)
    for item in plan.smem:
        lines.append(f"  {item.name:<{width}}  {item.bytes:>7} B  {item.what}")
    total = plan.smem_bytes
    lines.append(
        f"  {'total':<{width}}  {total:>7} B  {_kib(total)} of {_kib(hw.smem_per_cta_bytes)} "
        f"({total / hw.smem_per_cta_bytes:.0%})"
    )
    if c.epi_reuses_ab_smem:
        lines.append("  D staging aliases the A ring: with one tile per CTA the ring is idle once the mainloop ends")
    else:
        lines.append(
            "  D staging has its own buffers: the next tile's mainloop refills the A/B ring during this epilogue"
        )
    r = plan.roofline
    lines += [
        "",
        "roofline",
        (
            f"  work            {r.flops / 1e9:.2f} GFLOP, {r.min_bytes / 1e6:.2f} MB moved at least "
            f"(intensity {r.intensity:.0f} FLOP/B)"
        ),
        f"  compute bound   {r.compute_s * 1e6:.1f} us at {hw.peak_tflops(p.ab_dtype):.0f} TFLOP/s",
        f"  memory bound    {r.memory_s * 1e6:.1f} us at {hw.hbm_tb_per_s:.2f} TB/s",
    ]
    if r.epilogue_bytes or r.epilogue_alu_s:
        lines.append(
            f"  epilogue        +{r.epilogue_bytes / 1e6:.2f} MB of operand/aux tiles "
            f"({r.epilogue_tile_s * 1e6:.2f} us per tile, fetched under the mainloop); "
            f"{r.epilogue_alu_s * 1e6:.2f} us of arithmetic per tile, "
            + (
                "exposed (the cooperative epilogue runs with no WGMMA in flight)"
                if r.epilogue_exposed
                else "under the other warpgroup's mainloop (ping-pong), which loses about half of it"
            )
        )
    lines += [
        f"  predicted       {r.predicted_s * 1e6:.1f} us ({r.bound}-bound, {r.waves:.2f} waves)"
        + (f" = {r.flops / r.predicted_s / 1e12:.0f} TFLOP/s" if r.predicted_s else ""),
        "",
        "why",
    ]
    lines += [f"  - {reason}" for reason in c.reasons]
    if e.chain:
        over = " over D^T: row and column vectors swapped" if c.swap_ab else ""
        lines += ["", f"epilogue chain{over} (tile: once per tile; subtile: once per epilogue subtile)"]
        lines += [f"  {stage}" for stage in (e.delayed_chain if c.delay_tma_store else e.chain)]
    return "\n".join(lines)
