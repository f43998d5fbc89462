"""Every ```python block of README.md runs as written, against a real etcd.

The README keeps two kinds of Python blocks: ```python blocks are complete
programs a reader can paste and run (this test runs each one, in a fresh
interpreter, with the etcd URL ``etcd3://127.0.0.1:2379`` pointed at a test
server and a key prefix of the test's own; ``memory://`` stays as it is); ```py blocks are fragments of a larger
project (a task module, a settings file), highlighted alike but not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
DEFAULT_URL = "etcd3://127.0.0.1:2379"


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_runnable_blocks() -> None:
    assert len(_blocks()) >= 2


@pytest.mark.parametrize(("line", "code"), _blocks(), ids=[f"line{line}" for line, _ in _blocks()])
@pytest.mark.parametrize("api", ["v3"])
def test_a_readme_block_runs_as_written(line: int, code: str, etcd_url: str, tmp_path: Path) -> None:
    program = code.replace(DEFAULT_URL, etcd_url)  # the test's server, with a key prefix of its own
    (tmp_path / "snippet.py").write_text(program)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(README.parent)}
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, f"README.md line {line}:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def test_the_readme_is_for_users() -> None:
    """A user reads about 350 lines; the detail lives in docs/, linked."""
    lines = README.read_text().count("\n")
    assert lines <= 350, f"README.md has {lines} lines: move detail to docs/ and link it"


def test_every_relative_link_of_the_docs_resolves() -> None:
    root = README.parent
    broken = []
    for page in [README, *sorted((root / "docs").glob("*.md")), root / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken
