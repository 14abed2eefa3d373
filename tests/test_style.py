"""The house style is the formatter's: `ruff format` at 100 columns and ruff's checks (pyflakes, import order, and
lines of at most 100 characters in the package) over everything Python in the repository. Fix with
`ruff format . && ruff check --fix .`; a line the formatter cannot wrap (a long string or comment) is wrapped by hand."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    """ruff from the test environment (the `test` extra pins it), else the one on PATH."""
    here = Path(sys.executable).with_name("ruff")
    found = str(here) if here.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail(
            "ruff is not installed: pip install -e '.[test]' (the test extra pins it)",
            pytrace=False,
        )
    return [found]


def test_the_code_is_as_ruff_formats_it():
    r = subprocess.run(
        [*ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"`ruff format .` would change:\n{r.stdout}{r.stderr}"


def test_ruff_finds_nothing():
    r = subprocess.run(
        [*ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"`ruff check .`:\n{r.stdout}{r.stderr}"


def test_the_limits_are_100_columns_everywhere_and_the_package_holds_them():
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert conf["line-length"] == 100 and "E501" in conf["lint"]["select"]
    assert "toolkit/**" not in conf["lint"].get("per-file-ignores", {})
