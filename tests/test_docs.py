"""Every ```python block of docs/*.md runs as written, as README.md's do (tests/test_readme.py).

The same two kinds of blocks: ```python blocks are complete programs, run here in a fresh
interpreter with ``etcd3://127.0.0.1:2379`` pointed at a test server (a key prefix of the
test's own; ``memory://`` stays as it is); ```py blocks are fragments (a pytest file, a task
module, a line of settings), highlighted alike but not run. Blocks indented in a list run too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)
DEFAULT_URL = "etcd3://127.0.0.1:2379"


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.name}:{line}", textwrap.dedent(match.group(2))))
    return found


BLOCKS = _blocks()


def test_the_docs_have_runnable_blocks() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
@pytest.mark.parametrize("api", ["v3"])
def test_a_docs_block_runs_as_written(where: str, code: str, etcd_url: str, tmp_path: Path) -> None:
    """Issue 24.18: a block of docs/observability.md failed with NameError, and nothing ran them."""
    (tmp_path / "snippet.py").write_text(code.replace(DEFAULT_URL, etcd_url))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, f"docs/{where}:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def test_the_metrics_snippets_listen_on_loopback() -> None:
    """A metrics endpoint on every interface shows lock names and hosts to anyone who can reach it."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for call in re.findall(r"start_http_server\(([^)]*)\)", page.read_text()):
            assert call in ("port",) or "127.0.0.1" in call, f"{page.name}: start_http_server({call})"
