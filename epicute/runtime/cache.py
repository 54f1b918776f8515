"""The compile cache: compiled kernels in memory, and exported object files on disk.

A kernel is cached under a :class:`CacheKey`: its kind (``"gemm"``,
``"attention"``), the fields that change its generated code (plan/config, epilogue
semantic hash, dtypes, majors, alignment), the target arch, and the code
versions (epicute's version plus a fingerprint of the kernel sources, every module
the declared families generate their code from (:mod:`epicute.runtime.family`), the CuTe
DSL and TVM-FFI versions). Nothing that varies per call or per GPU of an arch
belongs in a key: the number of persistent CTAs (from the SM count) is a launch
argument, so a cache filled for one Hopper part serves every other; problem
sizes and strides (other than the contiguous one, which is 1) are symbolic in
the compiled kernels, so a new shape never recompiles; data pointers
are checked for 16-byte alignment on the host instead. :meth:`CacheKey.__init__`
rejects anything but plain Python values (a tensor that leaked into a key would
recompile on every call).

Lookups go to an in-process dict first, then to a directory of exported object
files (``export_to_c``), so a new process, or a GPU machine fed by an
ahead-of-time ``epicute compile`` on a CPU machine, loads instead of compiling.
Where a C compiler is found when an entry is written, the object file is also
linked into a shared library beside it, which TVM-FFI loads by itself in a few
milliseconds: a process whose kernels all come from disk never imports the CuTe
DSL (its import alone costs ~0.6 s). Otherwise, or when the library does not load
(another machine's paths in its run path), the DSL's loader links the object file.

Where: ``$EPICUTE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/epicute`` (default
``~/.cache/epicute``); ``EPICUTE_CACHE=0`` turns the disk store off. Both are
read at each miss, never on the hot path.

Many processes may share the directory (every rank of a job, say): one
compiles a key under an ``fcntl`` lock while the others wait, then load its
entry. Entries are written to temporary files and renamed into place, the
object file first and its manifest (key text, sha256, size) last, so a reader
sees either a complete entry or none. An entry whose manifest or checksum does
not match (a truncated write, a disk error) is reported once, removed and
rebuilt.

Within a process, every miss (load, compile, export) holds one lock: the CuTe
DSL builds its MLIR through process-global state, and two compiles on two
threads at once abort the interpreter. Hits never take it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epicute.errors import CompileError, ConfigError
from epicute.runtime.family import PACKAGE_ROOT, codegen_files
from epicute.runtime.target import DEFAULT_ARCH

#: Bump when the on-disk layout changes, so old entries are never misread.
STORE_FORMAT = "epicute-cache 1"
#: How long a process waits for another one compiling the same key.
LOCK_TIMEOUT_S = 900.0

_PRIMITIVES = (str, int, float, bool, type(None))

#: Held around everything that enters the CuTe DSL on a miss (see the module docstring).
_DSL_LOCK = threading.RLock()


def _check_plain(value: Any, where: str) -> None:
    """Keys hold only str/int/float/bool/None and tuples of them: stable text, no tensors."""
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PRIMITIVES):
        raise TypeError(
            f"cache key part {where} is a {type(value).__name__}; keys may hold only str, int, float, bool, "
            "None and tuples of them (a tensor or an object in a key would recompile on every call)"
        )


@functools.lru_cache(maxsize=1)
def code_versions() -> tuple[tuple[str, str], ...]:
    """The versions a compiled object depends on, as ``(name, version)`` pairs (computed once)."""
    import tvm_ffi

    import epicute

    return (
        ("epicute", epicute.__version__),
        ("epicute-sources", sources_fingerprint()),
        ("cutlass-dsl", _dsl_version()),
        ("tvm-ffi", tvm_ffi.__version__),
        ("format", STORE_FORMAT),
    )


def _dsl_version() -> str:
    """The CuTe DSL's version, from its distribution's metadata: importing it to ask would cost a
    process whose kernels all load from disk the DSL's whole import."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:  # on the path without its metadata
        import cutlass

        return cutlass.__version__


def sources_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """A hash of every source the kernels' code is generated from (under ``root``, the package's directory):
    the shared codegen modules and every declared family's (:func:`~epicute.runtime.family.codegen_files`).
    Editing one invalidates every entry; generous on purpose, as a needless recompile costs seconds and a stale
    kernel a wrong result."""
    h = hashlib.sha256()
    for f in codegen_files(root):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CacheKey:
    """Everything that changes one kernel's generated code, and nothing else.

    ``kind`` names the kernel family, ``parts`` its codegen-relevant fields (plain
    values only, see the module docstring), ``arch`` the target's arch (``Target.arch``;
    nothing else of the target: SM counts are launch arguments, so one entry serves every part).
    """

    kind: str
    parts: tuple
    arch: str = DEFAULT_ARCH
    #: A one-line description for ``epicute cache ls``; not part of the key.
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_plain((self.kind, self.parts, self.arch), "key")

    @functools.cached_property
    def text(self) -> str:
        """Canonical text (``repr`` of plain values is stable across processes and machines)."""
        lines = [f"kind={self.kind}", f"arch={self.arch}", f"parts={self.parts!r}"]
        return "\n".join(lines + [f"{name}={version}" for name, version in code_versions()])

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of :attr:`text`: the entry's file name."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def cache_dir() -> Path | None:
    """The disk store's directory, or None when ``EPICUTE_CACHE=0``."""
    if os.environ.get("EPICUTE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    base = os.environ.get("EPICUTE_CACHE_DIR")
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "epicute"


def _kernels_dir(root: Path) -> Path:
    return root / "kernels"


def check_cache_dir(root: Path | None = None, *, writable: bool = False, create: bool = False) -> Path | None:
    """:func:`cache_dir` (or ``root``), checked usable; None when ``EPICUTE_CACHE=0``.

    A directory that does not exist yet is fine if it can be created. Raises
    :class:`ConfigError` naming ``EPICUTE_CACHE_DIR`` when the store's path runs
    into a regular file, or (``writable``) cannot be written; ``create`` makes it.
    Listing needs no write access: a read-only copy of a cache is usable for loading.
    """
    root = root if root is not None else cache_dir()
    if root is None:
        return None
    directory = _kernels_dir(root)
    origin = "set by EPICUTE_CACHE_DIR" if os.environ.get("EPICUTE_CACHE_DIR") else "the default location"

    def unusable(problem: str) -> ConfigError:
        return ConfigError(
            f"the kernel cache directory {root} ({origin}) is unusable: {problem}; set EPICUTE_CACHE_DIR to a "
            "writable directory (or EPICUTE_CACHE=0 to run without a disk cache)"
        )

    probe = directory  # the deepest part of the path that exists says what can happen below it
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
    except OSError as exc:  # exists() passes on "no such file", not on e.g. a parent without search permission
        raise unusable(f"cannot look at {probe} ({exc.strerror or exc})") from exc
    if not probe.is_dir():
        raise unusable(f"{probe} is a file, not a directory")
    if (writable or create) and not os.access(probe, os.W_OK | os.X_OK):
        raise unusable(f"{probe} is not writable")
    if create:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unusable(f"cannot create {directory} ({exc})") from exc
    return root


@contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``; released when its holder exits, even by a crash."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CompileError(
                        f"waited {timeout_s:.0f} s for {path} (another process compiling this kernel); "
                        "if none is, delete the file or set EPICUTE_CACHE_DIR elsewhere"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class JsonTable:
    """A small JSON table of decisions beside the kernels (``<cache dir>/<name>``), kept across processes: read
    without a lock (an unreadable table is as good as none), written under one, atomically. Nothing is stored
    where caching is disabled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _path(self) -> Path | None:
        root = cache_dir()
        return None if root is None else root / self.name

    def get(self, key: str) -> Any:
        path = self._path()
        if path is None or not path.exists():
            return None
        try:
            return json.loads(path.read_text()).get(key)
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: Any) -> None:
        path = self._path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path.with_suffix(".lock")):
            try:
                table = json.loads(path.read_text()) if path.exists() else {}
            except ValueError:
                table = {}
            table[key] = value
            _write_atomic(path, json.dumps(table, indent=1, sort_keys=True).encode())


class CorruptEntry(Exception):
    """An on-disk entry that cannot be trusted (internal: it is rebuilt)."""


@dataclass
class CacheStats:
    """What this process's cache did since it started (or was cleared)."""

    compiles: int = 0
    disk_loads: int = 0
    rebuilt_corrupt: int = 0
    compile_seconds: float = 0.0
    disk_load_seconds: float = 0.0


class KernelCache:
    """Compiled kernels by :class:`CacheKey`; thread- and process-safe; any kernel kind.

    :meth:`get` returns a callable taking torch tensors (the TVM-FFI calling
    convention: it launches on torch's current stream).
    """

    def __init__(self) -> None:
        self._fns: dict[CacheKey, Callable] = {}
        self._warned: set[str] = set()
        self.stats = CacheStats()
        #: How each key was obtained in this process: ("compiled" | "disk", seconds).
        self.events: dict[CacheKey, tuple[str, float]] = {}
        #: The TVM-FFI modules of the kernels loaded from shared libraries, kept loaded.
        self._libraries: dict[CacheKey, Any] = {}

    def __len__(self) -> int:
        return len(self._fns)

    @property
    def memory(self) -> dict:
        """The in-process kernels by key, for reading: replaced whole, never cleared in place, so a caller's memo
        of kernels it got here stays valid while ``memory`` is the same object."""
        return self._fns

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._fns

    def get(self, key: CacheKey, build: Callable[[], Any]) -> Callable:
        """The kernel for ``key``: from memory, else from disk, else ``build()`` (then stored).

        ``build`` returns a CuTe DSL compiled function (``cute.compile(...,
        options="--enable-tvm-ffi")``); it is only called on a miss.
        """
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        with _DSL_LOCK:
            fn = self._fns.get(key)
            if fn is None:
                fn = self._fetch(key, build)
                self._fns[key] = fn
        return fn

    def ensure_on_disk(self, key: CacheKey, build: Callable[[], Any]) -> tuple[str, Path]:
        """Ahead-of-time: make sure ``key`` has a disk entry; returns ("cached" | "compiled", path).

        Never loads the entry into this process (no GPU is needed).
        """
        root = cache_dir()
        if root is None:
            raise CompileError("EPICUTE_CACHE=0 disables the disk cache, so there is nowhere to compile to")
        directory = _kernels_dir(root)
        directory.mkdir(parents=True, exist_ok=True)
        with _DSL_LOCK, _file_lock(directory / f"{key.digest}.lock"):
            try:
                if self._read_verified(directory, key) is not None:
                    return "cached", directory / f"{key.digest}.o"
            except CorruptEntry as exc:
                self._discard(directory, key, str(exc))
            self._store(directory, key, self._compile(key, build))
        return "compiled", directory / f"{key.digest}.o"

    def on_disk(self, key: CacheKey) -> bool:
        """Whether ``key`` has an intact disk entry (nothing is loaded, nothing removed)."""
        root = cache_dir()
        try:
            return root is not None and self._read_verified(_kernels_dir(root), key) is not None
        except CorruptEntry:
            return False

    def clear_memory(self) -> None:
        """Forget the in-process kernels (disk entries stay)."""
        self._fns = {}
        self.events.clear()

    # ------------------------------------------------------------------ internals
    def _compile(self, key: CacheKey, build: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        compiled = build()
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.compile_seconds += seconds
        self.events[key] = ("compiled", seconds)
        return compiled

    def _fetch(self, key: CacheKey, build: Callable[[], Any]) -> Callable:
        root = cache_dir()
        if root is None:
            return self._compile(key, build)
        directory = _kernels_dir(root)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._warn(f"dir:{directory}", f"epicute: cannot create cache directory {directory} ({exc}); compiling")
            return self._compile(key, build)
        fn = self._load(directory, key, locked=False)
        if fn is not None:
            return fn
        # One process compiles; the others wait here and then load its entry.
        with _file_lock(directory / f"{key.digest}.lock"):
            fn = self._load(directory, key, locked=True)
            if fn is not None:
                return fn
            compiled = self._compile(key, build)
            try:
                self._store(directory, key, compiled)
            except OSError as exc:
                self._warn(f"write:{directory}", f"epicute: cannot write to the kernel cache {directory} ({exc})")
                return compiled
        # Serve what was written: the calling path is then identical for a
        # fresh and a loaded kernel, and a bad export shows up now, not later.
        return self._load(directory, key, locked=False, record=False) or compiled

    def _read_verified(self, directory: Path, key: CacheKey) -> dict | None:
        """The entry's manifest if the entry is complete and intact; None if absent."""
        obj = directory / f"{key.digest}.o"
        manifest_path = directory / f"{key.digest}.json"
        if not manifest_path.exists():
            if obj.exists():
                raise CorruptEntry("object file without a manifest")
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            data = obj.read_bytes()
        except (OSError, ValueError) as exc:
            raise CorruptEntry(f"unreadable ({exc})") from exc
        if manifest.get("key") != key.text:
            raise CorruptEntry("manifest is for another key")
        if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise CorruptEntry(f"object file is {len(data)} bytes and fails its checksum (truncated?)")
        return manifest

    def _load(self, directory: Path, key: CacheKey, locked: bool, record: bool = True) -> Callable | None:
        """The entry's kernel, or None. Only a ``locked`` caller (no writer can be
        active) judges a bad entry damaged and removes it; otherwise it is a miss."""
        start = time.perf_counter()
        try:
            manifest = self._read_verified(directory, key)
            if manifest is None:
                return None
            fn = self._load_library(directory, key, manifest)
            if fn is None:
                fn = load_exported(directory / f"{key.digest}.o", manifest["function"])
        except Exception as exc:  # noqa: BLE001 - CorruptEntry, or the DSL's loader (any type): a bad entry is a miss
            if locked:
                reason = str(exc) if isinstance(exc, CorruptEntry) else f"does not load ({type(exc).__name__}: {exc})"
                self._discard(directory, key, reason)
            return None
        if record:
            seconds = time.perf_counter() - start
            self.stats.disk_loads += 1
            self.stats.disk_load_seconds += seconds
            self.events[key] = ("disk", seconds)
        return fn

    def _load_library(self, directory: Path, key: CacheKey, manifest: dict) -> Callable | None:
        """The entry's kernel from its shared library, or None where it has none, or it does not match its
        manifest or does not load (the object file then serves)."""
        library = manifest.get("library")
        path = directory / f"{key.digest}.so"
        if not isinstance(library, dict) or not path.exists():
            return None
        try:
            data = path.read_bytes()
            if len(data) != library.get("size") or hashlib.sha256(data).hexdigest() != library.get("sha256"):
                return None
            module, fn = load_library(path, manifest["function"])
        except Exception:  # noqa: BLE001 - TVM-FFI's loader raises several types; the object file is the fallback
            return None
        self._libraries[key] = module  # the kernel's code lives as long as its module
        return fn

    def _store(self, directory: Path, key: CacheKey, compiled: Any) -> None:
        function = f"epicute_{key.kind}_{key.digest[:16]}"
        obj = directory / f"{key.digest}.o"
        tag = f"{os.getpid()}.{threading.get_ident()}"
        tmp = directory / f".{key.digest}.{tag}.tmp.o"
        tmp_library = directory / f".{key.digest}.{tag}.tmp.so"
        library = None
        try:
            compiled.export_to_c(str(tmp), function_name=function)
            data = tmp.read_bytes()
            if link_library(tmp, tmp_library):
                library_data = tmp_library.read_bytes()
                library = {"size": len(library_data), "sha256": hashlib.sha256(library_data).hexdigest()}
                os.replace(tmp_library, directory / f"{key.digest}.so")
        finally:
            tmp.unlink(missing_ok=True)
            tmp_library.unlink(missing_ok=True)
        _write_atomic(obj, data)
        seconds = self.events.get(key, ("compiled", 0.0))[1]
        manifest = {
            "key": key.text,
            "kind": key.kind,
            "arch": key.arch,
            "parts": repr(key.parts),
            "label": key.label,
            "function": function,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            **({"library": library} if library else {}),
            "versions": dict(code_versions()),
            "compile_seconds": round(seconds, 3),
            "created": time.time(),
        }
        _write_atomic(directory / f"{key.digest}.json", json.dumps(manifest, indent=1).encode())

    def _discard(self, directory: Path, key: CacheKey, reason: str) -> None:
        self.stats.rebuilt_corrupt += 1
        self._warn(
            key.digest,
            f"epicute: kernel cache entry {key.digest[:16]} ({key.kind}) is damaged: {reason}; rebuilding it",
        )
        for suffix in (".json", ".o", ".so"):  # manifest first: a reader never sees a half-removed entry as whole
            (directory / f"{key.digest}{suffix}").unlink(missing_ok=True)

    def _warn(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def load_exported(path: Path, function: str) -> Callable:
    """Load an exported kernel's object file as a TVM-FFI function through the DSL, which links it in
    memory (works without a GPU; launching needs one)."""
    return _dsl_cute().runtime.load_module(str(path), enable_tvm_ffi=True)[function]


def load_library(path: Path, function: str) -> tuple[Any, Callable]:
    """``(module, function)`` of an entry's shared library, loaded by TVM-FFI alone (no DSL import)."""
    import tvm_ffi

    module = tvm_ffi.load_module(str(path))
    return module, module[function]


def link_library(obj: Path, out: Path) -> bool:
    """Link an exported object file into a shared library at ``out`` with the C compiler (``$CC``, else
    ``cc``), against the DSL's runtime and TVM-FFI, found again at load time through its run path.
    False (and no file) when there is no compiler or the link fails: the object file serves alone."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return False
    from cutlass.runtime import find_runtime_libraries  # the DSL is imported: this runs after a compile

    libraries = find_runtime_libraries(enable_tvm_ffi=True)
    run_path = [f"-Wl,-rpath,{Path(lib).parent}" for lib in libraries]
    result = subprocess.run(
        [compiler, "-shared", "-o", str(out), str(obj), *libraries, *run_path], capture_output=True, check=False
    )
    if result.returncode != 0:
        out.unlink(missing_ok=True)
        return False
    return True


def _dsl_cute():
    """The DSL's ``cute`` module. Its first import takes seconds; ``epicute/__init__`` has already
    set the target arch it reads."""
    from cutlass import cute

    return cute


# ---------------------------------------------------------------------- inspection
def disk_entries(root: Path | None = None, verify: bool = False) -> list[dict]:
    """Manifests of the entries on disk (``root`` defaults to :func:`cache_dir`), newest first.

    Each has a ``current`` flag: False when it was built by other code versions
    (it can never be hit again; ``epicute cache clear --stale`` removes those),
    and a ``damaged`` one: why the entry cannot be used, or ``""``. An unreadable
    manifest is always damaged; ``verify`` also reads each object file and checks
    it against its manifest (present, size, sha256) as a load would.
    """
    root = root if root is not None else cache_dir()
    if root is None or not _kernels_dir(root).is_dir():
        return []
    current = dict(code_versions())
    entries = []
    for manifest_path in _kernels_dir(root).glob("*.json"):
        try:
            manifest = json.loads(manifest_path.read_text())
            if not isinstance(manifest, dict):
                raise TypeError("not a JSON object")
            manifest["damaged"] = _entry_damage(manifest_path, manifest) if verify else ""
        except (OSError, ValueError, TypeError):
            manifest = {"kind": "?", "size": 0, "versions": {}, "damaged": "unreadable manifest"}
        manifest["digest"] = manifest_path.stem
        manifest["current"] = manifest.get("versions") == current
        entries.append(manifest)
    return sorted(entries, key=lambda e: e.get("created", 0.0), reverse=True)


def _entry_damage(manifest_path: Path, manifest: dict) -> str:
    """Why the entry of this manifest could not be loaded (the checks of ``_read_verified``), or ``""``."""
    if hashlib.sha256(str(manifest.get("key", "")).encode()).hexdigest() != manifest_path.stem:
        return "manifest is for another key"
    try:
        data = manifest_path.with_suffix(".o").read_bytes()
    except FileNotFoundError:
        return "object file missing"
    except OSError as exc:
        return f"object file unreadable ({exc.strerror or exc})"
    if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return f"object file is {len(data)} bytes and fails its checksum"
    return ""


def clear_disk(root: Path | None = None, stale_only: bool = False) -> int:
    """Remove disk entries (only those of other code versions with ``stale_only``); returns how many."""
    root = root if root is not None else cache_dir()
    if root is None or not _kernels_dir(root).is_dir():
        return 0
    directory = _kernels_dir(root)
    removed = 0
    for entry in disk_entries(root):
        if stale_only and entry["current"]:
            continue
        for suffix in (".json", ".o", ".so", ".lock"):
            (directory / f"{entry['digest']}{suffix}").unlink(missing_ok=True)
        removed += 1
    if not stale_only:  # leftovers: orphaned object files, temporaries, locks
        for path in directory.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)
    return removed


#: The process-wide cache every kernel kind goes through.
KERNEL_CACHE = KernelCache()

__all__ = [
    "KERNEL_CACHE",
    "CacheKey",
    "CacheStats",
    "JsonTable",
    "KernelCache",
    "cache_dir",
    "check_cache_dir",
    "clear_disk",
    "code_versions",
    "disk_entries",
    "link_library",
    "load_exported",
    "load_library",
    "sources_fingerprint",
]  # fmt: skip
