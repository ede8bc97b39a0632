"""The README's example runs as written (on the embedded dataset, CPU)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None, "README has a python example"
    scope: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), scope)
    assert scope["step"] >= 1, "more than one pack was trained"
    assert scope["loss"].item() > 0 and scope["batch"].num_docs >= 1
