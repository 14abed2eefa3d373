#!/usr/bin/env bash
# The real-engine test tier's environment: a virtualenv with SGLang 0.5.23 from PyPI and the toolkit (editable),
# kept apart from the test environment (which, like a login node, has no SGLang). It runs on a CPU-only machine:
# SGLang without its GPU-only requirements (tests/real_sglang/requirements.txt) plus the test stand-in for the
# two sgl-kernel CPU ops (tests/real_sglang/cpu_ops), which the tests put on the server's PYTHONPATH.
#
#   tests/real_sglang/install.sh          # $TOOLKIT_SGLANG_VENV, default .venv-sglang in the repository
#
# Idempotent: a venv that already holds sglang 0.5.23 only gets the toolkit reinstalled (seconds).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${TOOLKIT_SGLANG_VENV:-$ROOT/.venv-sglang}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
T0=$SECONDS

if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [[ $have != "$SGLANG_VERSION" ]]; then
    # --no-deps: sglang's own requirements include GPU-only packages (flashinfer, sglang-kernel, ...) that a
    # CPU machine cannot use; requirements.txt lists what its server really imports here.
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
    "${PIP[@]}" -r "$HERE/requirements.txt"
fi
"${PIP[@]}" -e "$ROOT"
echo "[real_sglang/install] $VENV: sglang $SGLANG_VERSION and the toolkit ready in $((SECONDS - T0)) s" >&2
