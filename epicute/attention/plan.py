"""Planning the FlashAttention-3 style forward kernel: problem, config, smem, row ownership.

An :class:`AttentionProblem` is what the user asked for (sizes, heads, dtype,
causal). An :class:`AttentionConfig` is every compile-time choice of the kernel:
``tile_m`` query rows per CTA split over ``num_mma_warpgroups`` consumer
warpgroups (64 rows each, one WGMMA M atom), ``tile_n`` keys per K/V stage,
``stages`` of the K and V rings, ping-pong and intra-warpgroup overlap.

The online softmax reduces each score row inside one warp (in-thread, then a
4-lane shuffle), so it is only correct if the QK^T WGMMA layout hands every
warp whole rows of the score tile. :func:`row_ownership` checks that on a model
of the WGMMA accumulator layout and :meth:`AttentionConfig.validate` refuses
layouts that split a row across warps; ``explain_attention`` prints the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from epicute.attention.fp8 import FP8_INPUT_DTYPES, stored_dtype
from epicute.epilogue.dtypes import DTYPE_BYTES
from epicute.errors import ConfigError
from epicute.runtime.target import Target, resolve_target
from epicute.sm90.smem_layout import MBARRIER_BYTES, SmemBuffer, SmemItem, SmemLayout
from epicute.sm90.tile_grid import launched
from epicute.sm90.warp_roles import WarpRoles

HEAD_DIMS = (64, 128, 256)
#: Rows of one WGMMA atom: each consumer warpgroup owns this many query rows.
WGMMA_M = 64
#: Rows a single warp holds in a WGMMA accumulator (4 warps x 16 = 64).
ROWS_PER_WARP = 16
#: K and V bytes the CTAs in flight share in L2 under causal LPT ordering: FlashAttention-3's
#: figure, two thirds of H100's 50 MiB, the rest left to Q, O and the band edges.
LPT_L2_BUDGET_BYTES = 32 * 1024 * 1024
#: setmaxnreg budgets (producer, each consumer) by consumer warpgroup count: the
#: producer only issues TMA; the consumers take the rest of the 64K register file.
REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
#: Most splits of one tile's keys (split-KV); each writes a partial O the combine reads back.
MAX_SPLITS = 64
#: A split gets at least this many key blocks: fewer would spend its CTA on the prologue and the
#: partial's round trip rather than on streaming K and V.
MIN_BLOCKS_PER_SPLIT = 4


@dataclass(frozen=True)
class AttentionProblem:
    """``O = softmax(Q K^T * scale) V`` per (batch, head); layout ``(batch, seqlen, heads, head_dim)``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str = "bf16"
    causal: bool = False
    #: 0: K and V are ``(batch, seqlen_k, heads_kv, head_dim)``; else they are a paged cache
    #: ``(num_pages, page_size, heads_kv, head_dim)`` read through a page table, and ``seqlen_k``
    #: is a sequence's capacity (pages per sequence x page_size).
    page_size: int = 0
    #: Each sequence uses its own first ``seqused_k[b]`` keys (a device tensor; flash-attn's convention).
    seqused_k: bool = False
    #: Packed variable-length sequences (``cu_seqlens_q/k``): ``batch`` sequences of at most ``seqlen_q``
    #: queries and ``seqlen_k`` keys, so the flops and bytes below are upper bounds.
    varlen: bool = False

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA/MQA)."""
        return self.heads_q // max(self.heads_kv, 1)

    @property
    def flops(self) -> int:
        """Useful matmul FLOPs (2 GEMMs; causal counts the unmasked half, as flash-attn reports)."""
        full = 4 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return full // 2 if self.causal else full


@dataclass(frozen=True)
class AttentionConfig(WarpRoles):
    """Compile-time choices of the SM90 attention forward kernel (see module docstring)."""

    head_dim: int = 128
    tile_m: int = 128
    tile_n: int = 128
    stages: int = 2
    #: Consumer warpgroups take turns at the tensor cores through named barriers.
    pingpong: bool = True
    #: Rescale O for block j while the QK^T WGMMA of block j+1 runs, instead of after PV
    #: retires (pays off when O is large: head_dim > 128).
    rescale_o_early: bool = False
    #: Release each K stage after the block's softmax rather than as soon as S lands. ptxas keeps
    #: the wait for the in-flight PV WGMMA below the last ring release, so the early release lets
    #: that wait (and the V release after it) rise above the softmax; the late one keeps the
    #: softmax under the PV but gives the producer less time to refill K and V. Planned for
    #: causal launches only (see :func:`default_config`).
    release_k_late: bool = True
    #: Keep each row's reference max until a block raises it by more than 2**8, so O's rescale
    #: (head_dim / 2 multiplies per thread and block) runs only on the few blocks that move it.
    lazy_rescale: bool = True
    #: Stage O (and the output epilogue's other tiles) in a buffer of their own instead of Q's, so the consumers
    #: hand Q's buffer back once the tile's last QK^T has retired and the next tile's Q loads under the last PV
    #: and the epilogue (persistent launches: see :func:`choose_o_buffer`).
    o_buffer: bool = False
    #: WGMMA atoms along (M, N) of the QK^T tiled MMA; N must be 1 (whole rows per warp).
    mma_atoms_mn: tuple[int, int] = (2, 1)
    #: Causal launches walk the m-blocks longest-first (the last query rows see the most keys),
    #: over every head of an L2-sized band (see :func:`lpt_heads_per_band`).
    lpt_order: bool = True
    #: One CTA per SM walking work tiles (see :attr:`AttentionPlan.grid`), instead of one CTA per tile.
    persistent: bool = False
    #: Persistent CTAs claim their next tile from a global atomic counter (in the tile order above)
    #: instead of striding by the grid: tiles of unequal length (causal) keep the longest-first balance.
    dynamic_tiles: bool = False
    #: Query heads that share a key/value head, packed into one tile's rows (row ``r`` is query
    #: ``r // pack_rows`` of head ``r % pack_rows`` of the group): a decode tile reads each K/V block
    #: once for all of them. 1: a tile holds one head's queries. Compile-time (it shapes the TMA boxes).
    pack_gqa: int = 1
    #: Split each tile's keys over ``num_splits`` CTAs, which write fp32 partial O and LSE; a second
    #: kernel combines them weighted by their LSEs in split order (deterministic).
    split_kv: bool = False
    #: How many splits (a launch argument: changing it does not recompile).
    num_splits: int = field(default=1, compare=False, hash=False)
    producer_regs: int = 24
    consumer_regs: int = 240
    reasons: tuple[str, ...] = field(default=(), compare=False, hash=False)

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // WGMMA_M

    @property
    def pack_rows(self) -> int:
        """Rows each query takes in a packed tile: ``pack_gqa`` padded to a power of two, so that
        whole queries fill the tile (a group of 3, 5 or 7 heads takes 4, 8 or 8 rows; the padded
        rows are zero-filled on load and never stored)."""
        return packed_rows(self.pack_gqa)

    def validate(self, target: Target | str | None = None, dtype: str = "bf16") -> None:
        """Raise :class:`ConfigError` for a configuration the kernel cannot run on ``target``
        (default: the visible GPU, else an H100 SXM)."""
        hw = resolve_target(target)
        if self.head_dim not in HEAD_DIMS:
            raise ConfigError(f"head_dim={self.head_dim}: supported are {HEAD_DIMS}")
        if self.tile_m % WGMMA_M or not 1 <= self.num_mma_warpgroups <= 3:
            raise ConfigError(f"tile_m={self.tile_m}: must be 64, 128 or 192 (64 query rows per consumer warpgroup)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ConfigError(f"tile_n={self.tile_n}: must be a multiple of 16 in [16, 256] (WGMMA N and PV's K)")
        if self.stages < 1:
            raise ConfigError(f"stages={self.stages}: need at least 1")
        if dtype in FP8_INPUT_DTYPES and self.tile_n % 32:
            raise ConfigError(
                f"tile_n={self.tile_n}: fp8 attention needs a multiple of 32 (the fp8 PV WGMMA's K, and the "
                "keys-contiguous value tile's swizzle)"
            )
        if self.mma_atoms_mn != (self.num_mma_warpgroups, 1):
            ownership = row_ownership(self)
            if not ownership.whole_rows:
                raise ConfigError(
                    f"mma_atoms_mn={self.mma_atoms_mn}: {ownership.problem}; the online softmax reduces a score "
                    f"row inside one warp, so use mma_atoms_mn=({self.num_mma_warpgroups}, 1)"
                )
            raise ConfigError(
                f"mma_atoms_mn={self.mma_atoms_mn}: must tile tile_m={self.tile_m} as ({self.num_mma_warpgroups}, 1)"
            )
        if not 1 <= self.pack_gqa <= WGMMA_M or (self.pack_gqa > 1 and self.tile_m != WGMMA_M):
            raise ConfigError(
                f"pack_gqa={self.pack_gqa}: packs 1 to {WGMMA_M} query heads per key/value head into a decode tile "
                f"(tile_m={WGMMA_M}; this config has tile_m={self.tile_m})"
            )
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ConfigError(f"num_splits={self.num_splits}: must be in [1, {MAX_SPLITS}]")
        if self.num_splits > 1 and not self.split_kv:
            raise ConfigError(f"num_splits={self.num_splits} needs split_kv=True")
        if self.dynamic_tiles and not self.persistent:
            raise ConfigError("dynamic_tiles=True needs persistent=True (one CTA per tile has nothing to claim)")
        if self.pingpong and self.num_mma_warpgroups < 2:
            raise ConfigError("pingpong=True needs at least 2 consumer warpgroups (tile_m >= 128)")
        self.validate_registers()
        total = attention_smem_total(self, dtype)
        if total > hw.smem_per_cta_bytes:
            fix = ("o_buffer=False (stage O in Q's buffer), or lower stages or tile_n" if self.o_buffer
                   else "lower stages or tile_n")  # fmt: skip
            raise ConfigError(f"shared memory: {total} B needed, {hw.smem_per_cta_bytes} B available; {fix}")


@dataclass(frozen=True)
class RowOwnership:
    """Which warp holds which score rows under a QK^T tiled-MMA layout."""

    whole_rows: bool
    #: (warpgroup, warp, first row, last row) per warp, when rows are whole
    warps: tuple[tuple[int, int, int, int], ...]
    problem: str = ""


def _wgmma_fragment(atom_m: int, atom_n: int, tile_n_atom: int) -> dict[tuple[int, int], set[int]]:
    """(row, col) -> global warp ids holding it, for a grid of m64nN WGMMA atoms.

    In an m64nNk16 accumulator, lane ``l`` of warp ``w`` holds rows
    ``16 w + l // 4 (+ 8)`` and columns ``8 j + 2 (l % 4) (+ 1)``; atom ``(i, j)``
    of the grid is run by warpgroup ``i + atom_m * j``.
    """
    owners: dict[tuple[int, int], set[int]] = {}
    for am in range(atom_m):
        for an in range(atom_n):
            wg = am + atom_m * an
            for w in range(4):
                for lane in range(32):
                    for dr in (0, 8):
                        row = am * WGMMA_M + ROWS_PER_WARP * w + lane // 4 + dr
                        for j in range(tile_n_atom // 8):
                            for dc in (0, 1):
                                col = an * tile_n_atom + 8 * j + 2 * (lane % 4) + dc
                                owners.setdefault((row, col), set()).add(4 * wg + w)
    return owners


def row_ownership(cfg: AttentionConfig) -> RowOwnership:
    """Check, on the WGMMA accumulator model, that each score row lives in exactly one warp."""
    atom_m, atom_n = cfg.mma_atoms_mn
    if cfg.tile_n % atom_n or (cfg.tile_n // atom_n) % 8:
        return RowOwnership(False, (), f"tile_n={cfg.tile_n} does not split into {atom_n} WGMMA atoms")
    owners = _wgmma_fragment(atom_m, atom_n, cfg.tile_n // atom_n)
    by_row: dict[int, set[int]] = {}
    for (row, _), warps in owners.items():
        by_row.setdefault(row, set()).update(warps)
    split = sorted(r for r, w in by_row.items() if len(w) > 1)
    if split:
        return RowOwnership(
            False, (), f"row {split[0]} of the score tile is spread over warps {sorted(by_row[split[0]])}"
        )
    rows_of: dict[int, list[int]] = {}
    for row, (warp,) in by_row.items():
        rows_of.setdefault(warp, []).append(row)
    warps = tuple((w // 4, w % 4, min(r), max(r)) for w, r in sorted(rows_of.items()))
    return RowOwnership(True, warps)


def default_config(
    head_dim: int, causal: bool, decode: dict | None = None, dtype: str = "bf16", score_mod: bool = False,
    target: Target | str | None = None, **overrides,
) -> AttentionConfig:
    """The FA3 tile choices for H100, with every field overridable; ``decode``: the decode plan's
    choices (:func:`decode_choices`), which replace the head_dim rules; ``dtype``: the inputs'; ``score_mod``:
    whether a score_mod runs (its registers count at fp8 head_dim 256); ``target``: whose shared memory
    bounds :func:`choose_o_buffer` (default: the visible GPU, else an H100 SXM)."""
    if head_dim not in HEAD_DIMS:
        raise ConfigError(f"head_dim={head_dim}: supported are {HEAD_DIMS}")
    if decode is not None:
        base = dict(decode)
        why = base.pop("why")
    elif dtype in FP8_INPUT_DTYPES and head_dim == 128:
        base = {"tile_m": 192, "tile_n": 96, "mma_atoms_mn": (3, 1)}
        why = (
            "fp8, head_dim 128: 192x96 tiles, 3 warpgroups taking turns at the tensor cores: fp8's GEMMs take half "
            "bf16's time, so a warpgroup's softmax needs two others' GEMMs to hide behind (7-11 % above 128x128 "
            "and 128x224 at 4k-16k keys, bench/NOTES.md); 96 keys keep 3 x 160 registers spill-free"
        )
    elif dtype in FP8_INPUT_DTYPES and head_dim == 256:
        tile_n = 96 if score_mod else 128
        base = {"tile_m": 128, "tile_n": tile_n, "pingpong": False, "rescale_o_early": True}
        why = (
            f"fp8, head_dim 256: 128x{tile_n} tiles (fp8 K and V stages take half the bytes, so more keys fit than "
            "bf16's 80), no ping-pong, O rescaled under the QK^T WGMMA"
            + ("; 96 keys with a score_mod, whose registers make 128 spill" if score_mod else "")
        )
    elif head_dim == 64:
        base = {"tile_m": 192, "tile_n": 128}
        why = (
            "head_dim 64: 192x128 tiles, 3 warpgroups taking turns at the tensor cores: d64's short WGMMAs "
            "need a third warpgroup's softmax to hide behind (3 x 128 threads x 160 registers + 128 x 32 "
            "fills the 64K register file)"
        )
    elif head_dim == 128:
        base = {"tile_m": 128, "tile_n": 128}
        why = "head_dim 128: 128x128 tiles, 2 warpgroups ping-ponging (FA3's choice)"
    elif not causal:
        base = {"tile_m": 128, "tile_n": 80, "pingpong": False, "rescale_o_early": True}
        why = (
            "head_dim 256: 128x80 tiles so two K/V stages fit in smem; no ping-pong (softmax is cheap next to "
            "the GEMMs); O (128 fp32 registers per thread) is rescaled under the QK^T WGMMA"
        )
    else:
        base = {"tile_m": 128, "tile_n": 80, "pingpong": False, "rescale_o_early": False}
        why = (
            "head_dim 256, causal: 128x80 tiles, no ping-pong; O is rescaled after PV, as masked diagonal "
            "blocks leave the QK^T WGMMA too short to hide it (bench/NOTES.md, 'Attention configurations and "
            "profiles')"
        )
    # Without causal masking every block is full and the rings are the bottleneck: K and V stages
    # go back to the producer as early as possible. Causal launches keep the softmax under the PV
    # WGMMA instead (bench/NOTES.md, 'The K release, by mask' and 'The lost softmax/PV overlap').
    base.update(head_dim=head_dim)
    base.setdefault("release_k_late", causal)
    # Lazy rescaling skips O's rescale (head_dim / 2 multiplies per thread) on most blocks: at d128 and
    # d256 that beats its vote and branch; at d64 the rescale is 32 multiplies and it is a wash
    # (bench/NOTES.md, 'Lazy rescaling').
    base.setdefault("lazy_rescale", head_dim >= 128)
    # Persistent CTAs: the next tile's first K block and Q load run under the current tile's
    # epilogue (bench/NOTES.md, 'Persistent CTAs'). Causal tiles differ in length: striding by the
    # grid loses the longest-first balance, so they claim tiles from a counter (bench/NOTES.md,
    # 'Dynamic tile scheduling for causal attention'). Every persistent launch claims its tiles
    # from a counter, full attention too: the tiles in flight then stay a contiguous window of the
    # m-block-fastest order (K and V of a few heads in L2), where striding by the grid lets CTAs
    # drift apart (bench/NOTES.md, 'Every persistent launch claims its tiles').
    base.setdefault("persistent", True)
    base.update(overrides)
    base.setdefault("dynamic_tiles", base["persistent"])
    base.setdefault("split_kv", base.get("num_splits", 1) > 1)
    warpgroups = base["tile_m"] // WGMMA_M
    base.setdefault("mma_atoms_mn", (warpgroups, 1))
    if warpgroups in REGISTER_SPLIT:  # other tile_m values are refused by validate()
        base.setdefault("producer_regs", REGISTER_SPLIT[warpgroups][0])
        base.setdefault("consumer_regs", REGISTER_SPLIT[warpgroups][1])
    if not base["persistent"]:
        order = "one CTA per tile"
    else:
        order = "one persistent CTA per SM: a tile's first K block and Q load under the previous tile's epilogue"
        if base.get("dynamic_tiles"):
            order += (
                "; each CTA claims its next tile from an atomic counter (causal tiles differ in length; "
                "full ones stay a contiguous window of the tile order)"
            )
    if causal and base.get("lpt_order", True):
        order += "; longest query blocks first, a band of L2-sized heads at a time"
    cfg = AttentionConfig(**base, reasons=(why, order))
    if decode is None and "o_buffer" not in overrides:
        cfg = choose_o_buffer(cfg, dtype, resolve_target(target))
    return cfg


def packed_rows(group: int) -> int:
    """Rows a query of a packed GQA group takes: the group padded to a power of two (which divides
    the 64-row tile, so a TMA box holds whole queries)."""
    return 1 << (max(group, 1) - 1).bit_length()


#: Query rows (packed heads x queries) up to which a problem is decode-shaped: one consumer
#: warpgroup's WGMMA M. Beyond it the prefill tiles apply.
DECODE_ROWS = WGMMA_M
#: Keys per K/V block of decode tiles by head_dim: 128 (64 at d256, so three stages fit beside Q).
DECODE_TILE_N = {64: 128, 128: 128, 256: 64}
#: K/V ring depth of decode tiles by head_dim. At d128 two 64 KB stages measured ~1 % above three
#: (bench/NOTES.md, 'Decode attention'); d64 and d256 take what fits beside Q (not measured apart).
DECODE_STAGES = {64: 6, 128: 2, 256: 3}
#: Decode tiles that fit two CTAs on an SM, by head_dim: two 64-key stages of K and V (64 KB) beside Q's 16 KB,
#: and 128 x (24 + 232) registers, one CTA per tile (or split). Planned where the CTAs fill at least half the SMs:
#: 1.1 % above one persistent CTA per SM at batch 64 x 8192 keys (512 tiles), 1.8 % at 8 x 32768 (2 splits) and
#: 2.6 % at 1 x 131072 (16 splits) (bench/NOTES.md, 'Decode attention: two CTAs per SM'); d64 and d256 not measured.
TWO_PER_SM = {128: {"tile_n": 64, "stages": 2, "producer_regs": 24, "consumer_regs": 232}}


def page_tile_n(tile_n: int, page_size: int) -> int:
    """The largest block of at most ``tile_n`` keys (a power of two, at least 16) that tiles a
    ``page_size``-key page (a multiple of 16): each K/V block is one TMA box inside one page."""
    return max(t for t in (16, 32, 64, 128, 256) if t <= max(tile_n, 16) and page_size % t == 0)


def decode_choices(problem: AttentionProblem, hw: Target, plain_output: bool = True) -> dict | None:
    """The decode plan for ``problem`` (a config's fields plus ``why``), or None for prefill shapes.

    Decode-shaped: the query heads of a GQA group (padded to :func:`packed_rows`) times the queries
    per sequence fit one 64-row warpgroup tile. Such a tile packs the group's heads (one K/V read
    serves them all), and when its tiles leave SMs idle, each tile's keys are split over several CTAs (split-KV) whose
    partial results a second kernel combines. Both need the kernel to write O itself (no output
    epilogue); ``plain_output=False`` keeps the prefill plan."""
    p = problem
    rows = packed_rows(p.group) * p.seqlen_q
    if not plain_output or p.varlen or rows > DECODE_ROWS or p.seqlen_q > DECODE_ROWS:
        return None
    # Decode streams K and V: a stage holds as many bytes whatever the dtype, so fp8 blocks take twice the keys.
    widen = 2 // DTYPE_BYTES[p.dtype]
    tile_n = min(DECODE_TILE_N[p.head_dim] * widen, 256)
    if p.page_size:
        tile_n = page_tile_n(tile_n, p.page_size)
    pack = p.group if p.group > 1 else 1
    tiles = p.batch * p.heads_kv if pack > 1 else p.batch * p.heads_q
    blocks = -(-p.seqlen_k // tile_n)
    splits = min(hw.num_sms // max(tiles, 1), blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS)
    splits = max(splits, 1)
    # At d128 the CTAs are sized so that two fit an SM (TWO_PER_SM) where they fill half the SMs or more: an SM
    # can then stream two tiles' K and V, and a CTA that finishes frees its slot to the next tile at once.
    two_per_sm = TWO_PER_SM.get(p.head_dim) if 2 * tiles * splits >= hw.num_sms else None
    stages = two_per_sm["stages"] if two_per_sm else DECODE_STAGES[p.head_dim]
    if two_per_sm:
        tile_n = min(tile_n, two_per_sm["tile_n"] * widen)
    why = (
        f"decode-shaped ({p.seqlen_q} quer{'y' if p.seqlen_q == 1 else 'ies'} x {p.group} head"
        f"{'s' if p.group > 1 else ''} per K/V head"
        + (f", padded to {packed_rows(p.group)} rows a query," if packed_rows(p.group) != p.group else "")
        + f" <= {DECODE_ROWS} rows): 64x{tile_n} tiles, one consumer "
        f"warpgroup, {stages} K/V stages"
        + (f"; the {pack} query heads of a GQA group packed into one tile's rows, so each K/V block is "
           "read once for all of them" if pack > 1 else "")
        + (f"; {tiles} tiles leave SMs idle: each tile's {blocks} key blocks split over {splits} CTAs "
           f"(>= {MIN_BLOCKS_PER_SPLIT} blocks each), combined by LSE in split order" if splits > 1 else "")
        + (f"; {tile_n}-key blocks tile the {p.page_size}-key pages" if p.page_size else "")
        + (f"; one CTA per tile{' split' if splits > 1 else ''}, sized so that two fit an SM "
           f"({two_per_sm['producer_regs']} + {two_per_sm['consumer_regs']} registers per thread)"
           if two_per_sm else "")
    )  # fmt: skip
    choices = {
        "tile_m": WGMMA_M, "tile_n": tile_n, "stages": stages, "pingpong": False,
        "rescale_o_early": False, "release_k_late": False, "pack_gqa": pack, "num_splits": splits, "why": why,
    }  # fmt: skip
    if two_per_sm:
        choices.update(two_per_sm, tile_n=tile_n, persistent=False)
    return choices


def lpt_keys_per_band(head_dim: int, esize: int = 2) -> int:
    """Keys whose K and V rows fit :data:`LPT_L2_BUDGET_BYTES` together (a compile-time constant)."""
    return LPT_L2_BUDGET_BYTES // (2 * head_dim * esize)


def lpt_heads_per_band(head_dim: int, seqlen_k: int, esize: int = 2) -> int:
    """Heads whose K and V (``seqlen_k x head_dim`` each) fit the budget, at least one; the kernel
    divides :func:`lpt_keys_per_band` by its runtime seqlen_k the same way."""
    return max(lpt_keys_per_band(head_dim, esize) // max(seqlen_k, 1), 1)


def attention_smem_layout(cfg: AttentionConfig, dtype: str = "bf16") -> SmemLayout:
    """The kernel's shared storage (fields ``q_barriers``, ``k_barriers``, ``v_barriers``,
    ``tile_slot``, ``sQ``, ``sK``, ``sV``): the struct it allocates and the table explain prints."""
    barrier = MBARRIER_BYTES
    fp8 = dtype in FP8_INPUT_DTYPES
    staged = stored_dtype(dtype)
    tile = f"{cfg.tile_m}x{cfg.head_dim}"
    if cfg.o_buffer:
        q_what = f"{tile} {dtype}; handed back after the tile's last QK^T"
    elif fp8:
        q_what = (f"{tile} {dtype} in the first half; the epilogue stages each {staged} output tile in the whole "
                  "buffer for its TMA store")
    else:
        q_what = f"{tile} {dtype}; the epilogue stages each output tile here for its TMA store"
    outputs = SmemBuffer("sO", "outputs", staged, cfg.tile_m * cfg.head_dim,
                         f"{tile} {staged}: each output tile staged in turn for its TMA store")
    o_buffer = (outputs,) if cfg.o_buffer else ()
    v_what = (f"{cfg.stages} x {cfg.head_dim}x{cfg.tile_n} {dtype}, keys contiguous (the fp8 WGMMA reads V^T K-major)"
              if fp8 else f"{cfg.stages} x {cfg.tile_n}x{cfg.head_dim} {dtype}")
    return SmemLayout((
        SmemBuffer("q_barriers", "Q barriers", "int64", 2, "Q ring: 1 full + 1 empty mbarrier", align=barrier),
        SmemBuffer("k_barriers", "K barriers", "int64", 2 * cfg.stages,
                   f"K ring: {cfg.stages} full + {cfg.stages} empty mbarriers", align=barrier),
        SmemBuffer("v_barriers", "V barriers", "int64", 2 * cfg.stages,
                   f"V ring: {cfg.stages} full + {cfg.stages} empty mbarriers", align=barrier),
        SmemBuffer("tile_slot", "tile slot", "int32", 10,
                   "int32 x 5 x 2: a dynamic tile and its coordinates (m-block, head, batch, split), announced with "
                   "its Q load, in the half of the Q ring's phase", align=4),
        SmemBuffer("sQ", "Q" if cfg.o_buffer else "Q (then outputs)", dtype if cfg.o_buffer else staged,
                   cfg.tile_m * cfg.head_dim, q_what),
        SmemBuffer("sK", "K ring", dtype, cfg.tile_n * cfg.head_dim * cfg.stages,
                   f"{cfg.stages} x {cfg.tile_n}x{cfg.head_dim} {dtype}"),
        SmemBuffer("sV", "V ring", dtype, cfg.tile_n * cfg.head_dim * cfg.stages, v_what),
        *o_buffer,
    ))  # fmt: skip


def attention_smem_table(cfg: AttentionConfig, dtype: str = "bf16") -> list[SmemItem]:
    """Every region of the kernel's shared storage, in order (the kernel's struct, by construction)."""
    return attention_smem_layout(cfg, dtype).table()


def attention_smem_total(cfg: AttentionConfig, dtype: str = "bf16") -> int:
    return attention_smem_layout(cfg, dtype).total_bytes


@dataclass(frozen=True, repr=False)
class AttentionPlan:
    problem: AttentionProblem
    config: AttentionConfig
    #: the GPU planned for: its SM count bounds the persistent grid (a launch argument, not code)
    target: Target

    def __repr__(self) -> str:
        # One line, so a REPL echoing explain_attention()'s result does not bury the text it printed.
        p, c = self.problem, self.config
        return (
            f"<AttentionPlan b{p.batch} sq{p.seqlen_q} sk{p.seqlen_k} h{p.heads_q}/{p.heads_kv} d{p.head_dim}"
            f"{' causal' if p.causal else ''}: tile {c.tile_m}x{c.tile_n}, grid {self.grid}>"
        )

    @property
    def rows(self) -> int:
        """Query rows of one tile's (batch, head): seqlen_q, or with packed GQA (padded) heads x seqlen_q."""
        return self.problem.seqlen_q * (self.config.pack_rows if self.config.pack_gqa > 1 else 1)

    @property
    def m_blocks(self) -> int:
        return -(-self.rows // self.config.tile_m)

    @property
    def lpt(self) -> bool:
        """Causal work order: longest query blocks first over a linear grid."""
        return self.problem.causal and self.config.lpt_order

    @property
    def num_tiles(self) -> int:
        """Work tiles: ``tile_m`` query rows of one (batch, head) -- a key/value head's with packed
        GQA -- and, with split-KV, one split of its keys."""
        heads = self.problem.heads_q // self.config.pack_gqa
        return self.m_blocks * heads * self.problem.batch * self.config.num_splits

    @property
    def max_ctas(self) -> int:
        """The persistent kernel's CTA budget on :attr:`target` (one per SM): its launch argument
        (``AttentionSm90.__call__``'s ``max_ctas``), never part of its compile key."""
        return self.target.num_sms

    @property
    def grid(self) -> tuple[int, int, int]:
        """One CTA per tile, or (persistent) one per SM walking tiles ``x, x + grid, ...`` or
        (``dynamic_tiles``) claiming them from a counter; the kernel computes the same on the device
        from ``max_ctas`` with the same function (:func:`epicute.sm90.tile_grid.launched`)."""
        return (launched(self.num_tiles, self.max_ctas, self.config.persistent), 1, 1)

    @property
    def flops(self) -> int:
        return self.problem.flops

    @property
    def min_bytes(self) -> int:
        """Q, K, V read once, O written once (and the fp32 LSE)."""
        p = self.problem
        elem = DTYPE_BYTES[p.dtype]
        q_o = p.batch * p.seqlen_q * p.heads_q * p.head_dim * (elem + DTYPE_BYTES[stored_dtype(p.dtype)])
        k_v = 2 * p.batch * p.seqlen_k * p.heads_kv * p.head_dim * elem
        return q_o + k_v + 4 * p.batch * p.heads_q * p.seqlen_q


def plan_attention(
    problem: AttentionProblem, target: Target | str | None = None, plain_output: bool = True,
    score_mod: bool = False, **overrides,
) -> AttentionPlan:
    """Choose and validate the kernel configuration for ``problem`` on ``target`` (a :class:`Target`
    or its name; default: the visible GPU, else an H100 SXM); ``plain_output``: no output epilogue
    (decode plans need the kernel to store O itself: :func:`decode_choices`); ``score_mod``: one runs."""
    hw = resolve_target(target)
    decode = decode_choices(problem, hw, plain_output)
    cfg = default_config(problem.head_dim, problem.causal, decode, problem.dtype, score_mod, hw, **overrides)
    if problem.page_size and problem.page_size % cfg.tile_n and "tile_n" not in overrides:
        tile_n = page_tile_n(cfg.tile_n, problem.page_size)
        why = f"{tile_n}-key blocks tile the {problem.page_size}-key pages"
        cfg = replace(cfg, tile_n=tile_n, reasons=(*cfg.reasons, why))
    cfg.validate(hw, problem.dtype)
    if cfg.pack_gqa not in (1, problem.group):
        raise ConfigError(
            f"pack_gqa={cfg.pack_gqa}: a tile packs all {problem.group} query heads of a key/value head, or none (1)"
        )
    if not plain_output and (cfg.pack_gqa > 1 or cfg.split_kv):
        raise ConfigError(
            "pack_gqa and split_kv need the kernel to store O itself: they take no output epilogue "
            "(drop the epilogue, or the pack_gqa/num_splits pins)"
        )
    if problem.page_size % cfg.tile_n:
        raise ConfigError(
            f"tile_n={cfg.tile_n} does not divide page_size={problem.page_size}: each K/V block must lie in one "
            f"page (try tile_n={page_tile_n(cfg.tile_n, problem.page_size)})"
        )
    return AttentionPlan(problem, cfg, hw)


def choose_o_buffer(cfg: AttentionConfig, dtype: str, hw: Target) -> AttentionConfig:
    """``cfg`` with its outputs staged in a buffer of their own where a persistent prefill launch has the shared
    memory for it: Q's buffer then goes back to the producer after the tile's last QK^T instead of after the O store,
    and the next tile's Q loads under the last PV and the epilogue (2-4 % at 2K keys, nothing measurable at 8K:
    bench/NOTES.md, 'O's own staging buffer'). Split-KV tiles store fp32 partials without staging."""
    if not cfg.persistent or cfg.split_kv:
        return cfg
    staged = replace(cfg, o_buffer=True)
    total = attention_smem_total(staged, dtype)
    if total > hw.smem_per_cta_bytes:
        return cfg
    why = (f"outputs staged in their own {cfg.tile_m}x{cfg.head_dim} buffer ({total} B of smem in all): Q's buffer "
           "goes back after the tile's last QK^T, so the next tile's Q loads under the last PV and the epilogue")
    return replace(staged, reasons=(*cfg.reasons, why))


def render_attention_plan(plan: AttentionPlan, chain: tuple = ()) -> str:
    """The text ``epicute.explain_attention`` prints; ``chain``: the output epilogue's stages (the
    prepared call's :attr:`~epicute.attention.prepare.PreparedAttention.chain`), printed last."""
    p, c, hw = plan.problem, plan.config, plan.target
    group = p.heads_q // p.heads_kv
    lines = [
        f"epicute attention plan: O[{p.batch}x{p.seqlen_q}x{p.heads_q}x{p.head_dim}] = softmax(Q K^T) V, "
        f"seqlen_k={p.seqlen_k}, {p.dtype}" + (", causal (bottom-right aligned)" if p.causal else ""),
        f"  heads: {p.heads_q} query / {p.heads_kv} key-value ({'MHA' if group == 1 else f'GQA {group}:1'})",
        f"  target          {hw.describe()}",
        "",
        "tiles",
        f"  CTA tile        {c.tile_m} query rows x {c.tile_n} keys, head_dim {c.head_dim}",
        f"  grid            {plan.grid} x {c.num_threads} threads, "
        + (
            f"persistent over {plan.num_tiles} tiles"
            + (" (each CTA claims its next from an atomic counter): " if c.dynamic_tiles else " (strided): ")
            if c.persistent
            else "one CTA per tile: "
        )
        + ("splits fastest, then " if c.split_kv else "")
        + (
            f"m-blocks x heads x batch walked longest-first in bands of "
            f"{lpt_heads_per_band(p.head_dim, p.seqlen_k, DTYPE_BYTES[p.dtype])} heads (K+V fit L2)"
            if plan.lpt
            else ("m-block" if c.split_kv else "m-block fastest") + ", then head, then batch"
        ),
    ]
    if c.pack_gqa > 1:
        lines.append(
            f"  GQA packing     the {c.pack_gqa} query heads of a K/V head share a tile: row r is query "
            f"r // {c.pack_rows} of head r % {c.pack_rows} ({plan.rows} rows per K/V head"
            + (f"; rows with r % {c.pack_rows} >= {c.pack_gqa} pad the group to a power of two: zero-filled "
               "on load, never stored)" if c.pack_rows != c.pack_gqa else ")")
        )
    if c.split_kv:
        lines.append(
            f"  split-KV        each tile's keys split over {c.num_splits} CTAs writing fp32 partial O and LSE; "
            "a combine kernel weights them by LSE and adds them in split order"
        )
    if p.page_size:
        lines.append(
            f"  paged KV        {p.page_size}-key pages through page_table: each {c.tile_n}-key block is one "
            "TMA box of one page"
        )
    if p.dtype in FP8_INPUT_DTYPES:
        lines.append(
            f"  fp8             e4m3 Q, K, V; S = Q K^T and O = P V as fp8 WGMMAs, O stored {stored_dtype(p.dtype)}; "
            "q_descale * k_descale folded into the softmax scale, v_descale into the final 1 / row sum; P "
            "rounded to e4m3 and handed to the PV WGMMA register for register, V read keys-contiguous with its keys "
            "in the same order within each 16 (one pass over V before the kernel: epicute.attention.fp8)"
        )
    if p.seqused_k:
        lines.append("  seqused_k       each sequence reads its own first seqused_k[b] keys (masked past them)")
    if p.varlen:
        lines.append(
            f"  varlen          {p.batch} packed sequences (cu_seqlens), the longest {p.seqlen_q} queries / "
            f"{p.seqlen_k} keys: tiles cut from the longest, blocks past a shorter one's rows skipped, O stored "
            "through a ragged TMA view that clips at each sequence's end (sizes above are upper bounds)"
        )
    lines += [
        "",
        "warp roles",
        "  warpgroup 0     producer: warp 0 issues TMA loads of each tile's first K block, Q, then K and V   "
        "setmaxnreg " + str(c.producer_regs),
    ]
    for wg in range(c.num_mma_warpgroups):
        lines.append(
            f"  warpgroup {wg + 1}     consumer: rows {wg * WGMMA_M}-{(wg + 1) * WGMMA_M - 1}: QK^T, online softmax, "
            f"PV, epilogue   setmaxnreg {c.consumer_regs}"
        )
    lines += [
        "  ping-pong       " + (
            "each warpgroup arrives at the next one's scheduler barrier after issuing its GEMMs, "
            "syncs on its own before the next ones (warpgroup 1 pre-armed)" if c.pingpong else "off"),
        (
            "  overlap         softmax of block j+1 runs while the PV WGMMA of block j is in flight"
            + ("; O is rescaled under the QK^T WGMMA" if c.rescale_o_early else "")
            + ("; K stages released after the softmax" if c.release_k_late else "; K stages released when S lands")
        ),
        "  rescale         " + (
            "lazy: a row's reference max moves only when a block raises it by more than 2^8; "
            "a warp skips O's rescale unless one of its rows moved" if c.lazy_rescale
            else "every block (O times exp2 of the max's change)"),
        "",
        "score-row ownership (online softmax reduces rows inside a warp)",
    ]  # fmt: skip
    own = row_ownership(c)
    if own.whole_rows:
        lines.append(
            f"  ok: QK^T atoms {c.mma_atoms_mn}; every warp holds whole rows of the {c.tile_m}x{c.tile_n} tile"
        )
        for wg, w, lo, hi in own.warps:
            lines.append(f"    warpgroup {wg + 1} warp {w}: rows {lo}-{hi}, all {c.tile_n} columns")
    else:
        lines.append(f"  REFUSED: {own.problem}")
    lines += ["", "shared memory"]
    table = attention_smem_table(c, p.dtype)
    width = max(len(item.name) for item in table)
    for item in table:
        lines.append(f"  {item.name:<{width}}  {item.bytes:>7} B  {item.what}")
    total = sum(item.bytes for item in table)
    lines.append(f"  {'total':<{width}}  {total:>7} B  of {hw.smem_per_cta_bytes} B")
    compute_s = plan.flops / (hw.peak_tflops(p.dtype) * 1e12)
    memory_s = plan.min_bytes / (hw.hbm_tb_per_s * 1e12)
    lines += [
        "",
        "roofline",
        (
            f"  work            {plan.flops / 1e9:.2f} GFLOP, {plan.min_bytes / 1e6:.2f} MB moved at least "
            f"(intensity {plan.flops / max(plan.min_bytes, 1):.0f} FLOP/B)"
        ),
        f"  compute bound   {compute_s * 1e6:.1f} us at {hw.peak_tflops(p.dtype):.0f} TFLOP/s",
        f"  memory bound    {memory_s * 1e6:.1f} us at {hw.hbm_tb_per_s:.2f} TB/s",
        f"  waves           {plan.num_tiles / hw.num_sms:.2f} ({plan.num_tiles} tiles on {hw.num_sms} SMs)",
    ]
    lines += ["", "why"] + [f"  - {r}" for r in c.reasons]
    if c.split_kv:
        lines += [
            "",
            "output (split-KV)",
            "  partials        each split stores its rows' normalized O (fp32) and LSE over its keys",
            (
                "  combine         a second kernel, one warp per query row: LSE = log sum_i exp(LSE_i); "
                f"O = sum_i exp(LSE_i - LSE) O_i in split order; O cast to {p.dtype} and stored with LSE"
            ),
        ]
    elif chain:
        where = "their own buffer" if c.o_buffer else "Q's buffer"
        lines += ["", f"output epilogue chain (the O tile is one subtile; outputs staged in {where} in turn)"]
        lines += [f"  {stage}" for stage in chain]
    return "\n".join(lines)
