"""The README's two commands as a fresh machine sees them: the system's python3 (Debian's, which refuses `pip
install` outside a virtual environment: PEP 668), a PATH of system directories only, a copy of the repository
holding only its files. `make demo` makes .venv/ there, installs into it, and runs the demo through it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PATH = ":".join(
    d
    for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
    if Path(d).is_dir()
)
SYSTEM_PYTHON = Path("/usr/bin/python3")
MAKE_DEMO_TIMEOUT_S = 600  # the first install fills pip's cache; then about a minute


def _machine_env(**more: str) -> dict[str, str]:
    """What a login shell of a fresh machine has: HOME (pip's cache and config are there), a locale, the
    machine's own pip settings and proxies; none of the caller's PATH, PYTHONPATH or virtualenv."""
    keep = (
        "HOME",
        "LANG",
        "USER",
        "LOGNAME",
        "TMPDIR",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    )
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    return {"PATH": SYSTEM_PATH, "LANG": env.get("LANG", "C.UTF-8"), **env, **more}


def _clean_copy(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked, and new ones not ignored): no .venv, no runs/."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _debian_python() -> Path:
    """The machine's /usr/bin/python3, checked to be a Debian-style one that refuses pip outside a venv, and the
    python3 a system PATH finds (the one `make` uses)."""
    found = shutil.which("python3", path=SYSTEM_PATH)
    assert found == str(SYSTEM_PYTHON), (
        f"python3 on the system PATH is {found}, not Debian's {SYSTEM_PYTHON}"
    )
    marker = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert (Path(marker) / "EXTERNALLY-MANAGED").is_file(), (
        f"{SYSTEM_PYTHON} has no EXTERNALLY-MANAGED marker: this test needs Debian's (or Ubuntu's) python3"
    )
    return SYSTEM_PYTHON


@pytest.mark.slow
def test_make_demo_on_a_fresh_machine_makes_its_venv_and_passes_its_audit(tmp_path):
    python = _debian_python()
    refused = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "msgspec"],
        capture_output=True,
        text=True,
        env=_machine_env(),
        cwd=tmp_path,
    )
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, (
        "the system's pip refuses to install outside a venv (what made `make demo` fail before)"
    )
    repo = _clean_copy(tmp_path / "repo")
    assert not (repo / ".venv").exists() and not (repo / "runs").exists()
    r = subprocess.run(
        ["make", "demo"],
        cwd=repo,
        env=_machine_env(),
        capture_output=True,
        text=True,
        timeout=MAKE_DEMO_TIMEOUT_S,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"making .venv with {python}" in out
    assert "audit of run demo (" in r.stdout and "): PASSED" in r.stdout
    assert (repo / "runs" / "demo" / "merged" / "audit.json").is_file()
    venv_python = repo / ".venv" / "bin" / "python"
    assert (
        subprocess.run(
            [
                str(venv_python),
                "-c",
                "import toolkit, sys; assert toolkit.__file__.startswith("
                f"{str(repo)!r}), toolkit.__file__",
            ],
            cwd=tmp_path,
            env=_machine_env(),
        ).returncode
        == 0
    )
    # nothing went into the system's Python
    assert (
        subprocess.run(
            [str(python), "-c", "import toolkit"],
            cwd=tmp_path,
            env=_machine_env(),
            capture_output=True,
        ).returncode
        != 0
    )
    # git ignores what the command made
    for made in (".venv/bin/python", "runs/demo/plan.json"):
        assert (
            subprocess.run(["git", "check-ignore", "-q", "--no-index", made], cwd=ROOT).returncode
            == 0
        ), made


def _no_ensurepip_python(tmp_path: Path) -> Path:
    """A python3 as Debian's without python3-venv: `import ensurepip` fails (a shadowing module says so)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "ensurepip.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n"
    )
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(f'#!/bin/sh\nPYTHONPATH={shadow} exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_without_python3_venv_make_says_which_package_to_install_and_makes_nothing(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copy2(ROOT / "Makefile", repo / "Makefile")
    fake = _no_ensurepip_python(tmp_path)
    r = subprocess.run(
        ["make", "demo", f"PYTHON={fake}"],
        cwd=repo,
        env=_machine_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "sudo apt-get install python3-venv" in r.stderr and "ensurepip is missing" in r.stderr, (
        r.stderr
    )
    assert "Traceback" not in r.stderr and not (repo / ".venv").exists()
    # the same when python3 itself is missing
    r = subprocess.run(
        ["make", "demo", "PYTHON=python3-not-here"],
        cwd=repo,
        env=_machine_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode != 0
        and "no python3-not-here on PATH" in r.stderr
        and "apt-get install python3" in r.stderr
    )


def test_a_venv_left_without_pip_is_made_again(tmp_path):
    """`python3 -m venv` without ensurepip leaves a venv with no pip (Debian before python3-venv): made again."""
    venv = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "venv.sh"), str(venv), sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "--version"], capture_output=True
        ).returncode
        == 0
    )


def test_both_commands_run_everything_through_the_venv():
    """`make -n`: every Python command of demo and test is .venv/bin's (never a bare toolkit, pip or pytest), test
    keeps its install lines and its Slurm start and stop, and CI runs exactly `make test`."""
    env = _machine_env()
    for target in ("demo", "test"):
        lines = subprocess.run(
            ["make", "-n", target], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        assert lines[0] == "bash scripts/venv.sh '.venv' 'python3'", lines
        for line in lines[1:]:
            for command in re.split(r"&&|;|\|\||\$\(", line):
                words = [w for w in command.split() if "=" not in w]  # VAR=value before the command
                assert not words or words[0] not in (
                    "toolkit",
                    "pip",
                    "pip3",
                    "pytest",
                    "python",
                    "python3",
                ), f"make {target}: a bare {words[0]!r} in {line!r}"
        if target == "demo":
            assert lines[1:] == [
                ".venv/bin/python -m pip install -q --disable-pip-version-check -e .",
                ".venv/bin/toolkit run jobs/demo.toml",
            ]
        else:
            text = "\n".join(lines)
            for needed in (
                ".venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'",
                "bash slurm/install.sh",
                "bash tests/install-browser.sh",
                "PYTHON=python3 bash tests/real_sglang/install.sh",
                "bash slurm/start.sh",
                "TEST_PROCESSES=2 .venv/bin/python tests/tiers.py",
                "bash slurm/stop.sh",
            ):
                assert needed in text, f"make test lacks {needed!r}:\n{text}"
    ci = (ROOT / ".ci" / "run").read_text().split("\n")
    assert [x for x in ci if x and not x.startswith(("#", "set ", "cd "))] == ["make test"]
