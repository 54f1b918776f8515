"""What importing epicute costs: neither ``import epicute`` nor ``epicute --help`` loads
dynamo (seconds) or the CuTe DSL; each command imports what it needs when it runs."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import subprocess_env

HELP = """
import sys
from epicute.cli import app
try:
    app(["--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(sorted(m for m in ("torch._dynamo", "cutlass") if m in sys.modules))
"""


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_import_epicute_does_not_import_dynamo():
    assert _run("import epicute, sys; print('torch._dynamo' in sys.modules)") == "False"


def test_cli_help_imports_neither_dynamo_nor_the_dsl():
    assert _run(HELP) == "[]"
