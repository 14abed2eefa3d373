#!/usr/bin/env bash
# The trainer test tier's environment: a virtualenv with SpecForge 0.2.0 and speculators 0.9.0 from PyPI on a CPU
# build of torch, kept apart from the test environment (the trainers pin their own torch and transformers). Both
# are installed without their GPU-only requirements (tests/trainers/requirements.txt lists what their data code and
# SpecForge's training step import on a CPU).
#
#   tests/trainers/install.sh          # $TOOLKIT_TRAINERS_VENV, default .venv-trainers in the repository
#
# Idempotent: a venv that already holds both releases is left as it is (a second).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${TOOLKIT_TRAINERS_VENV:-$ROOT/.venv-trainers}
PYTHON=${PYTHON:-python3}
SPECFORGE_VERSION=0.2.0
SPECULATORS_VERSION=0.9.0
T0=$SECONDS

if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("specforge"), m.version("speculators"))' \
    2>/dev/null || true)
if [[ $have != "$SPECFORGE_VERSION $SPECULATORS_VERSION" ]]; then
    "${PIP[@]}" -r "$HERE/requirements.txt"
    # --no-deps: SpecForge pins sglang and a CUDA torch, speculators wants torchaudio/torchvision and a connector
    # package; their data code needs none of them (requirements.txt holds what it does need).
    "${PIP[@]}" --no-deps "specforge==$SPECFORGE_VERSION" "speculators==$SPECULATORS_VERSION"
fi
echo "[trainers/install] $VENV: specforge $SPECFORGE_VERSION, speculators $SPECULATORS_VERSION ready in $((SECONDS - T0)) s" >&2
