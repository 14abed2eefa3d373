"""The README's and the docs' examples of the demo job are what the commands print.

Every fenced block of README.md and docs/jobs.md is read as a terminal session: a `$ toolkit ...` line and the
lines it printed. The commands that run anywhere on the demo job (`check`, `run`, `status` of its local run,
`export`) are run in a copy of `jobs/`, and each line shown must be printed, in that order (lines between them
may be left out, and `...` inside a line stands for any text). A fingerprint shown stands for the one printed:
it pins the model folder by its path, which differs with where the files are.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "jobs.md"]
RUNNABLE = re.compile(
    r"toolkit (check jobs/demo\.toml|run jobs/demo\.toml|status runs/demo|export runs/demo( --format \w+)?)$"
)
FINGERPRINT = re.compile(r"\b[0-9a-f]{16}\b")


def examples(page: Path) -> list[tuple[str, list[str]]]:
    """[(command, lines shown after it)] of every runnable command in the page's fenced blocks, in page order."""
    out: list[tuple[str, list[str]]] = []
    blocks: list[list[str]] = []
    inside = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            blocks += [[]] if inside else []
        elif inside:
            blocks[-1].append(line)
    for block in blocks:
        current: list[str] | None = None
        for line in block:
            if line.startswith("$ "):
                cmd = line[2:].split("  #")[0].strip()
                current = [] if RUNNABLE.fullmatch(cmd) else None
                if current is not None:
                    out.append((cmd, current))
            elif current is not None and line.strip() != "...":
                current.append(line)
    return out


def _pattern(shown: str) -> re.Pattern:
    parts = [re.escape(p) for p in FINGERPRINT.sub("\0", shown).split("...")]
    return re.compile(".*".join(parts).replace("\0", "[0-9a-f]{16}") + r"\s*")


def missing_lines(shown: list[str], printed: list[str]) -> list[str]:
    """The shown lines not found in `printed` in order (each after the one before it)."""
    at = 0
    missing = []
    for line in shown:
        pat = _pattern(line.rstrip())
        for i in range(at, len(printed)):
            if pat.fullmatch(printed[i].rstrip()):
                at = i + 1
                break
        else:
            missing.append(line)
    return missing


def test_the_examples_are_found():
    """The pages still show the demo's commands (a renamed command would leave this test checking nothing)."""
    cmds = [c for page in PAGES for c, _ in examples(page)]
    assert "toolkit run jobs/demo.toml" in cmds and "toolkit check jobs/demo.toml" in cmds
    assert "toolkit status runs/demo" in cmds and any(c.startswith("toolkit export") for c in cmds)
    assert not missing_lines(["a 0123456789abcdef ... z"], ["a fedcba9876543210 b c z"])
    assert missing_lines(["44 planned"], ["45 planned"]) == ["44 planned"]


@pytest.mark.slow
def test_the_demo_examples_are_what_the_commands_print(tmp_path):
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    env_cmd = [sys.executable, "-m", "toolkit"]
    # the run first: the other commands read the run it makes
    order = sorted(
        ((c, shown, page.name) for page in PAGES for c, shown in examples(page)),
        key=lambda e: not e[0].startswith("toolkit run"),
    )
    wrong = []
    for cmd, shown, page in order:
        r = subprocess.run(
            env_cmd + cmd.split()[1:],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
        )
        printed = [
            ln for ln in (r.stdout + r.stderr).splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", ln)
        ]
        assert r.returncode == 0, f"{page}: `{cmd}` exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        wrong += [
            f"{page}: `{cmd}` did not print: {line}" for line in missing_lines(shown, printed)
        ]
    assert not wrong, "\n".join(wrong)
