"""The Python that runs SGLang (`engine_python`: the engine's own interpreter, found once per
engine, never the worker's unless it has sglang) and SGLang's own judgement of a command line
(`check_argv_with_sglang`), each asked in a subprocess so that the worker never imports sglang (and
torch) itself."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from toolkit.engines.base import EngineError

__all__ = ["check_argv_with_sglang", "engine_python", "has_sglang"]

log = logging.getLogger("toolkit.engines.sglang")  # the SGLang engine's lines name one logger


# Run with the engine's own interpreter and environment, before the weights load: SGLang's parser
# judges the command line. A subprocess, so that the worker never imports sglang (and torch) itself.
_ARGV_CHECK = """
import argparse, importlib.util, sys
if importlib.util.find_spec("sglang") is None:
    print("toolkit: no sglang here"); sys.exit(0)
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
parser.parse_args(sys.argv[1:])
"""
ARGV_CHECK_TIMEOUT_S = 600.0


def check_argv_with_sglang(
    args: list[str], env: dict[str, str], python: str = sys.executable, secret: str | None = None
) -> None:
    """Parse `args` (the flags after `-m sglang.launch_server`) with SGLang's own parser, where
    sglang is installed; a refusal raises EngineError with argparse's message. Anything else (no
    sglang, an import that fails, a timeout) is logged and left to the launch itself."""
    try:
        r = subprocess.run(
            [python, "-c", _ARGV_CHECK, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ARGV_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning(
            "could not check the command line with SGLang's parser (%s); launching anyway", e
        )
        return
    if r.returncode == 0:
        log.info(
            "SGLang's parser accepts the command line"
            if "no sglang here" not in r.stdout
            else "sglang is not importable here: the command line is not checked by its parser"
        )
        return
    lines = [x.replace(secret, "***") if secret else x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if "error:" in x]
    if r.returncode == 2 and errors:
        raise EngineError(
            f"SGLang's parser refuses the server command line: {errors[-1].strip()} — fix "
            "[engine] extra_args (nothing was launched)"
        )
    log.warning(
        "checking the command line with SGLang's parser failed (exit %s): %s; launching anyway",
        r.returncode,
        " | ".join(lines[-3:]) or "no output",
    )


# Asked of a candidate interpreter: its environment (sys.prefix) and whether sglang is importable
# there.
_PROBE = (
    "import importlib.util, sys; print(sys.prefix); "
    "print(importlib.util.find_spec('sglang') is not None)"
)
PROBE_TIMEOUT_S = 120.0


def _probe(python: str, env: dict[str, str]) -> tuple[str, bool] | None:
    """(sys.prefix, has sglang) of `python` run with `env`; None when it does not run."""
    try:
        r = subprocess.run(
            [python, "-c", _PROBE],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.split()
    return (lines[0], lines[1] == "True") if r.returncode == 0 and len(lines) == 2 else None


def has_sglang(python: str, env: dict[str, str]) -> bool:
    """Whether `sglang` is importable by `python` run with `env`."""
    seen = _probe(python, env)
    return seen is not None and seen[1]


def engine_python(python: str | None, env: dict[str, str]) -> tuple[str, str]:
    """(interpreter, why) that SGLang starts with in the environment `env` (the worker's, as the
    node's [slurm] setup left it, with [engine] env): [engine] python when the job names one (a
    path, or a name on env's PATH); else the first python3 (or python) on env's PATH whose
    environment is not the toolkit's own and has sglang, as `source ~/venvs/sglang/bin/activate` in
    the setup prepares; else the toolkit's own interpreter."""
    path = env.get("PATH", os.defpath)
    if python:
        found = shutil.which(os.path.expanduser(python), path=path)
        if found is None:
            raise EngineError(
                f"[engine] python = {python!r}: no such interpreter on this node (PATH {path}); "
                "give the path of the Python that has sglang here, or activate its environment in "
                "[slurm] setup and remove [engine] python"
            )
        return found, "[engine] python"
    for name in ("python3", "python"):
        found = shutil.which(name, path=path)
        if found is None:
            continue
        seen = _probe(found, env)
        if seen is None:
            continue
        prefix, has_sglang = seen
        if os.path.realpath(prefix) == os.path.realpath(sys.prefix):
            break  # the toolkit's own environment: its own interpreter
        if has_sglang:
            return (
                found,
                f"the first {name} on PATH, with sglang (the environment [slurm] setup prepared)",
            )
        break
    return sys.executable, "the toolkit's own Python"
