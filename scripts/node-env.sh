#!/usr/bin/env bash
# The GPU nodes' environment: SGLang and this toolkit in one virtualenv, on a filesystem every node sees (your
# home or a project directory, like the clone, the model, the prompts and the run directory). Build it once, on a
# GPU node (the same OS, CUDA driver and Python as the nodes the jobs run on):
#
#   srun -p gpu --gpus-per-node=1 -c 8 bash scripts/node-env.sh ~/venvs/sglang
#   toolkit submit jobs/kimi-k2.5.toml -p gpu --setup 'source ~/venvs/sglang/bin/activate'
#
#   scripts/node-env.sh VENV [--cpu] [--python PYTHON]
#
# It installs SGLang (the release the toolkit's flag checks know: toolkit/engines/sglang_contract) with its own
# requirements (CUDA torch, sglang-kernel, flashinfer: several GB), then the toolkit from this clone (editable, so
# a `git pull` reaches the nodes), and checks that both import. --cpu leaves SGLang's GPU-only requirements out
# (tests/real_sglang/requirements.txt: what its server imports to serve a small model on a CPU) — the test tier's
# environment. Idempotent: a venv that already holds that SGLang only gets the toolkit installed again (seconds).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
SGLANG_VERSION=0.5.23
usage() { echo "usage: $0 VENV [--cpu] [--python PYTHON]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
VENV=$1; shift
CPU=0
PYTHON=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
    case $1 in
        --cpu) CPU=1 ;;
        --python) [[ $# -ge 2 ]] || usage; PYTHON=$2; shift ;;
        *) usage ;;
    esac
    shift
done
T0=$SECONDS
say() { echo "[node-env] $*" >&2; }

if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -m venv "$VENV" || { say "$PYTHON cannot make a virtualenv (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [[ $have != "$SGLANG_VERSION" ]]; then
    if [[ $CPU == 1 ]]; then
        # --no-deps: sglang's own requirements include GPU-only packages (flashinfer, sglang-kernel, ...) that a
        # CPU machine cannot use; requirements.txt lists what its server really imports here.
        "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
        "${PIP[@]}" -r "$ROOT/tests/real_sglang/requirements.txt"
    else
        "${PIP[@]}" "sglang==$SGLANG_VERSION"
    fi
fi
"${PIP[@]}" -e "$ROOT"
"$VENV/bin/python" -c 'import sglang, toolkit; assert sglang.__version__ == "'"$SGLANG_VERSION"'", sglang.__version__' \
    || { say "$VENV: sglang or the toolkit does not import; see the lines above"; exit 1; }
say "$VENV: sglang $SGLANG_VERSION and the toolkit ready in $((SECONDS - T0)) s on $(hostname)"
say "submit with: --setup 'source $VENV/bin/activate'  (or [slurm] setup = [\"source $VENV/bin/activate\"])"
