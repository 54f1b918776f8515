"""The grouped GEMM family's ahead-of-time jobs: a ``[[grouped_gemm]]`` spec entry -> the variants its calls
compile: :func:`grouped_variants`, named by its family's declaration (:mod:`epicute.families`; the spec format is in
:mod:`epicute.runtime.aot`)::

    [[grouped_gemm]]
    shapes = [[16384, 14336, 4096, 8]]  # total_M, N, K, G (variable K: M, N, total_K, G)
    dtype = "bf16"                      # bf16 | fp16 | fp8e4m3 | fp8e5m2 (fp8: blockwise scales)
    out_dtype = "bf16"                  # D (default: dtype; bf16 for fp8)
    b_major = "k"                       # "k": w.transpose(-2, -1) of a (G, N, K) weight; "n": (G, K, N)
    mode = "rows"                       # "rows" | "gathered" (a_index) | "variable_k" (x.t(), dy)
    gated = true                        # optional: gate and up interleaved in b, epilogue f(gate, up, ...)
    epilogue = "mypkg.moe:swiglu"       # optional, module:function
    operands = { score = "col:fp32" }   # kind[:dtype] per operand: row (G, N), col (total_M, 1), tile
    config = { cluster_m = 1 }          # optional pins, as grouped_gemm(config=...)

Sizes pick the plan (the mean group's config), not the code's sizes: one kernel serves every routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.aot import check_fields, check_fp8_k, config_pins, epilogue_operand_kinds, import_object, is_size

if TYPE_CHECKING:
    from epicute.runtime.target import Target

MODES = ("rows", "gathered", "variable_k")
FIELDS = {"shapes", "dtype", "out_dtype", "b_major", "mode", "gated", "config", "epilogue", "operands", "out_dtypes"}


def grouped_variants(entry: dict, target: Target | None = None) -> list:
    """The grouped GEMM variants the calls described by one ``[[grouped_gemm]]`` entry would compile on ``target``
    (None: the current one), deduplicated."""
    from epicute.gemm.config import GemmConfig
    from epicute.grouped.prepare import prepare

    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(FIELDS)}")
    shapes = entry.get("shapes")
    if not shapes or not isinstance(shapes, list):
        raise ConfigError(f"shapes = {shapes!r}; give shapes = [[total_M, N, K, G], ...] (sizes pick the plan)")
    for shape in shapes:
        if not (isinstance(shape, list) and len(shape) == 4 and all(is_size(x) for x in shape) and shape[3] >= 1):
            raise ConfigError(f"shape {shape!r}: give [total_M, N, K, G] of integers (G >= 1), e.g. [16384, 4096, "
                              "4096, 8]")  # fmt: skip
    check_fields(entry, str, "b_major", "mode", "epilogue")
    check_fields(entry, dict, "operands", "out_dtypes")
    pins = config_pins(entry, GemmConfig)
    variants = {}
    for shape in shapes:
        request = grouped_request(
            shape, entry.get("dtype", "bf16"), entry.get("out_dtype"), entry.get("b_major"), entry.get("mode", "rows"),
            entry.get("gated", False), entry.get("epilogue"), entry.get("operands") or {},
            entry.get("out_dtypes") or {}, pins, target,
        )  # fmt: skip
        variant = prepare(request).variant()
        total_m, n, k, groups = shape
        variants.setdefault(variant.key(), (variant, f"{total_m}x{n}x{k} G={groups} {request_mode(request)}"))
    return list(variants.values())


def request_mode(request) -> str:
    p = request.problem
    return "variable_k" if p.ragged == "k" else "gathered" if p.gathered else "rows"


def grouped_request(
    shape: list[int], dtype: str, out_dtype: str | None, b_major: str | None, mode: str, gated: bool,
    epilogue: str | None, operands: dict, out_dtypes: dict, pins: dict, target: Target | None = None,
):  # fmt: skip
    """The :class:`~epicute.grouped.prepare.GroupedRequest` of grouped calls described in text (a spec entry, the
    CLI): ``shape`` ``[total_M, N, K, G]``, ``epilogue`` a ``module:function`` path, ``operands``
    ``{name: "kind[:dtype]"}`` (unlisted ones are scalars), ``pins`` config fields."""
    from epicute.epilogue.gated import gated_epilogue
    from epicute.epilogue.tracer import as_epilogue
    from epicute.gemm.config import D_DTYPES, FP8_AB_DTYPES
    from epicute.gemm.prepare import ir_items
    from epicute.grouped.plan import GroupedProblem
    from epicute.grouped.prepare import GroupedRequest

    if dtype not in ("bf16", "fp16", *FP8_AB_DTYPES):
        raise ConfigError(f"dtype = {dtype!r}; the grouped GEMM takes bf16, fp16 or fp8 (blockwise scales)")
    fp8 = dtype in FP8_AB_DTYPES
    d_explicit = out_dtype is not None
    out_dtype = out_dtype or ("bf16" if fp8 else dtype)
    if out_dtype not in D_DTYPES:
        raise ConfigError(f"out_dtype = {out_dtype!r}; D's dtype is one of {', '.join(D_DTYPES)}")
    if mode not in MODES:
        raise ConfigError(f"mode = {mode!r}; one of {', '.join(MODES)}")
    if not isinstance(gated, bool):
        raise ConfigError(f"gated = {gated!r}; true or false")
    variable_k = mode == "variable_k"
    b_major = "n" if variable_k else (b_major or "k")
    epi, kinds = None, ()
    if epilogue:
        epi = (gated_epilogue if gated else as_epilogue)(import_object(epilogue))
        missing = [p for p in epi.params if p not in operands and p not in epi.defaults]
        extra = sorted(set(operands) - set(epi.params))
        if missing or extra:
            raise EpilogueError(f"epilogue {epi.name!r} takes operands {epi.params}: give each as name = "
                                f"'kind[:dtype]' (missing {missing}, unexpected {extra})")  # fmt: skip
        kinds = epilogue_operand_kinds(epi, operands)
    elif operands or out_dtypes or gated:
        raise ConfigError("operands/out_dtypes/gated need an epilogue")
    total_m, n, k, groups = shape
    check_fp8_k(fp8, k)
    problem = GroupedProblem(
        total_m, n, k, groups, dtype, out_dtype, "m" if variable_k else "k", b_major, gated,
        "k" if variable_k else "m", block_scaled=fp8, gathered=mode == "gathered",
    )  # fmt: skip
    return GroupedRequest(problem, epi, kinds, d_explicit, ir_items(out_dtypes, "out_dtypes"),
                          tuple(sorted(pins.items())), target)  # fmt: skip


__all__ = ["grouped_request", "grouped_variants"]
