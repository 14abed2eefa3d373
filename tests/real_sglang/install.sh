#!/usr/bin/env bash
# The real-engine test tier's environment: a virtualenv with SGLang 0.5.23 from PyPI and the toolkit (editable),
# kept apart from the test environment (which, like a login node, has no SGLang). It runs on a CPU-only machine:
# SGLang without its GPU-only requirements (tests/real_sglang/requirements.txt) plus the test stand-in for the
# two sgl-kernel CPU ops (tests/real_sglang/cpu_ops), which the tests put on the server's PYTHONPATH. It is the
# GPU nodes' own environment script (scripts/node-env.sh) with --cpu.
#
#   tests/real_sglang/install.sh          # $TOOLKIT_SGLANG_VENV, default .venv-sglang in the repository
#
# Idempotent: a venv that already holds sglang 0.5.23 only gets the toolkit reinstalled (seconds).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
exec bash "$ROOT/scripts/node-env.sh" "${TOOLKIT_SGLANG_VENV:-$ROOT/.venv-sglang}" --cpu --python "${PYTHON:-python3}"
