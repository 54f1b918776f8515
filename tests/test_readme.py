"""README's first example must run anywhere: it is the snippet a new user pastes on a CPU machine."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_use_section_opens_with_a_snippet_that_runs_without_a_gpu(capsys):
    text = README.read_text()
    use = text[text.index("## Use") :]
    snippet = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    assert "cuda" not in snippet, "the first snippet must run without a GPU"
    namespace: dict = {}
    exec(compile(snippet, "README.md (Use)", "exec"), namespace)
    assert namespace["y"].shape == (100, 512) and namespace["o"].shape == (2, 300, 8, 64)
    assert namespace["plan"].problem.m == 8192 and "epicute GEMM plan" in capsys.readouterr().out
