"""What a person sees at the terminal: quiet login-node commands, --version, status --json, logs that end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def toolkit(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_check_prints_no_torch_advisory_and_no_tokenizer_chatter():
    r = toolkit("check", "jobs/demo.toml")
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr + r.stdout
    assert "INFO toolkit.chat" not in r.stderr  # the tokenizer's load lines are debug detail on a login node
    assert "jobs/demo.toml: ok" in r.stdout and "think '<think>' 3993 / '</think>' 3994" in r.stdout


def test_other_transformers_warnings_still_pass():
    code = ("import logging, toolkit; lg = logging.getLogger('transformers'); "
            "print([f.filter(logging.makeLogRecord({'msg': m})) for f in lg.filters "
            "for m in ('PyTorch was not found. Models ...', 'something else')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True).stdout
    assert out.strip() == "[False, True]"


def test_version_comes_from_package_metadata():
    from importlib.metadata import version

    r = toolkit("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"toolkit {version('toolkit')}"
