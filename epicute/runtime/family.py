"""A kernel family's declaration, and what the runtime derives from the list of them.

Each kernel family is declared once, as a :class:`FamilySpec` in :mod:`epicute.families`: its
kind, its compile function per arch, the modules its generated code is made from, its
``epicute compile`` job and its torch op. Everything that used to be a hand-kept list or a
registration done by importing a module is derived from those declarations:

- the disk cache's fingerprint of the kernel sources (:func:`codegen_files`, read by
  :func:`epicute.runtime.cache.code_versions`): a source left out of it would let an upgraded
  epicute load kernels built from the old text;
- the families by kind (:data:`epicute.runtime.compile.FAMILIES`), the spec tables
  ``epicute compile`` takes (:data:`epicute.runtime.aot.JOB_KINDS`) and the torch ops
  (:func:`epicute.runtime.torch_ops.define_ops`).

So no registry depends on which modules happen to have been imported. Functions are named as
``"module:attribute"`` text and imported on first use: declaring every family imports none of
them and not the CuTe DSL (``import epicute`` stays cheap). The runtime knows no family by name:
it reads the list from :data:`DECLARATIONS_MODULE` when first asked.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

#: The module holding the declarations (``DECLARATIONS``) and the shared codegen modules (``SHARED_CODEGEN``).
DECLARATIONS_MODULE = "epicute.families"

#: The package's directory: codegen modules are named from it (``epicute.sm90`` is ``<it>/sm90/``).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FamilySpec:
    """One kernel family, declared once (see the module docstring).

    ``compilers`` maps an arch to its compile function, ``"module:function"`` (``f(variant)``, see
    :class:`~epicute.runtime.compile.KernelFamily`). ``codegen`` names the modules (or packages) whose
    source shapes the family's generated code, dotted (``"epicute.attention.backward_sm90"``): the
    kernels, what they read while traced (configs, shared-memory layouts), and the compile functions.
    ``aot`` (``"module:function"``, ``f(entry, target) -> [(variant, description)]``) makes the
    variants of one ``[[<kind>]]`` table entry of an ``epicute compile`` spec; ``torch_op``
    (``"module:NAME"``) is the family's :class:`~epicute.runtime.torch_ops.TorchOp`.
    """

    kind: str
    compilers: Mapping[str, str]
    codegen: tuple[str, ...]
    aot: str | None = None
    torch_op: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compilers", MappingProxyType(dict(self.compilers)))
        object.__setattr__(self, "codegen", tuple(self.codegen))
        refs = [*self.compilers.values(), *(r for r in (self.aot, self.torch_op) if r is not None)]
        bad = [r for r in refs if not isinstance(r, str) or r.count(":") != 1]
        if not self.kind or not self.compilers or not self.codegen or bad:
            raise ValueError(
                f"family {self.kind!r}: give a kind, compilers {{arch: 'module:function'}}, its codegen modules, "
                f"and functions as 'module:attribute' text (got {bad})"
            )


def resolve(ref: str) -> Any:
    """The object a ``"module:attribute"`` reference names, its module imported now."""
    module, _, name = ref.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=1)
def _declared() -> tuple[tuple[FamilySpec, ...], tuple[str, ...]]:
    module = importlib.import_module(DECLARATIONS_MODULE)
    specs = tuple(module.DECLARATIONS)
    kinds = [spec.kind for spec in specs]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"{DECLARATIONS_MODULE}: a kind is declared twice in {kinds}")
    return specs, tuple(module.SHARED_CODEGEN)


def declarations() -> tuple[FamilySpec, ...]:
    """Every declared family, in declaration order."""
    return _declared()[0]


def declaration(kind: str) -> FamilySpec:
    """The family declared as ``kind``; KeyError naming the declared kinds if none is."""
    for spec in declarations():
        if spec.kind == kind:
            return spec
    declared = [spec.kind for spec in declarations()]
    raise KeyError(f"no kernel family {kind!r} is declared in {DECLARATIONS_MODULE}; declared are {declared}")


def codegen_modules() -> tuple[str, ...]:
    """The shared codegen modules, then every family's (each once): what the fingerprint reads."""
    shared, specs = _declared()[1], declarations()
    return tuple(dict.fromkeys([*shared, *(name for spec in specs for name in spec.codegen)]))


def module_source(name: str, root: Path = PACKAGE_ROOT) -> Path:
    """The source of the dotted module or package ``name`` (``epicute.x.y``: ``root/x/y.py`` or ``root/x/y/``)."""
    head, *parts = name.split(".")
    if head != PACKAGE_ROOT.name:
        raise ValueError(f"codegen module {name!r} is outside the {PACKAGE_ROOT.name} package")
    base = root.joinpath(*parts)
    if base.is_dir():
        return base
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    raise ValueError(f"codegen module {name!r} has no source: neither {base}.py nor {base}/ exists")


def codegen_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The source files of :func:`codegen_modules` under ``root`` (a copy of the package's directory), sorted."""
    files: set[Path] = set()
    for name in codegen_modules():
        path = module_source(name, root)
        files.update(path.rglob("*.py") if path.is_dir() else [path])
    return sorted(files)


class Declared(Mapping):
    """``kind -> make(spec)`` over the declared families that ``select`` keeps, each value made on first use
    (and once: the same object every time). Listing the kinds imports no family."""

    def __init__(self, make: Callable[[FamilySpec], Any], select: Callable[[FamilySpec], bool] = lambda s: True):
        self._make, self._select = make, select
        self._made: dict[str, Any] = {}

    def _kinds(self) -> list[str]:
        return [spec.kind for spec in declarations() if self._select(spec)]

    def __getitem__(self, kind: str) -> Any:
        made = self._made.get(kind)
        if made is None:
            spec = declaration(kind)
            if not self._select(spec):
                raise KeyError(kind)
            made = self._made.setdefault(kind, self._make(spec))
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())

    def __repr__(self) -> str:
        return f"Declared({self._kinds()})"


__all__ = [
    "DECLARATIONS_MODULE", "Declared", "FamilySpec", "codegen_files", "codegen_modules", "declaration",
    "declarations", "module_source", "resolve",
]  # fmt: skip
