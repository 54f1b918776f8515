"""Planning the attention backward kernel: its config and shared memory, in plain Python.

The backward kernel (:mod:`epicute.attention.backward_sm90`) gives each CTA one block of
``tile_n`` keys of one (batch, key/value head) and walks every query block that sees them
(``tile_m`` queries at a time), for each query head of the GQA group in turn, so dK and dV
are summed over the group in registers and written once. S^T and dP^T are computed
keys-by-queries. At head_dim 64 and 128 each consumer warpgroup owns 64 of the block's 128
keys, so P^T and dS^T are born in the registers the dV and dK WGMMAs read as their A operand.
At head_dim 256 one warpgroup's dK and dV over 64 keys would take 256 registers a thread, so
the warpgroups split head_dim instead (``split_head_dim``): a CTA takes 64 keys, each
warpgroup computes S^T and dP^T for half of the step's queries, stages P^T and dS^T in shared
memory, and accumulates dK and dV for all 64 keys over its half of head_dim (128 registers).
At head_dim 128 without a score_mod a step takes 80 queries, and dQ, whose 80 rows no WGMMA's M
covers, is computed transposed (:func:`dq_split`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.errors import ConfigError
from epicute.sm90.smem_layout import MBARRIER_BYTES, SmemBuffer, SmemLayout
from epicute.sm90.warp_roles import WarpRoles

#: Head dims the backward kernel compiles for.
BACKWARD_HEAD_DIMS = (64, 128, 256)
#: Keys per consumer warpgroup (one WGMMA M atom of S^T).
KEYS_PER_WARPGROUP = 64
#: Consumer warpgroups of the backward kernel.
MMA_WARPGROUPS = 2


def dq_split(tile_m: int) -> str:
    """How the consumer warpgroups share a query block's dQ at ``tile_m`` queries per step: ``"columns"`` (64: each
    half of head_dim), ``"rows"`` (128: each 64 rows, a WGMMA's M), or ``"transposed"`` (80, no multiple of a WGMMA's
    M, so only its N: ``dQ^T = K^T dS^T`` with head_dim as M, each warpgroup half of it). The kernel, its dQ MMA
    and the postprocess all read it here."""
    if tile_m % KEYS_PER_WARPGROUP:
        return "transposed"
    return "rows" if tile_m > KEYS_PER_WARPGROUP else "columns"


@dataclass(frozen=True)
class BackwardConfig(WarpRoles):
    """Compile-time choices of the SM90 attention backward kernel (see the module docstring)."""

    head_dim: int = 128
    #: Queries per step of a CTA's loop (the N of S^T = K Q^T, the K of dV = P^T dO).
    tile_m: int = 64
    #: Keys per CTA: 64 per consumer warpgroup, or 64 shared by both (``split_head_dim``).
    tile_n: int = 128
    #: Depth of the ring that carries each step's Q and dO tiles.
    stages: int = 2
    producer_regs: int = 24
    consumer_regs: int = 240
    reasons: tuple[str, ...] = field(default=(), compare=False, hash=False)

    @property
    def num_mma_warpgroups(self) -> int:
        return MMA_WARPGROUPS

    @property
    def split_head_dim(self) -> bool:
        """The warpgroups split head_dim (and each step's queries) rather than the keys."""
        return self.tile_n == KEYS_PER_WARPGROUP

    @property
    def stat_stage_floats(self) -> int:
        """Floats between the ring stages of LSE and of D in shared memory: ``tile_m`` rounded up to 32, as a
        TMA load's shared-memory destination must be 128-byte aligned (80 rows of fp32 are 320 bytes)."""
        return -(-self.tile_m // 32) * 32

    @property
    def dq_split_rows(self) -> bool:
        """dQ's rows split over the consumer warpgroups (:func:`dq_split`), not head_dim."""
        return dq_split(self.tile_m) == "rows"

    @property
    def dq_swap_ab(self) -> bool:
        """dQ computed transposed (:func:`dq_split`)."""
        return dq_split(self.tile_m) == "transposed"

    @property
    def dq_fragment_order(self) -> bool:
        """dQ is staged and accumulated in the WGMMA accumulator's order (16-byte stores free of bank conflicts,
        one bulk reduce-add per warpgroup part), which a postprocess kernel un-permutes; else row-major, through
        a swizzled TMA box (stores with a 2-way bank conflict) and a torch pass. Measured faster at head_dim 64
        and 128; at 256 (``split_head_dim``) 9 % slower, for a reason not yet found (bench/NOTES.md)."""
        return not self.split_head_dim

    @property
    def score_buffers(self) -> int:
        """Buffers of the staged dS^T (and, splitting head_dim, P^T): two, so a step's writes never meet
        the previous step's WGMMA reads (the ring's stages where it has two)."""
        return 2

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a configuration the kernel cannot run."""
        if self.head_dim not in BACKWARD_HEAD_DIMS:
            raise ConfigError(
                f"head_dim={self.head_dim}: the attention backward supports head_dim {BACKWARD_HEAD_DIMS}"
            )
        wide = {64: 128, 128: 80}.get(self.head_dim)
        if self.tile_m != 64 and self.tile_m != wide:
            raise ConfigError(
                f"tile_m={self.tile_m}: the backward kernel takes 64 queries per step, 128 at head_dim 64 or 80 at "
                "head_dim 128 (the registers of S^T and dP^T over more queries leave no room for dK and dV)"
            )
        keys = MMA_WARPGROUPS * KEYS_PER_WARPGROUP
        if self.head_dim == 256 and self.tile_n != KEYS_PER_WARPGROUP:
            raise ConfigError(
                f"tile_n={self.tile_n}: at head_dim 256 the backward kernel takes {KEYS_PER_WARPGROUP} keys per CTA "
                "(its warpgroups split head_dim: dK and dV over more keys do not fit in registers)"
            )
        if self.head_dim != 256 and self.tile_n != keys:
            raise ConfigError(f"tile_n={self.tile_n}: the backward kernel takes {keys} keys per CTA (2 warpgroups)")
        if not 1 <= self.stages <= 2:
            raise ConfigError(f"stages={self.stages}: the Q/dO ring takes 1 or 2 stages")
        self.validate_registers()


def backward_config(head_dim: int, score_mod: bool = False) -> BackwardConfig:
    """The backward config for ``head_dim`` (validated), with or without a ``score_mod``."""
    reasons = (
        (
            "a CTA per (128 keys, key/value head, batch): dK and dV stay in registers over every "
            "query block and every query head of the GQA group, then are stored once"
        ),
        "S^T and dP^T keys-by-queries: P^T and dS^T feed the dV and dK WGMMAs from registers",
        (
            "dQ per step through shared memory into an fp32 accumulator: each consumer warpgroup stages "
            "its half and producer warp 1 issues the reduce-add, so the consumers go on while it runs"
        ),
        "each step's LSE and D ride in the Q/dO ring (TMA), read from shared memory",
    )
    wide_steps = head_dim == 64
    if wide_steps:
        reasons += (
            (
                "head_dim 64: 128 queries per step, so each step's fixed costs (barriers, dQ's reduce-add) "
                "cover twice the math; dQ split by rows over the warpgroups (a WGMMA's M is 64)"
            ),
        )
    if head_dim == 256:
        reasons = (
            (
                (
                    "head_dim 256: a CTA per (64 keys, key/value head, batch); the warpgroups split head_dim, as "
                    "dK and dV for 64 keys x 256 dims would take 256 registers a thread: each holds 128"
                ),
                (
                    "S^T and dP^T keys-by-queries, each warpgroup half of the step's queries; P^T and dS^T "
                    "staged in shared memory, where dV, dK (each warpgroup its half of head_dim) and dQ read them"
                ),
                (
                    "one stage of Q and of dO (64 queries x 256 dims of both are 64 KB: two stages beside K, V and "
                    "dQ's staging would not fit in 227 KB), each its own ring, released as soon as its last reader "
                    "retires: dK, dV and dQ run in that order, so the next Q loads once dK has read this one and "
                    "the next dO once dV has, both while dQ runs"
                ),
            )
            + reasons[2:]
            + (
                (
                    "dQ row-major, through a swizzled TMA reduce-add: the fragment order of head_dim 64 and 128 "
                    "measured 9 % slower at 256"
                ),
            )
        )
        cfg = BackwardConfig(head_dim=head_dim, tile_m=64, tile_n=KEYS_PER_WARPGROUP, stages=1, reasons=reasons)
        cfg.validate()
        return cfg
    reasons += (
        (
            "dQ staged and added in the order WGMMA leaves it in registers: 16-byte stores free of bank conflicts "
            "(row-major swizzled staging has 2-way ones) and one bulk reduce-add per warpgroup; a postprocess "
            "kernel un-permutes it as it scales dQ"
        ),
    )
    tile_m = 128 if wide_steps else 64
    if head_dim == 128 and not score_mod:
        tile_m = 80
        reasons += (
            (
                "head_dim 128: 80 queries per step (a WGMMA's N), so each step's fixed costs cover 25 % more math; "
                "dQ^T = K^T dS^T, as 80 is no multiple of a WGMMA's M (64), each warpgroup half of head_dim "
                "(a score_mod keeps 64: its slopes' registers would spill)"
            ),
        )
    cfg = BackwardConfig(head_dim=head_dim, tile_m=tile_m, reasons=reasons)
    cfg.validate()
    return cfg


#: The widest band :func:`grid_band` takes (the widest measured).
MAX_GRID_BAND = 8
#: Causal queries up to this long take the widest band whatever L2 holds: their pairs' walks are short, so the
#: launch's tail outweighs L2 (H200, bands forced, do_bench: Qwen2.5-7B's 28/4 heads at 4K 406 -> 477 TFLOPS, a
#: 20/4 group at 4K 420 -> 494, 32/8 at 2K x 4 sequences 412 -> 439; at 8K the L2 band held, bench/NOTES.md).
SHORT_CAUSAL_SEQLEN = 4096


def streamed_bytes(cfg: BackwardConfig, heads: int, seqlen_q: int, elem_bytes: int = 2) -> int:
    """What the CTAs of one (key/value head, batch) pair stream over their walk, for ``heads`` query heads: Q,
    dO, dQ's fp32 sum, LSE and D. A causal pair's key blocks read each query block at different moments
    (each from its own diagonal on), so it stays in L2 between them only if all of it fits."""
    return heads * seqlen_q * (cfg.head_dim * (2 * elem_bytes + 4) + 8)


def heads_per_cta(cfg: BackwardConfig, causal: bool, deterministic: bool, group: int, seqlen_q: int,
                  l2_bytes: int, elem_bytes: int = 2) -> int:  # fmt: skip
    """Query heads of the GQA group one CTA walks: the whole group, unless (causal) two pairs' streams would not
    fit L2 together; then the most heads (the group halved, rounding up) whose stream fits twice, so
    :func:`grid_band` starts the long key blocks of two pairs at once and both stay in L2; at least one. An odd
    share is halved only while its own stream exceeds L2 (a 3:1 group at 16 K, whose stream just fits, lost 5 %
    split in three; 7:1 at 8 K and 16 K gained 5.5 % and 11 % split, bench/NOTES.md). The group's CTAs are then
    split ``ceil(group / heads)`` ways, the last taking what is left (7:1 at 8 K as 2 + 2 + 2 + 1), and sum dK and
    dV in fp32 (``head_split``): a reduce-add of each CTA's dK and dV and a postprocess pass, against (whole) every
    step's Q and dO read from HBM and, with few pairs, a ragged tail.
    Measured (H200, Llama-3-70B's 8:1, a 4:1 and a 16:1 group at 8 K, Qwen3-30B-A3B's at 32 K, bench/NOTES.md):
    1.02-1.31x the whole group as planned before; head_dim 256 at 8:1 1.04-1.10x (at 2:1 the same within the
    spread). Without a causal mask the group's CTAs walk the queries in step (one stream, L2-resident);
    deterministic sums keep the group in one CTA."""
    if not causal or deterministic or group == 1:
        return group
    heads = group
    while heads > 1 and 2 * streamed_bytes(cfg, heads, seqlen_q, elem_bytes) > l2_bytes:
        if heads % 2 and streamed_bytes(cfg, heads, seqlen_q, elem_bytes) <= l2_bytes:
            break
        heads = -(-heads // 2)
    return heads


def short_causal(causal: bool, seqlen_q: int) -> bool:
    """Whether a launch's causal walks are short enough (:data:`SHORT_CAUSAL_SEQLEN`) for :func:`grid_band`'s
    widest band, whatever L2 holds."""
    return causal and seqlen_q <= SHORT_CAUSAL_SEQLEN


def grid_band(cfg: BackwardConfig, causal: bool, group: int, seqlen_q: int, pairs: int, l2_bytes: int,
                 elem_bytes: int = 2) -> int:  # fmt: skip
    """How many (key/value head, batch) pairs the backward's grid visits at a time, key block by key block
    (bands of :func:`~epicute.sm90.tile_scheduler.band_coord`). Causal key blocks shorten as they go (key block n sees
    the queries from its diagonal on), so the plain order -- every block of one head, then the next head's --
    runs each head's long blocks together and ends on a ragged tail; a band starts the long blocks of
    several heads at once and ends on short ones. It is as wide as L2 holds what its CTAs stream (each pair:
    Q, dO, dQ's fp32 sum, LSE and D of its ``group`` query heads, :func:`streamed_bytes`), a power of two, at most
    :data:`MAX_GRID_BAND`; up to :data:`SHORT_CAUSAL_SEQLEN` queries, the widest. Without a causal mask the blocks
    are equal: one pair at a time."""
    if not causal:
        return 1
    if short_causal(causal, seqlen_q):
        return min(MAX_GRID_BAND, max(pairs, 1))
    fits = max(1, l2_bytes // max(streamed_bytes(cfg, group, seqlen_q, elem_bytes), 1))
    return min(1 << (fits.bit_length() - 1), MAX_GRID_BAND, max(pairs, 1))


def stat_rows_start(first_row, batch, tile_m: int):
    """Where packed sequence ``batch``, whose rows start at ``first_row``, starts in the preprocess's LSE
    and D rows: a multiple of ``tile_m`` (the kernel's TMA loads of them start 16-byte aligned), at least
    one block past the previous sequence's last block. Host (torch tensors) and kernel (DSL integers)
    compute it alike."""
    return (first_row + batch * tile_m) // tile_m * tile_m


def backward_smem_layout(cfg: BackwardConfig, dtype: str = "bf16") -> SmemLayout:
    """The backward kernel's shared storage: the struct it allocates."""
    d, stages, scores = cfg.head_dim, cfg.stages, cfg.score_buffers
    return SmemLayout((
        SmemBuffer("kv_barriers", "K/V barriers", "int64", 2, "K and V: 1 full + 1 empty mbarrier",
                   align=MBARRIER_BYTES),
        SmemBuffer("qdo_barriers", "Q/dO barriers", "int64", 2 * stages,
                   f"Q/dO ring (Q's, when dO has its own): {stages} full + {stages} empty mbarriers",
                   align=MBARRIER_BYTES),
        *([SmemBuffer("do_barriers", "dO barriers", "int64", 2 * stages,
                      f"dO ring: {stages} full + {stages} empty mbarriers", align=MBARRIER_BYTES)]
          if cfg.split_head_dim else []),
        SmemBuffer("sK", "K (then dK)", dtype, cfg.tile_n * d, f"{cfg.tile_n}x{d} {dtype}; dK is staged here"),
        SmemBuffer("sV", "V (then dV)", dtype, cfg.tile_n * d, f"{cfg.tile_n}x{d} {dtype}; dV is staged here"),
        SmemBuffer("sQ", "Q ring", dtype, cfg.tile_m * d * stages, f"{stages} x {cfg.tile_m}x{d} {dtype}"),
        SmemBuffer("sdO", "dO ring", dtype, cfg.tile_m * d * stages, f"{stages} x {cfg.tile_m}x{d} {dtype}"),
        SmemBuffer("sLSE", "LSE ring", "fp32", cfg.stat_stage_floats * stages,
                   f"{stages} x {cfg.tile_m} fp32 (log2 units)", align=128),
        SmemBuffer("sD", "D ring", "fp32", cfg.stat_stage_floats * stages,
                   f"{stages} x {cfg.tile_m} fp32: rowsum(dO * O)", align=128),
        SmemBuffer("sdS", "dS^T", dtype, cfg.tile_n * cfg.tile_m * scores,
                   f"{scores} x {cfg.tile_n}x{cfg.tile_m} {dtype}: both warpgroups' dS^T, read whole by dQ = dS K"),
        *([SmemBuffer("sP", "P^T", dtype, cfg.tile_n * cfg.tile_m * scores,
                      f"{scores} x {cfg.tile_n}x{cfg.tile_m} {dtype}: both warpgroups' P^T, read whole by dV")]
          if cfg.split_head_dim else []),
        SmemBuffer("sdQ", "dQ staging", "fp32", cfg.tile_m * d,
                   f"{cfg.tile_m}x{d} fp32: each warpgroup's part of dQ"
                   + (" in fragment order" if cfg.dq_fragment_order else "")
                   + ", reduce-added into the fp32 dQ by warp 1"),
    ))  # fmt: skip


def backward_grid(variant, problem, l2_bytes: int) -> tuple[int, int, int]:
    """The backward kernel's launch as the call runs it and explain shows it: (query heads a CTA walks, CTAs per key
    block and batch -- each key/value head's shares of its group --, the grid's band of pairs, :func:`grid_band`)
    of ``variant`` (a :class:`~epicute.attention.backward.BackwardVariant`) for ``problem``."""
    p = problem
    heads = variant.heads_per_cta or p.group
    shares = p.heads_kv * -(-p.group // heads)
    band = grid_band(variant.config, p.causal, heads, p.seqlen_q, shares * p.batch, l2_bytes,
                     DTYPE_BYTES[variant.dtype])  # fmt: skip
    return heads, shares, band


def _grid_order(band: int, causal: bool, pairs: int, varlen: bool, split: bool = False, short: bool = False) -> str:
    """explain's account of :func:`grid_band`'s choice (``split``: a pair is a share of a head's query heads;
    ``short``: :func:`short_causal`)."""
    pair = f"({'head share' if split else 'head'}, {'sequence' if varlen else 'batch'})"
    if band > 1:
        why = "short walks: the launch's tail outweighs L2" if short else f"what {band} pairs' CTAs stream fits L2"
        return (f"key block by key block over {band} {pair} pairs at a time: causal key blocks shorten as they "
                f"go, so the long ones of {band} pairs start together and the launch ends on short ones "
                f"({why})")  # fmt: skip
    why = (
        "without a causal mask every key block sees every query"
        if not causal
        else "a single pair"
        if pairs == 1
        else "what a second pair's CTAs stream would not fit L2 beside it"
    )
    return f"every key block of one {pair} pair, then the next: {why}"


def render_backward_plan(variant, problem, target) -> list[str]:
    """explain's lines for ``variant`` (a :class:`~epicute.attention.backward.BackwardVariant`), the backward
    kernel of ``problem`` (an :class:`~epicute.attention.plan.AttentionProblem`) on ``target`` (a
    :class:`~epicute.runtime.target.Target`): grid, steps, warp roles, dQ's order, shared memory, why."""
    cfg, dtype, p = variant.config, variant.dtype, problem
    key_blocks = -(-p.seqlen_k // cfg.tile_n)
    heads, shares, band = backward_grid(variant, p, target.l2_bytes)
    dq_share = "rows" if cfg.dq_split_rows else "head_dim columns" + (" (dQ^T = K^T dS^T)" if cfg.dq_swap_ab else "")
    ragged = f" ({p.group % heads} in its last share)" if variant.head_split and p.group % heads else ""
    walked = f"{heads} of its {p.group} query heads{ragged}" if variant.head_split else f"{p.group} query head(s)"
    lines = [
        "backward (training: dQ, dK, dV, after a preprocess kernel: D = rowsum(dO * O), LSE, dQ's fp32 sum zeroed; "
        + (
            "then a postprocess kernel un-permutes, scales and casts dQ)"
            if cfg.dq_fragment_order
            else "then one torch pass scales and casts dQ)"
        ),
        (
            f"  grid            ({key_blocks}, {shares}, {p.batch}): a CTA per {cfg.tile_n} keys of a (key/value "
            f"head, {'sequence' if p.varlen else 'batch'}), walking {walked} x every query block "
            "that sees its keys" + (" (from the diagonal)" if p.causal else "")
        ),
        "  grid order      "
        + _grid_order(band, p.causal, shares * p.batch, p.varlen, variant.head_split,
                      short_causal(p.causal, p.seqlen_q)),  # fmt: skip
        f"  steps           {cfg.tile_m} queries per step; Q, dO, LSE and D in a {cfg.stages}-stage TMA ring",
        f"  warpgroup 0     producer: warp 0 TMA loads, warp 1 reduce-adds dQ   setmaxnreg {cfg.producer_regs}",
    ]
    for wg in range(cfg.num_mma_warpgroups):
        if cfg.split_head_dim:
            queries, dims = cfg.tile_m // cfg.num_mma_warpgroups, cfg.head_dim // cfg.num_mma_warpgroups
            lines.append(
                f"  warpgroup {wg + 1}     consumer: S^T, dP^T of queries {wg * queries}-{(wg + 1) * queries - 1}; "
                f"dV, dK, dQ of dims {wg * dims}-{(wg + 1) * dims - 1}   setmaxnreg {cfg.consumer_regs}"
            )
            continue
        lo = wg * KEYS_PER_WARPGROUP
        lines.append(
            f"  warpgroup {wg + 1}     consumer: keys {lo}-{lo + KEYS_PER_WARPGROUP - 1}: S^T, dP^T, dV, dK; half of "
            f"dQ's {dq_share}   setmaxnreg {cfg.consumer_regs}"
        )
    if variant.deterministic:
        lines.append(
            "  dQ order        deterministic: the key blocks take turns adding into each query block, first to last, "
            "through an int32 counter per (query block, head); each CTA walks the query blocks from the last "
            "down, every head of the group at each, so its turns come one add after its predecessor's"
        )
    else:
        lines.append("  dQ order        as the reduce-adds land (deterministic=True fixes it)")
    if variant.head_split:
        streamed = streamed_bytes(cfg, p.group, p.seqlen_q, DTYPE_BYTES[dtype]) / 2**20
        lines.append(
            f"  dK, dV          split: the group's {p.group} query heads over {shares // p.heads_kv} CTAs per key "
            "block, "
            f"as a whole group's CTAs would stream {streamed:.0f} MiB of queries, more than L2 "
            f"({target.l2_bytes / 2**20:.0f} MiB); each CTA reduce-adds its fp32 dK and dV (staged in K's and V's "
            "buffers, fragment order), a postprocess kernel casts them"
        )
    layout = backward_smem_layout(cfg, dtype)
    table = layout.table()
    width = max(len(item.name) for item in table)
    lines += ["  shared memory"]
    lines += [f"    {item.name:<{width}}  {item.bytes:>7} B  {item.what}" for item in table]
    lines.append(f"    {'total':<{width}}  {layout.total_bytes:>7} B  of {target.smem_per_cta_bytes} B")
    lines += ["  why"] + [f"    - {r}" for r in cfg.reasons]
    return lines


__all__ = [
    "BACKWARD_HEAD_DIMS",
    "MAX_GRID_BAND",
    "SHORT_CAUSAL_SEQLEN",
    "BackwardConfig",
    "backward_config",
    "backward_grid",
    "backward_smem_layout",
    "dq_split",
    "grid_band",
    "heads_per_cta",
    "render_backward_plan",
    "short_causal",
    "stat_rows_start",
    "streamed_bytes",
]
