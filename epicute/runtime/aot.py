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
    gated = false                   # optional: gated=True calls (epilogue f(gate, up, ...))

Sizes pick the plan (tiles, cluster, stages), not the code's sizes: list a
shape per regime the application runs (decode-sized M, prefill-sized M...).
Plans are made for the visible GPU, else an H100 SXM, or for the part named by
``epicute compile --target h100-pcie`` (``compile_spec(..., target=...)``; see
:mod:`epicute.runtime.target`). Entries serve every part of the target's arch:
keys hold no SM count (the persistent grid is sized at launch), so the target
only matters where the planner would choose another config for another SM count.

``[[grouped_gemm]]`` entries (shapes ``[total_M, N, K, G]``, a ``mode`` of rows, gathered rows or
variable K) are described in :mod:`epicute.grouped.aot`.

Attention needs no sizes (a prefill plan depends on head_dim, causal and dtype only;
batch, sequence lengths and head counts are runtime values); ``decode = true`` also
compiles the decode plans of the entry's GQA ratio (packed heads, with and without
split-KV), which calls of one query per sequence take::

    [[attention]]
    dtype = "bf16"                  # q, k, v: bf16 | fp16
    head_dim = [64, 128]            # one or a list: 64 | 128 | 256
    causal = [false, true]          # one or a list
    heads = [32, 8]                 # [heads_q, heads_kv]; optional (default [1, 1]): the GQA
                                    # ratio is a runtime value, one variant serves every ratio
    config = { tile_n = 64 }        # optional pins, as attention(config=...)
    decode = true                   # optional: the decode variants too (no output epilogue)
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epicute.errors import AlignmentError, ConfigError, EpicuteError, EpilogueError
from epicute.runtime.family import Declared, resolve

if TYPE_CHECKING:
    from epicute.runtime.target import Target

#: Per kernel family with an ``aot`` function in its declaration (:mod:`epicute.families`; the family of the
#: same kind compiles them): a function from one ``[[kind]]`` table entry and a target to
#: ``[(variant, description)]``, the variants it needs. Listing the kinds imports no family.
JOB_KINDS: Mapping[str, Callable[[dict, Target | None], list]] = Declared(
    lambda spec: resolve(spec.aot), select=lambda spec: spec.aot is not None
)


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


def operand_kind(name: str, text: str, kinds: tuple[str, ...] = ("scalar", "row", "col", "tile")) -> tuple[str, str]:
    kind, _, dtype = str(text).partition(":")
    if kind not in kinds:
        raise EpilogueError(
            f"operand {name!r}: kind {kind!r} must be {', '.join(kinds[:-1])} or {kinds[-1]} (e.g. '{kinds[1]}:bf16')"
        )
    if kind == "scalar":
        return kind, "fp32"
    return kind, dtype or "fp32"


def epilogue_operand_kinds(epi: Any, operands: Mapping[str, str]) -> tuple[tuple[str, str, str], ...]:
    """``(name, kind, dtype)`` of each of ``epi``'s operands, described as ``{name: "kind[:dtype]"}`` (a spec
    entry, the CLI's ``--operand``). A kind must agree with the parameter's annotation (``scale: Scalar``), as a
    pin passed to a call must (:func:`epicute.epilogue.operands.operand_spec`); one not described takes the
    annotation's kind, else is a scalar."""
    from epicute.epilogue.operands import declared_kind_error

    kinds = []
    for p in epi.params:
        declared = epi.pins.get(p)
        kind, dtype = operand_kind(p, operands.get(p, declared or "scalar"))
        if declared is not None and kind != declared:
            example = declared if declared == "scalar" else f"{declared}:{dtype}"
            raise declared_kind_error(p, declared, repr(kind), f"; describe it as {p}={example}")
        kinds.append((p, kind, dtype))
    return tuple(kinds)


def config_pins(entry: dict, config_cls: type) -> dict:
    """The entry's ``config`` table, each pin a field of ``config_cls`` of its type (the planner
    assumes both); TOML has no tuples, configs do (epi_tile, mma_atoms_mn)."""
    import dataclasses

    check_fields(entry, dict, "config")
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
        # Every int field is a size or a count, as epicute.runtime.checks.config_pins takes them.
        sizes = value if isinstance(value, tuple) else (value,)
        if any(isinstance(x, int) and not isinstance(x, bool) and x < 1 for x in sizes):
            raise ConfigError(f"config {name} = {value!r}; it takes positive sizes, like {default!r}")
    return pins


def check_fp8_k(fp8: bool, k: int) -> None:
    """fp8 inputs need K a multiple of 16 (TMA moves 16-byte rows of A and B), as ``epicute.gemm`` checks on
    tensors: a planned or compiled kernel for another K could never run."""
    if fp8 and k % 16:
        raise AlignmentError(f"K={k} with fp8 inputs: TMA moves 16-byte rows of A and B, so K must be a multiple of "
                             f"16; pad K to {-(-k // 16) * 16}")  # fmt: skip


def is_size(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_TYPE_WORDS = {str: "a string, e.g. 'bf16'", dict: "a table, e.g. { name = value }", bool: "true or false"}


def check_fields(entry: dict, kind: type, *names: str) -> None:
    """Each of ``names`` the entry has is a ``kind`` (str or dict): say which field is not, and what it takes."""
    for name in names:
        if name in entry and not isinstance(entry[name], kind):
            raise ConfigError(f"{name} = {entry[name]!r}; it takes {_TYPE_WORDS[kind]}")


def compile_spec(
    path: str | Path,
    dry_run: bool = False,
    on_result: Callable[[AotResult], None] | None = None,
    target: Target | str | None = None,
    workers: int | None = None,
):
    """Compile every variant the spec needs into the disk cache; returns an :class:`AotResult` each.

    ``target`` (a name such as ``"h100-pcie"``, a :class:`~epicute.runtime.target.Target`, or
    None: the visible GPU, else an H100 SXM) is what the spec's calls are planned for; the
    variants compile for its arch. The whole spec is checked (the target, and the cache
    directory unless ``dry_run``) before anything compiles, so a mistake in its last entry
    costs no compile time. ``workers`` worker processes compile side by side (default
    :func:`~epicute.runtime.precompile.compile_workers`; under two, this process compiles each in turn);
    ``on_result`` then hears of each variant as it finishes, its seconds counted from the start.
    """
    import time

    from epicute.runtime.cache import cache_dir, check_cache_dir
    from epicute.runtime.compile import FAMILIES
    from epicute.runtime.precompile import compile_workers, ensure_all_on_disk
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
    # A job's variant names its own family: an entry may need kernels of several (fp8 attention: its value pass).
    for _, variant, _ in jobs:
        FAMILIES[variant.key().kind].compiler(variant.arch)  # no kernel for the arch: say so before compiling any
    workers = compile_workers() if workers is None else workers
    if dry_run or workers < 2 or len(jobs) < 2:
        results = []
        for kind, variant, what in jobs:
            start = time.perf_counter()
            status = "planned" if dry_run else FAMILIES[variant.key().kind].ensure_on_disk(variant)[0]
            results.append(_reported(AotResult(kind, what, variant.key().digest, status, time.perf_counter() - start),
                                     on_result))  # fmt: skip
        return results
    by_index: dict[int, AotResult] = {}
    variants = [(variant.key().kind, variant) for _, variant, _ in jobs]
    for i, status, seconds in ensure_all_on_disk(variants, workers):
        kind, variant, what = jobs[i]
        by_index[i] = _reported(AotResult(kind, what, variant.key().digest, status, seconds), on_result)
    return [by_index[i] for i in range(len(jobs))]


def _reported(result: AotResult, on_result: Callable[[AotResult], None] | None) -> AotResult:
    if on_result is not None:
        on_result(result)
    return result


__all__ = [
    "JOB_KINDS",
    "AotResult",
    "check_fields",
    "compile_spec",
    "config_pins",
    "epilogue_operand_kinds",
    "import_object",
    "is_size",
    "operand_kind",
    "read_spec",
]  # fmt: skip
