#!/usr/bin/env bash
# The repository's own Python environment, for `make demo` and `make test`: a virtualenv (default .venv/ in the
# repository) made with the system's Python, so that pip installs into it and never into the system (Debian and
# Ubuntu refuse that: PEP 668, "externally-managed-environment").
#
#   scripts/venv.sh [VENV] [PYTHON]       # defaults: .venv, python3
#
# Says what the system lacks when it cannot make one (python3, Python >= 3.10, the venv module with ensurepip:
# Debian's python3-venv) and exits 1. Idempotent: an environment that works is kept; one left broken (made
# without pip, e.g. before python3-venv was installed) is made again.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${2:-python3}

say() { printf '[venv] %s\n' "$*" >&2; }

if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    exit 0
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    say "no $PYTHON on PATH: install Python 3.10 or newer, on Debian or Ubuntu: sudo apt-get install python3 python3-venv"
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    say "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'):" \
        "the toolkit needs 3.10 or newer; give another with PYTHON=..., e.g. make demo PYTHON=python3.11"
    exit 1
fi
# Debian and Ubuntu ship the venv module's ensurepip (the pip a new venv gets) apart, in python3-venv.
if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
    version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    say "$PYTHON cannot make a virtual environment: its venv module or ensurepip is missing. On Debian or Ubuntu:"
    say "    sudo apt-get install python3-venv      (or python$version-venv)"
    say "then run the same make command again"
    exit 1
fi
rm -rf "$VENV"
say "making $VENV with $(command -v "$PYTHON") ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"
if ! "$PYTHON" -m venv "$VENV" >&2; then
    rm -rf "$VENV"
    say "$PYTHON -m venv $VENV failed (see above); on Debian or Ubuntu: sudo apt-get install python3-venv"
    exit 1
fi
