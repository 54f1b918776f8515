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

Attention needs no sizes at all (its plan depends on head_dim, causal and dtype
only; batch, sequence lengths and head counts are runtime values)::

    [[attention]]
    dtype = "bf16"                  # q, k, v: bf16 | fp16
    head_dim = [64, 128]            # one or a list: 64 | 128 | 256
    causal = [false, true]          # one or a list
    heads = [32, 8]                 # [heads_q, heads_kv]; optional (default [1, 1]): the GQA
                                    # ratio is a runtime value, one variant serves every ratio
    config = { tile_n = 64 }        # optional pins, as attention(config=...)
    score_mod = "mypkg.mods:alibi"  # optional, module:function
    epilogue = "mypkg.mods:gate"    # optional, module:function
    operands = { slopes = "head:fp32", cap = "scalar", gate = "tile:bf16" }  # kind[:dtype]

Operand kinds are those :func:`epicute.attention` infers from shapes: ``scalar``;
``head``, a per-head vector ``(heads_q,)`` (score_mod); ``row``, a ``(head_dim,)``
vector, and ``tile``, ``(batch, seqlen_q, heads_q, head_dim)`` (epilogue).
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


def _operand(name: str, text: str, kinds: tuple[str, ...] = ("scalar", "row", "col", "tile")) -> tuple[str, str]:
    kind, _, dtype = str(text).partition(":")
    if kind not in kinds:
        raise EpilogueError(
            f"operand {name!r}: kind {kind!r} must be {', '.join(kinds[:-1])} or {kinds[-1]} (e.g. '{kinds[1]}:bf16')"
        )
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
    overrides = tuple(sorted(_config_pins(entry).items()))
    fusion = None
    if entry.get("epilogue"):
        fusion = _gemm_fusion(
            as_epilogue(import_object(entry["epilogue"])), entry.get("operands") or {}, out_dtype,
            "out_dtype" in entry, entry.get("out_dtypes") or {},
        )  # fmt: skip
        out_dtype = fusion.output_dtypes["D"]
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


def _gemm_fusion(epi, operands: dict, out_dtype: str, d_explicit: bool, out_dtypes: dict):
    """The fused epilogue exactly as :func:`epicute.gemm` builds it for operands of these kinds/dtypes."""
    from epicute.epilogue.operands import OperandSpec
    from epicute.epilogue.tracer import trace_for_gemm
    from epicute.kernels.epilogue_emit import EpilogueFusion

    missing = [p for p in epi.params if p not in operands and p not in epi.defaults]
    extra = sorted(set(operands) - set(epi.params))
    if missing or extra:
        raise EpilogueError(
            f"epilogue {epi.name!r} takes operands {epi.params}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    specs = {p: OperandSpec(p, *_operand(p, operands.get(p, "scalar")), value=None) for p in epi.params}
    graph = trace_for_gemm(epi, specs, out_dtype, d_explicit, out_dtypes)
    return EpilogueFusion(graph, tuple((s.name, s.kind, s.dtype) for s in specs.values()))


JOB_KINDS["gemm"] = gemm_variants


def _config_pins(entry: dict) -> dict:
    """The entry's ``config`` table; TOML has no tuples, configs do (epi_tile, mma_atoms_mn)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in (entry.get("config") or {}).items()}


def attention_variants(entry: dict) -> list:
    """The attention variants the calls described by one ``[[attention]]`` entry would compile, deduplicated.

    Each is found by running :func:`epicute.attention`'s own checks and hook
    tracing on tiny CPU tensors of the entry's dtype and operand kinds, so its
    key is the one a real call of any size makes.
    """
    import itertools

    import torch

    from epicute.attention_api import _hooks, _kernel_variant
    from epicute.epilogue.dtypes import IR_TO_TORCH
    from epicute.epilogue.score_mod import score_mod as as_score_mod
    from epicute.epilogue.tracer import as_epilogue
    from epicute.runtime.validate_attention import check_attention_args

    allowed = {"dtype", "head_dim", "causal", "heads", "config", "score_mod", "epilogue", "operands"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"[[attention]] entry: unknown fields {unknown}; known are {sorted(allowed)}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16"):
        raise ConfigError(f"[[attention]] entry: dtype {dtype!r} must be 'bf16' or 'fp16'")
    heads = entry.get("heads", [1, 1])
    if not (isinstance(heads, list) and len(heads) == 2 and all(isinstance(h, int) and h > 0 for h in heads)):
        raise ConfigError(f"[[attention]] entry: heads = {heads!r}; give [heads_q, heads_kv], e.g. [32, 8]")
    hooks = {
        "score_mod": as_score_mod(import_object(entry["score_mod"])) if entry.get("score_mod") else None,
        "epilogue": as_epilogue(import_object(entry["epilogue"])) if entry.get("epilogue") else None,
    }
    declared = {p: hook for hook in hooks.values() if hook is not None for p in hook.params}
    operands = entry.get("operands") or {}
    missing = sorted(p for p, hook in declared.items() if p not in operands and p not in hook.defaults)
    extra = sorted(set(operands) - set(declared))
    if missing or extra:
        raise EpilogueError(
            f"[[attention]] entry: the hooks take operands {sorted(declared)}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    specs = {name: _operand(name, text, ("scalar", "head", "row", "tile")) for name, text in operands.items()}
    for name, (_, dt) in specs.items():
        if dt not in IR_TO_TORCH:
            raise EpilogueError(f"operand {name!r}: dtype {dt!r} is not one of {sorted(IR_TO_TORCH)}")
    head_dims, causals = (entry.get(f, default) for f, default in (("head_dim", 128), ("causal", False)))
    head_dims, causals = (x if isinstance(x, list) else [x] for x in (head_dims, causals))
    if not all(isinstance(c, bool) for c in causals):
        raise ConfigError(f"[[attention]] entry: causal = {entry['causal']!r}; give true, false or a list of them")
    heads_q, heads_kv = heads
    variants = {}
    for head_dim, causal in itertools.product(head_dims, causals):
        q = torch.zeros(1, 1, heads_q, head_dim, dtype=IR_TO_TORCH[dtype])
        kv = torch.zeros(1, 1, heads_kv, head_dim, dtype=IR_TO_TORCH[dtype])
        shapes = {"head": (heads_q,), "row": (head_dim,), "tile": tuple(q.shape)}
        values = {
            name: 0.0 if kind == "scalar" else torch.zeros(shapes[kind], dtype=IR_TO_TORCH[dt])
            for name, (kind, dt) in specs.items()
        }
        call = check_attention_args(q, kv, kv, causal=causal, softmax_scale=None, require_cuda=False)
        score, epi = _hooks(call, hooks["score_mod"], hooks["epilogue"], values)
        variant = _kernel_variant(call, score, epi, _config_pins(entry))
        variants.setdefault(variant.key(), (variant, f"d{head_dim} {dtype}" + (" causal" if causal else "")))
    return list(variants.values())


JOB_KINDS["attention"] = attention_variants


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


__all__ = [
    "AotResult", "JOB_KINDS", "read_spec", "gemm_variants", "attention_variants", "compile_spec", "import_object",
]  # fmt: skip
