"""Fixtures for the kernel tests."""

from __future__ import annotations

import re

import pytest

from epicute.runtime import compile as compile_module


@pytest.fixture
def ptxas_report(monkeypatch, capfd):
    """Compiles made under this fixture print ptxas's report (``remarks{ptx}``); the returned
    function reads what was printed since the last call: ``(spill store bytes per kernel,
    injected-WGMMA-fence warnings)``. Spills and injected fences are what cost attention most:
    see bench/NOTES.md, "Attention registers and instruction order"."""
    monkeypatch.setattr(compile_module, "DSL_COMPILE_OPTIONS", compile_module.DSL_COMPILE_OPTIONS + " remarks{ptx}")

    def read() -> tuple[list[int], list[str]]:
        out = "".join(capfd.readouterr())
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out)]
        assert spills, "no ptxas report was printed: did the compile go through DSL_COMPILE_OPTIONS?"
        return spills, re.findall(r"\(C7519\)[^\n]*", out)

    return read
