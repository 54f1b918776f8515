"""The GEMM family's ahead-of-time jobs: a ``[[gemm]]`` spec entry -> the variants its calls compile.

Its family's declaration (:mod:`epicute.families`) names :func:`gemm_variants`, which ``epicute compile`` runs per
entry; the format is in :mod:`epicute.runtime.aot`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from epicute.errors import ConfigError, EpilogueError
from epicute.runtime.aot import check_fields, check_fp8_k, config_pins, epilogue_operand_kinds, import_object, is_size

if TYPE_CHECKING:
    from epicute.gemm import GemmProblem
    from epicute.gemm.prepare import GemmRequest
    from epicute.runtime.target import Target


def gemm_variants(entry: dict, target: Target | None = None) -> list:
    """The GEMM variants the calls described by one ``[[gemm]]`` entry would compile on ``target``
    (None: the current one), deduplicated."""
    from epicute.gemm import GemmProblem
    from epicute.gemm.config import AB_DTYPES, D_DTYPES, FP8_AB_DTYPES, GemmConfig
    from epicute.gemm.prepare import prepare

    allowed = {"shapes", "dtype", "out_dtype", "a_major", "b_major", "config", "epilogue", "operands", "out_dtypes",
               "gated"}  # fmt: skip
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(allowed)}")
    shapes = entry.get("shapes")
    if not shapes or not isinstance(shapes, list):
        raise ConfigError(f"shapes = {shapes!r}; give shapes = [[M, N, K], ...] (sizes pick the plan)")
    for shape in shapes:
        if not (isinstance(shape, list) and len(shape) in (3, 4) and all(is_size(x) for x in shape)):
            raise ConfigError(
                f"shape {shape!r}: give [M, N, K] or [M, N, K, L] of integers >= 0, e.g. [4096, 4096, 4096]"
            )
    dtype = entry.get("dtype", "bf16")
    if dtype not in AB_DTYPES:
        raise ConfigError(f"dtype = {dtype!r}; A and B's dtype is one of {', '.join(AB_DTYPES)}")
    fp8 = dtype in FP8_AB_DTYPES
    out_dtype = entry.get("out_dtype", "bf16" if fp8 else dtype)  # as epicute.gemm defaults it
    if out_dtype not in D_DTYPES:
        raise ConfigError(f"out_dtype = {out_dtype!r}; D's dtype is one of {', '.join(D_DTYPES)}")
    check_fields(entry, str, "a_major", "b_major", "epilogue")
    check_fields(entry, dict, "operands", "out_dtypes")
    gated = entry.get("gated", False)
    if not isinstance(gated, bool) or (gated and not entry.get("epilogue")):
        raise ConfigError(f"gated = {gated!r}: true (with an epilogue f(gate, up, ...)) or false")

    def problem_of(shape: list[int]) -> GemmProblem:
        m, n, k, l = (*shape, 1) if len(shape) == 3 else shape
        b_major = entry.get("b_major", "k" if fp8 else "n")  # fp8: w.t() of a row-major (N, K) weight
        return GemmProblem(m, n, k, l, dtype, out_dtype, entry.get("a_major", "k"), b_major)

    request = gemm_request(
        problem_of(shapes[0]), entry.get("epilogue"), entry.get("operands") or {}, "out_dtype" in entry,
        entry.get("out_dtypes") or {}, config_pins(entry, GemmConfig), target, gated,
    )  # fmt: skip
    variants = {}
    # Blockwise scales come in TMA- or bulk-copyable layouts (aligned, torch's) or not, which only the call's
    # tensors say: every form.
    scale_forms = [(a, b) for a in (True, False) for b in (True, False)] if request.problem.block_scaled else [
        (False, False)]  # fmt: skip
    for shape in shapes:
        for a_tma, b_bulk in scale_forms:
            problem = replace(problem_of(shape), block_scaled=request.problem.block_scaled, a_scales_tma=a_tma,
                              b_scales_bulk=b_bulk)  # fmt: skip
            variant = prepare(replace(request, problem=problem)).variant()
            m, n, k, l = (*shape, 1) if len(shape) == 3 else shape
            variants.setdefault(variant.key(), (variant, f"{m}x{n}x{k}" + (f"x{l}" if l != 1 else "")))
    return list(variants.values())


def gemm_request(
    problem: GemmProblem,
    epilogue: str | None,
    operands: dict,
    d_explicit: bool,
    out_dtypes: dict,
    pins: dict,
    target: Target | None = None,
    gated: bool = False,
) -> GemmRequest:
    """The :class:`~epicute.gemm.prepare.GemmRequest` of calls described in text (a spec entry, the CLI):
    ``epilogue`` a ``module:function`` path, ``operands`` ``{name: "kind[:dtype]"}`` (unlisted ones
    are scalars), ``out_dtypes`` IR dtype names, ``pins`` config fields, ``target`` the GPU to plan
    for (None: the current one), ``gated`` a gated epilogue ``f(gate, up, ...)``."""
    from epicute.epilogue.gated import gated_epilogue
    from epicute.epilogue.scales import SCALE_NAMES, check_scale_kind, scaled_epilogue
    from epicute.epilogue.tracer import as_epilogue
    from epicute.gemm.prepare import GemmRequest, ir_items

    overrides = tuple(sorted(pins.items()))
    check_fp8_k(problem.fp8, problem.k)
    blockwise = [name for name in SCALE_NAMES if operands.get(name) == "blockwise"]
    if blockwise:
        if not problem.fp8 or len(blockwise) != 2:
            raise ConfigError(
                "blockwise scales dequantize fp8 inputs, both of them: give a_scale = 'blockwise' and "
                "b_scale = 'blockwise' with an fp8 dtype"
            )
        # The mainloop applies them: the epilogue is the caller's own.
        problem = replace(problem, block_scaled=True)
        operands = {name: kind for name, kind in operands.items() if name not in SCALE_NAMES}
    if not epilogue and (not problem.fp8 or problem.block_scaled):
        if operands or out_dtypes:
            raise ConfigError("operands/out_dtypes need an epilogue")
        return GemmRequest(problem, overrides=overrides, target=target)
    epi = (gated_epilogue if gated else as_epilogue)(import_object(epilogue)) if epilogue else None
    if problem.fp8 and not problem.block_scaled:
        # fp8 inputs' scales are operands of the scaled epilogue; rowwise unless named otherwise
        # (a_scale = "scalar" for a float, "row" for a GPU tensor; "blockwise" for both, the
        # mainloop's: epicute.epilogue.scales).
        epi = scaled_epilogue(epi)
        operands = {"a_scale": "col", "b_scale": "row", **operands}
        for name in SCALE_NAMES:
            check_scale_kind(name, operands[name])
    missing = [p for p in epi.params if p not in operands and p not in epi.defaults]
    extra = sorted(set(operands) - set(epi.params))
    if missing or extra:
        raise EpilogueError(
            f"epilogue {epi.name!r} takes operands {epi.params}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    kinds = epilogue_operand_kinds(epi, operands)
    return GemmRequest(problem, epi, kinds, d_explicit, ir_items(out_dtypes, "out_dtypes"), (), overrides, target)
