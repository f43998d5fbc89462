"""What the package publishes, and how its development is set up (issue 25.9): read from the files, no build."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test group brings tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REGISTERS = "addinivalue_line(" + '"markers"'  # split: this file must not match itself
BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}


def test_only_user_extras_are_published_and_the_tooling_is_in_dependency_groups() -> None:
    assert set(PYPROJECT["project"]["optional-dependencies"]) == {"redis", "metrics", "django"}
    assert {"test", "lint", "bench", "release", "demo"} <= set(PYPROJECT["dependency-groups"])
    setup = (REPO / "scripts" / "setup-system").read_text()
    assert "--group" in setup and "[test" not in setup, "scripts/setup-system must install the groups"


def test_every_marker_is_registered_in_pyproject_and_unknown_ones_fail() -> None:
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"]
    registered = {line.split(":")[0].split("(")[0].strip() for line in options["markers"]}
    used = set()
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"pytest\.mark\.([a-z_]+)", text))
        used |= set(re.findall(r"get_closest_marker\(\"([a-z_]+)\"\)", text))
        assert REGISTERS not in text, f"{path.name} registers a marker: do it in pyproject.toml"
    assert used - BUILTIN_MARKS <= registered, used - BUILTIN_MARKS - registered
    assert {"slow", "cluster", "install"} <= registered  # the fast lane's three


def test_ci_checks_the_format() -> None:
    assert "ruff format --check" in (REPO / ".ci" / "run").read_text()
