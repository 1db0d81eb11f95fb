"""The README's Python examples run as written (on the CPU) and print a result."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def examples():
    if not README.exists():
        return []
    text = README.read_text()
    section = text[text.index("## Python"):]
    section = section[:section.index("\n## ", 1)]
    return [block for block in re.findall(r"```python\n(.*?)```", section, re.S) if block.startswith("import ")]


@pytest.mark.parametrize("code", examples(), ids=lambda code: code.split("\n")[0])
def test_readme_example(code):
    if "torch" in code.split("\n")[0]:
        pytest.importorskip("torch", reason="torch is not installed: the README's PyTorch example is skipped")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, str(README), "exec"), {})
    printed = stdout.getvalue()
    assert re.search(r"\b64, 4, 128\b", printed), printed


def test_readme_has_both_examples():
    if not README.exists():
        pytest.skip("README.md is not beside the tests (installed elsewhere)")
    firsts = [code.split("\n")[0] for code in examples()]
    assert any("torch" in f for f in firsts) and any("numpy" in f for f in firsts)
