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
Plans are made for the visible GPU, else an H100 SXM, or for the part named by
``epicute compile --target h100-pcie`` (``compile_spec(..., target=...)``; see
:mod:`epicute.runtime.target`). Entries serve every part of the target's arch:
keys hold no SM count (the persistent grid is sized at launch), so the target
only matters where the planner would choose another config for another SM count.

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

import contextvars
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epicute.errors import ConfigError, EpicuteError, EpilogueError

if TYPE_CHECKING:
    from epicute.gemm import GemmProblem
    from epicute.gemm.prepare import GemmRequest
    from epicute.runtime.target import Target

#: Per kernel family (a ``KernelFamily`` of the same kind compiles them): a function
#: from one spec table entry and a target to ``[(variant, description)]``, the variants it needs.
JOB_KINDS: dict[str, Callable[[dict, Target | None], list]] = {}


@dataclass(frozen=True)
class AotResult:
    kind: str
    what: str
    digest: str
    status: str
    seconds: float


#: The smallest spec, in each format, for messages that say what to write.
_EXAMPLE = {
    ".json": '{"gemm": [{"shapes": [[4096, 4096, 4096]]}]}',
    ".toml": "[[gemm]] then shapes = [[4096, 4096, 4096]]",
}


def read_spec(path: str | Path) -> dict[str, list[dict]]:
    """The spec's tables (``{"gemm": [entry, ...]}``); TOML unless the file ends in ``.json``."""
    path = Path(path)
    example = _EXAMPLE[".json" if path.suffix == ".json" else ".toml"]
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the spec {path}: {exc.strerror or exc}") from exc
    if path.suffix == ".json":
        try:
            spec = json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not text
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - exercised on 3.10 only
            import tomli as tomllib
        try:
            spec = tomllib.loads(text.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a spec maps kernel kinds to entries, e.g. {example}; got a {type(spec).__name__}")
    unknown = sorted(set(spec) - set(JOB_KINDS))
    if unknown:
        raise ConfigError(f"{path}: unknown kernel kinds {unknown}; known are {sorted(JOB_KINDS)}")
    tables = {kind: entries if isinstance(entries, list) else [entries] for kind, entries in spec.items()}
    for kind, entries in tables.items():
        for i, entry in enumerate(entries, 1):
            if not isinstance(entry, dict):
                raise ConfigError(
                    f"{path}: {kind} entry {i} is {entry!r}; each entry is a table of fields: write [[{kind}]] "
                    f"followed by its fields (e.g. {example})"
                )
    if not any(tables.values()):
        raise ConfigError(f"{path} names no kernels to compile; add an entry, e.g. {example}")
    return tables


#: Directories searched for a spec's ``module:function`` paths besides the working directory.
_SEARCH_DIRS: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("epicute_aot_search", default=())
#: ``epicute.epilogues`` is what Python code calls the ready epilogues; it is an attribute, not a module.
_MODULE_ALIASES = {"epicute.epilogues": "epicute.epilogue.library"}


def import_object(path: str, search: Sequence[str | Path] | None = None) -> Any:
    """``"package.module:name"`` -> the object.

    The module is found as ``python -m`` would find it: in the working directory
    first, then in ``search`` (by default the directory of the spec being
    compiled), then on ``sys.path``. ``epicute.epilogues:name`` and the bare name
    of a ready epilogue (``row_col_quant``) name :mod:`epicute.epilogue.library`'s.
    """
    from epicute.epilogue import library

    if isinstance(path, str) and ":" not in path and path in library.__all__:
        return getattr(library, path)
    module, sep, name = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module or not name:
        raise ConfigError(
            f"{path!r}: name a function as 'package.module:function' (a ready epilogue by its name: "
            f"{', '.join(library.__all__)})"
        )
    if not all(part.isidentifier() for part in (*module.split("."), *name.split("."))):
        raise ConfigError(f"{path!r} is not an import path; name a function as 'package.module:function'")
    search = _SEARCH_DIRS.get() if search is None else tuple(search)
    dirs = list(dict.fromkeys(str(Path(d).resolve()) for d in (Path.cwd(), *search)))
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added  # only while importing: the caller's sys.path is left as it was
    try:
        obj = importlib.import_module(_MODULE_ALIASES.get(module, module))
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigError(
                f"cannot import {path!r}: no module {exc.name!r} in {' or '.join(dirs)} or on PYTHONPATH; run "
                f"from the directory that holds {module.split('.')[0]}/ (or {module.split('.')[0]}.py), or add that "
                "directory to PYTHONPATH"
            ) from exc
        raise ConfigError(f"cannot import {path!r}: importing {module} needs a module that is missing ({exc})") from exc
    except EpicuteError:
        raise
    except Exception as exc:  # the user's module failed to run: say which and how
        raise ConfigError(f"cannot import {path!r}: importing {module} raised {type(exc).__name__}: {exc}") from exc
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"cannot import {path!r}: module {module} has no {name!r}") from None
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


def gemm_variants(entry: dict, target: Target | None = None) -> list:
    """The GEMM variants the calls described by one ``[[gemm]]`` entry would compile on ``target``
    (None: the current one), deduplicated."""
    from epicute.gemm import GemmProblem
    from epicute.gemm.config import AB_DTYPES, D_DTYPES, GemmConfig
    from epicute.gemm.prepare import prepare

    allowed = {"shapes", "dtype", "out_dtype", "a_major", "b_major", "config", "epilogue", "operands", "out_dtypes"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(allowed)}")
    shapes = entry.get("shapes")
    if not shapes or not isinstance(shapes, list):
        raise ConfigError(f"shapes = {shapes!r}; give shapes = [[M, N, K], ...] (sizes pick the plan)")
    for shape in shapes:
        if not (isinstance(shape, list) and len(shape) in (3, 4) and all(_is_size(x) for x in shape)):
            raise ConfigError(
                f"shape {shape!r}: give [M, N, K] or [M, N, K, L] of integers >= 0, e.g. [4096, 4096, 4096]"
            )
    dtype = entry.get("dtype", "bf16")
    if dtype not in AB_DTYPES:
        raise ConfigError(f"dtype = {dtype!r}; A and B's dtype is one of {', '.join(AB_DTYPES)}")
    out_dtype = entry.get("out_dtype", dtype)
    if out_dtype not in D_DTYPES:
        raise ConfigError(f"out_dtype = {out_dtype!r}; D's dtype is one of {', '.join(D_DTYPES)}")
    _check_fields(entry, str, "a_major", "b_major", "epilogue")
    _check_fields(entry, dict, "operands", "out_dtypes")
    def problem_of(shape: list[int]) -> GemmProblem:
        m, n, k, l = (*shape, 1) if len(shape) == 3 else shape
        return GemmProblem(m, n, k, l, dtype, out_dtype, entry.get("a_major", "k"), entry.get("b_major", "n"))

    request = gemm_request(
        problem_of(shapes[0]), entry.get("epilogue"), entry.get("operands") or {}, "out_dtype" in entry,
        entry.get("out_dtypes") or {}, _config_pins(entry, GemmConfig), target,
    )  # fmt: skip
    variants = {}
    for shape in shapes:
        variant = prepare(replace(request, problem=problem_of(shape))).variant()
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
) -> GemmRequest:
    """The :class:`~epicute.gemm.prepare.GemmRequest` of calls described in text (a spec entry, the CLI):
    ``epilogue`` a ``module:function`` path, ``operands`` ``{name: "kind[:dtype]"}`` (unlisted ones
    are scalars), ``out_dtypes`` IR dtype names, ``pins`` config fields, ``target`` the GPU to plan
    for (None: the current one)."""
    from epicute.epilogue.tracer import as_epilogue
    from epicute.gemm.prepare import GemmRequest, ir_items

    overrides = tuple(sorted(pins.items()))
    if not epilogue:
        if operands or out_dtypes:
            raise ConfigError("operands/out_dtypes need an epilogue")
        return GemmRequest(problem, overrides=overrides, target=target)
    epi = as_epilogue(import_object(epilogue))
    missing = [p for p in epi.params if p not in operands and p not in epi.defaults]
    extra = sorted(set(operands) - set(epi.params))
    if missing or extra:
        raise EpilogueError(
            f"epilogue {epi.name!r} takes operands {epi.params}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    kinds = tuple((p, *_operand(p, operands.get(p, "scalar"))) for p in epi.params)
    return GemmRequest(problem, epi, kinds, d_explicit, ir_items(out_dtypes, "out_dtypes"), (), overrides, target)


JOB_KINDS["gemm"] = gemm_variants


def _config_pins(entry: dict, config_cls: type) -> dict:
    """The entry's ``config`` table, each pin a field of ``config_cls`` of its type (the planner
    assumes both); TOML has no tuples, configs do (epi_tile, mma_atoms_mn)."""
    import dataclasses

    _check_fields(entry, dict, "config")
    pins = {k: tuple(v) if isinstance(v, list) else v for k, v in (entry.get("config") or {}).items()}
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls) if f.name != "reasons"}
    for name, value in pins.items():
        if name not in defaults:
            raise ConfigError(f"config field {name!r} is unknown; known are {sorted(defaults)}")
        default = defaults[name]
        if type(value) is not type(default) or (
            isinstance(value, tuple) and not all(type(x) is type(y) for x, y in zip(value, default))
        ):
            raise ConfigError(f"config {name} = {value!r}; it takes a value like {default!r}")
    return pins


def _is_size(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_TYPE_WORDS = {str: "a string, e.g. 'bf16'", dict: "a table, e.g. { name = value }"}


def _check_fields(entry: dict, kind: type, *names: str) -> None:
    """Each of ``names`` the entry has is a ``kind`` (str or dict): say which field is not, and what it takes."""
    for name in names:
        if name in entry and not isinstance(entry[name], kind):
            raise ConfigError(f"{name} = {entry[name]!r}; it takes {_TYPE_WORDS[kind]}")


def attention_variants(entry: dict, target: Target | None = None) -> list:
    """The attention variants the calls described by one ``[[attention]]`` entry would compile on
    ``target`` (None: the current one), deduplicated.

    Each is found by running :func:`epicute.attention`'s own checks and hook
    tracing on tiny CPU tensors of the entry's dtype and operand kinds, so its
    key is the one a real call of any size makes.
    """
    import itertools

    import torch

    from epicute.attention.api import _hooks, _kernel_variant
    from epicute.attention.plan import AttentionConfig
    from epicute.attention.validate import check_attention_args
    from epicute.epilogue.dtypes import IR_TO_TORCH
    from epicute.epilogue.score_mod import score_mod as as_score_mod
    from epicute.epilogue.tracer import as_epilogue

    allowed = {"dtype", "head_dim", "causal", "heads", "config", "score_mod", "epilogue", "operands"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigError(f"unknown fields {unknown}; known are {sorted(allowed)}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16"):
        raise ConfigError(f"dtype {dtype!r} must be 'bf16' or 'fp16'")
    heads = entry.get("heads", [1, 1])
    if not (isinstance(heads, list) and len(heads) == 2 and all(_is_size(h) and h > 0 for h in heads)):
        raise ConfigError(f"heads = {heads!r}; give [heads_q, heads_kv], e.g. [32, 8]")
    _check_fields(entry, str, "score_mod", "epilogue")
    _check_fields(entry, dict, "operands")
    pins = _config_pins(entry, AttentionConfig)
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
            f"the hooks take operands {sorted(declared)}: give each as name = 'kind[:dtype]' "
            f"(missing {missing}, unexpected {extra})"
        )
    specs = {name: _operand(name, text, ("scalar", "head", "row", "tile")) for name, text in operands.items()}
    for name, (_, dt) in specs.items():
        if dt not in IR_TO_TORCH:
            raise EpilogueError(f"operand {name!r}: dtype {dt!r} is not one of {sorted(IR_TO_TORCH)}")
    head_dims, causals = (entry.get(f, default) for f, default in (("head_dim", 128), ("causal", False)))
    head_dims, causals = (x if isinstance(x, list) else [x] for x in (head_dims, causals))
    if not head_dims or not all(_is_size(d) for d in head_dims):
        raise ConfigError(f"head_dim = {entry['head_dim']!r}; give 64, 128, 256 or a list of them")
    if not causals or not all(isinstance(c, bool) for c in causals):
        raise ConfigError(f"causal = {entry['causal']!r}; give true, false or a list of them")
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
        variant = _kernel_variant(call, score, epi, pins, target)
        variants.setdefault(variant.key(), (variant, f"d{head_dim} {dtype}" + (" causal" if causal else "")))
    return list(variants.values())


JOB_KINDS["attention"] = attention_variants


def compile_spec(
    path: str | Path,
    dry_run: bool = False,
    on_result: Callable[[AotResult], None] | None = None,
    target: Target | str | None = None,
):
    """Compile every variant the spec needs into the disk cache; returns an :class:`AotResult` each.

    ``target`` (a name such as ``"h100-pcie"``, a :class:`~epicute.runtime.target.Target`, or
    None: the visible GPU, else an H100 SXM) is what the spec's calls are planned for; the
    variants compile for its arch. The whole spec is checked (the target, and the cache
    directory unless ``dry_run``) before anything compiles, so a mistake in its last entry
    costs no compile time.
    """
    import time

    from epicute.runtime.cache import cache_dir, check_cache_dir
    from epicute.runtime.compile import FAMILIES
    from epicute.runtime.target import resolve_target

    path = Path(path)
    target = resolve_target(target)
    spec = read_spec(path)
    if not dry_run:
        if cache_dir() is None:
            raise ConfigError("EPICUTE_CACHE=0 turns the disk cache off, so there is nowhere to compile to; unset it")
        check_cache_dir(create=True)
    jobs = []
    token = _SEARCH_DIRS.set((path.parent,))
    try:
        for kind, entries in spec.items():
            for i, entry in enumerate(entries, 1):
                try:
                    jobs += [(kind, variant, what) for variant, what in JOB_KINDS[kind](entry, target)]
                except EpicuteError as exc:  # same type, located: which file, which entry
                    raise type(exc)(f"{path}, [[{kind}]] entry {i}: {exc}") from exc
    finally:
        _SEARCH_DIRS.reset(token)
    for kind, variant, _ in jobs:
        FAMILIES[kind].compiler(variant.arch)  # no kernel for the target's arch: say so before compiling any
    results = []
    for kind, variant, what in jobs:
        start = time.perf_counter()
        status = "planned" if dry_run else FAMILIES[kind].ensure_on_disk(variant)[0]
        result = AotResult(kind, what, variant.key().digest, status, time.perf_counter() - start)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


__all__ = [
    "JOB_KINDS",
    "AotResult",
    "attention_variants",
    "compile_spec",
    "gemm_variants",
    "import_object",
    "read_spec",
]  # fmt: skip
