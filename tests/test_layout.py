"""The house's one import rule: ``epicute.gemm`` and ``epicute.attention`` are both public functions
and family packages, so ``import epicute.gemm.x as y`` resolves through the function and fails at
import time. Every module imports from them with ``from epicute.gemm import x`` instead."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAP = re.compile(r"^\s*import epicute\.(gemm|attention)\.\S+ as ", re.M)


def test_no_module_imports_a_family_module_through_its_function_name():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("epicute", "tests", "bench")
        for path in (ROOT / folder).rglob("*.py")
        if TRAP.search(path.read_text())
    ]
    assert not offenders, f"use `from epicute.gemm import x` in {offenders}"
