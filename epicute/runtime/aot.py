"""Ahead-of-time compiles: a spec file in, disk-cache entries out (no GPU needed).

``epicute compile kernels.toml`` on any machine (a CPU-only build box, CI)
fills the kernel cache directory with ``sm_90a`` object files; a GPU machine
pointed at the same directory (``EPICUTE_CACHE_DIR``, or a copy of it) then loads
them on first call instead of compiling. A spec is TOML (or JSON, same shape)
with one table per kernel family; each ``[[gemm]]`` entry says what calls will be
made, and the variants those calls would compile are built::

    [[gemm]]
    shapes = [[4096, 14336, 4096], [1, 14336, 4096], [8, 512, 512, 64]]  # M, N, K[, L]
    dtype = "bf16"                  # A and B: bf16 | fp16
    out_dtype = "bf16"              # D: bf16 | fp16 | fp32 (default: dtype)
    a_major = "k"                   # "k": A row-major, "m": column-major
    b_major = "k"                   # "n": B row-major, "k": column-major (w.t())
    config = { tile_n = 128 }       # optional pins, as gemm(config=...)
    epilogue = "mypkg.epilogues:bias_gelu"           # optional, module:function
    operands = { bias = "row:bf16", alpha = "scalar" }  # kind[:dtype] per operand
    out_dtypes = { D = "bf16" }     # optional, as gemm(out_dtypes=...)

Sizes pick the plan (tiles, cluster, stages), not the code's sizes: list a
shape per regime the application runs (decode-sized M, prefill-sized M...).
The planner assumes an H100 SXM (132 SMs) unless a Hopper GPU is visible.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epicute.errors import ConfigError, EpilogueError

#: Per kernel family (a ``KernelFamily`` of the same kind compiles them): a function
#: from one spec table entry to ``[(variant, description)]``, the variants it needs.
JOB_KINDS: dict[str, Callable[[dict], list]] = {}


@dataclass(frozen=True)
class AotResult:
    kind: str
    what: str
    digest: str
    status: str
    seconds: float


def read_spec(path: str | Path) -> dict[str, list[dict]]:
    """The spec's tables (``{"gemm": [entry, ...]}``); TOML unless the file ends in ``.json``."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the spec {path}: {exc}") from exc
    if path.suffix == ".json":
        spec = json.loads(text)
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - exercised on 3.10 only
            import tomli as tomllib
        try:
            spec = tomllib.loads(text.decode())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(spec) - set(JOB_KINDS))
    if unknown:
        raise ConfigError(f"{path}: unknown kernel kinds {unknown}; known are {sorted(JOB_KINDS)}")
    return {kind: entries if isinstance(entries, list) else [entries] for kind, entries in spec.items()}


def import_object(path: str) -> Any:
    """``"package.module:name"`` -> the object."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{path!r}: name an epilogue as 'package.module:function'")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import {path!r}: {exc}") from exc
    return obj


def _operand(name: str, text: str) -> tuple[str, str]:
    kind, _, dtype = str(text).partition(":")
    if kind not in ("scalar", "row", "col", "tile"):
        raise EpilogueError(f"operand {name!r}: kind {kind!r} must be scalar, row, col or tile (e.g. 'row:bf16')")
    if kind == "scalar":
        return kind, "fp32"
    return kind, dtype or "fp32"


def gemm_variants(entry: dict) -> list:
    """The GEMM variants the calls described by one ``[[gemm]]`` entry would compile, deduplicated."""
    from epicute.epilogue.tracer import as_epilogue
    from epicute.plan import GemmProblem
    from epicute.runtime.launch import cached_plan, variant_of

    allowed = {"shapes", "dtype", "out_dtype", "a_major", "b_major", "config", "epilogue", "operands", "out_dtypes"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"[[gemm]] entry: unknown fields {unknown}; known are {sorted(allowed)}")
    if not entry.get("shapes"):
        raise ConfigError("[[gemm]] entry: give shapes = [[M, N, K], ...] (sizes pick the plan)")
    dtype = entry.get("dtype", "bf16")
    out_dtype = entry.get("out_dtype", dtype)
    # TOML has no tuples; GemmConfig does (epi_tile).
    overrides = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (entry.get("config") or {}).items()))
    fusion = None
    if entry.get("epilogue"):
        fusion = _gemm_fusion(
            as_epilogue(import_object(entry["epilogue"])), entry.get("operands") or {}, out_dtype,
            entry.get("out_dtypes") or {},
        )  # fmt: skip
    elif entry.get("operands") or entry.get("out_dtypes"):
        raise ConfigError("[[gemm]] entry: operands/out_dtypes need an epilogue")
    variants = {}
    for shape in entry["shapes"]:
        if len(shape) not in (3, 4):
            raise ConfigError(f"shape {shape}: give [M, N, K] or [M, N, K, L]")
        m, n, k, l = (*shape, 1) if len(shape) == 3 else shape
        problem = GemmProblem(m, n, k, l, dtype, out_dtype, entry.get("a_major", "k"), entry.get("b_major", "n"))
        plan = cached_plan(problem, overrides) if fusion is None else cached_plan(problem, overrides, fusion.buffers())
        variant = variant_of(plan, fusion)
        variants.setdefault(variant.key(), (variant, f"{m}x{n}x{k}" + (f"x{l}" if l != 1 else "")))
    return list(variants.values())


def _gemm_fusion(epi, operands: dict, out_dtype: str, out_dtypes: dict):
    """The fused epilogue exactly as :func:`epicute.gemm` builds it for operands of these kinds/dtypes."""
    from epicute.kernels.epilogue_emit import EpilogueFusion

    missing = [p for p in epi.params if p not in operands and p not in epi.defaults]
    extra = sorted(set(operands) - set(epi.params))
    if missing or extra:
        raise EpilogueError(
            f"epilogue {epi.name!r} takes operands {epi.params}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    specs = {p: _operand(p, operands.get(p, "scalar")) for p in epi.params}
    dtypes = {"D": out_dtype, **out_dtypes}
    graph = epi.trace({p: k for p, (k, _) in specs.items()}, {p: d for p, (_, d) in specs.items()}, dtypes, d_dtype=out_dtype)
    return EpilogueFusion(graph, tuple((p, k, d) for p, (k, d) in specs.items()))


JOB_KINDS["gemm"] = gemm_variants


def compile_spec(path: str | Path, dry_run: bool = False, on_result: Callable[[AotResult], None] | None = None):
    """Compile every variant the spec needs into the disk cache; returns an :class:`AotResult` each."""
    import time

    from epicute.runtime.compile import FAMILIES

    results = []
    for kind, entries in read_spec(path).items():
        for entry in entries:
            for variant, what in JOB_KINDS[kind](entry):
                start = time.perf_counter()
                status = "planned" if dry_run else FAMILIES[kind].ensure_on_disk(variant)[0]
                result = AotResult(kind, what, variant.key().digest, status, time.perf_counter() - start)
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results


__all__ = ["AotResult", "JOB_KINDS", "read_spec", "gemm_variants", "compile_spec", "import_object"]
