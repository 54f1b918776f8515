"""The kernel families' declarations (``epicute/families.py``) and what is derived from them.

The disk cache keys every kernel by a fingerprint of the sources its code is generated from; a source
missing from it lets an upgraded epicute load a kernel built from the old text, silently. So every
module that imports the CuTe DSL, and every module a kernel's modules import (what the kernel reads
while it is traced), must be in some family's ``codegen`` or the shared ones, unless it is listed
in :data:`NOT_CODEGEN` with the reason it cannot change generated code. Imports are read from the
source (module level and inside functions), so a new import is checked without running anything.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
import torch

from epicute.runtime.family import PACKAGE_ROOT, codegen_files, codegen_modules, declarations, module_source

#: Modules that kernel code imports (or that import the DSL) without shaping what it generates; each with why.
NOT_CODEGEN = {
    "epicute": "the package root: the cache imports it for its version, which every key holds by itself",
    "epicute.errors": "exception classes: a message never reaches generated code",
    "epicute.runtime.cache": "keys and the disk store: it imports the DSL to load objects and read the DSL's "
    "version, which every key holds by itself",
    "epicute.runtime.target": "arch names (every key holds the arch) and SM counts (launch arguments, never code)",
    "epicute.runtime.family": "the declarations' type: which function compiles a variant, not what it generates",
    "epicute.runtime.buffers": "whether a launch's device buffers are kept between calls: never generated code",
    "epicute.runtime.precompile": "which variants compile where: a worker imports the DSL early to pay for its import "
    "before the first variant arrives, and compiles each through its family, as this process would",
}


def _dotted(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of the package, by dotted name.
MODULES = {_dotted(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), str(MODULES[module]))


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(module).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    """The deepest module of the package that ``name`` (a dotted path, maybe ending in an attribute) is in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _defining(package: str, name: str, seen: frozenset = frozenset()) -> str:
    """Where ``from package import name`` takes ``name`` from: its submodule, the module a package's
    ``__init__`` re-exports it from, else the package itself."""
    if f"{package}.{name}" in MODULES:
        return f"{package}.{name}"
    if MODULES[package].name == "__init__.py" and package not in seen:
        for node in ast.walk(_tree(package)):
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                source = _known(_absolute(package, node))
                if source is not None:
                    original = next(a.name for a in node.names if (a.asname or a.name) == name)
                    return _defining(source, original, seen | {package})
    return package


@cache
def imports_of(module: str) -> frozenset[str]:
    """The package's modules that ``module`` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _known(_absolute(module, node))
            if source is not None:
                found.update(_defining(source, alias.name) for alias in node.names if alias.name != "*")
    return frozenset(found - {None, module})


def imports_the_dsl(module: str) -> bool:
    for node in ast.walk(_tree(module)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n == "cutlass" or n.startswith("cutlass.") for n in names):
            return True
    return False


def fingerprinted() -> set[str]:
    """The modules whose text is in the cache's fingerprint."""
    return {_dotted(f) for f in codegen_files()}


def traced_reads() -> dict[str, str]:
    """Every module a kernel reads while traced, approximated: from each family's compile functions and codegen
    modules, their imports, transitively (never through :data:`NOT_CODEGEN`); each with one module importing it."""
    starts = {ref.partition(":")[0] for spec in declarations() for ref in spec.compilers.values()}
    for spec in declarations():
        for name in spec.codegen:
            starts.update(m for m in MODULES if m == name or m.startswith(name + "."))
    reached = dict.fromkeys(starts, "a family's declaration")
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module in NOT_CODEGEN:
            continue
        for imported in sorted(imports_of(module)):
            if imported not in reached:
                reached[imported] = module
                todo.append(imported)
    return {m: by for m, by in reached.items() if m not in NOT_CODEGEN}


def test_every_module_that_imports_the_dsl_is_fingerprinted():
    dsl = [m for m in MODULES if imports_the_dsl(m)]
    assert "epicute.attention.backward_sm90" in dsl and "epicute.sm90.pipeline" in dsl  # the scan sees them
    missing = sorted(set(dsl) - fingerprinted() - set(NOT_CODEGEN))
    assert not missing, (
        f"{missing} import the CuTe DSL but are in no family's codegen (epicute/families.py): a change to them would "
        "not invalidate cached kernels"
    )


def test_every_module_a_kernel_reads_while_traced_is_fingerprinted():
    reads = traced_reads()
    assert {"epicute.attention.key_blocks", "epicute.gemm.config", "epicute.epilogue.optable"} <= set(reads)
    missing = {m: by for m, by in reads.items() if m not in fingerprinted()}
    assert not missing, (
        "modules kernels read while traced (imported by) are in no family's codegen (epicute/families.py), so a "
        f"change to them would not invalidate cached kernels: {missing}; declare them, or say in NOT_CODEGEN why "
        "they cannot change generated code"
    )


def test_the_not_codegen_list_holds_only_real_modules_outside_the_fingerprint():
    assert set(NOT_CODEGEN) <= set(MODULES)
    assert not set(NOT_CODEGEN) & fingerprinted()


def test_every_declared_codegen_module_has_a_source():
    for name in codegen_modules():
        assert module_source(name).exists()
    with pytest.raises(ValueError, match="no source"):
        module_source("epicute.attention.no_such_module")


def test_declarations_name_real_functions_and_each_kind_once():
    from epicute.runtime.aot import JOB_KINDS
    from epicute.runtime.compile import FAMILIES
    from epicute.runtime.torch_ops import TorchOp, define_ops

    kinds = [spec.kind for spec in declarations()]
    assert len(set(kinds)) == len(kinds) and list(FAMILIES) == kinds
    assert set(kinds) >= {"gemm", "grouped_gemm", "attention", "attention_combine", "attention_backward"}
    assert list(JOB_KINDS) == [spec.kind for spec in declarations() if spec.aot]
    for spec in declarations():
        family = FAMILIES[spec.kind]
        assert family is FAMILIES[spec.kind] and family.kind == spec.kind
        assert all(callable(family.compiler(arch)) for arch in spec.compilers)
        assert spec.aot is None or callable(JOB_KINDS[spec.kind])
    ops = define_ops()
    from epicute.runtime.family import resolve

    declared = [resolve(spec.torch_op) for spec in declarations() if spec.torch_op]
    traced_backwards = [resolve(op.traced_backward) for op in declared if op.traced_backward]  # defined with theirs
    assert sorted(ops) == sorted(
        f"epicute::{name}"
        for name in ("gemm", "gemm_backward", "grouped_gemm", "attention", "attention_backward", "quantize")
    ) and len(declared) + len(traced_backwards) == len(ops)
    for name in ops:
        assert hasattr(torch.ops.epicute, name.partition("::")[2])
    assert all(isinstance(op, TorchOp) for op in (*declared, *traced_backwards))


def test_each_family_module_uses_the_family_made_from_its_declaration():
    from epicute.attention import backward, launch
    from epicute.gemm.compile import GEMM_CACHE
    from epicute.grouped.compile import GROUPED_CACHE
    from epicute.runtime.compile import FAMILIES

    assert GEMM_CACHE is FAMILIES["gemm"] and GROUPED_CACHE is FAMILIES["grouped_gemm"]
    assert launch.ATTENTION_CACHE is FAMILIES["attention"] and launch.COMBINE_CACHE is FAMILIES["attention_combine"]
    assert backward.BACKWARD_CACHE is FAMILIES["attention_backward"]
    assert backward.PREPROCESS_CACHE is FAMILIES["attention_backward_preprocess"]
    assert backward.POSTPROCESS_CACHE is FAMILIES["attention_backward_postprocess"]


#: What registering by import looks like; only the runtime's own modules may do it (from the declarations).
REGISTERING = re.compile(
    r"^\s*(@?torch\.library\.(custom_op|register_autograd|register_fake)\b|@\w+\.register_fake|"
    r"\w+ = KernelFamily\(|(JOB_KINDS|FAMILIES)\[[^\]]+\]\s*=)",
    re.M,
)


def test_no_module_registers_a_family_piece_when_imported():
    offenders = [
        m
        for m, path in MODULES.items()
        if not m.startswith("epicute.runtime.") and REGISTERING.search(path.read_text())
    ]
    assert not offenders, f"{offenders}: declare the family's pieces in epicute/families.py instead"
