"""Every Python snippet of the README runs as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_readme_python_snippets_run(capsys):
    snippets = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(snippets) >= 3
    namespace: dict = {}
    for code in snippets:
        exec(compile(code, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "rmsnorm_bf16 >> linear_bf16" in out and "sm_90/qwen3-0.6b/bf16" in out
