"""The README's quick start runs as written."""

import pathlib
import re

# UTF-8 with non-ASCII characters: read as such whatever the locale's encoding (ASCII under
# LANG=en_US.US-ASCII, for one)
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs(capsys):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md quick start", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"^20000 samples in \d+ trees, \d+\.\dx fewer ids than flat$", out, re.M)


def test_readme_keeps_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
