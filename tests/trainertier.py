"""The trainer test tier: the drafter trainers' own data code (SpecForge 0.2.0, speculators 0.9.0 from PyPI, on a CPU
build of torch) run on the toolkit's exports.

`tests/trainers/install.sh` (run by `make install-test`) makes the virtualenv; `tests/trainers/loaders.py` runs in it
and writes, row by row, the ids and the loss mask each trainer's loader produced. The tests compare them with the
ids the run stored and the mask the toolkit documents for that trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOADERS = HERE / "trainers" / "loaders.py"
VERSIONS = "0.2.0 0.9.0"  # specforge, speculators


def python() -> Path:
    """The Python of the trainer venv ($TOOLKIT_TRAINERS_VENV, default .venv-trainers in the repository)."""
    venv = Path(os.environ.get("TOOLKIT_TRAINERS_VENV") or ROOT / ".venv-trainers")
    return venv / "bin" / "python"


def missing() -> str | None:
    """Why the tier cannot run here, or None."""
    py = python()
    if not py.exists():
        return f"no trainer test environment at {py.parent.parent}: run tests/trainers/install.sh (make test does)"
    r = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.metadata as m; print(m.version('specforge'), "
            "m.version('speculators'))",
        ],
        capture_output=True,
        text=True,
    )
    if r.stdout.strip() != VERSIONS:
        return (
            f"{py} has specforge/speculators {r.stdout.strip() or 'missing'}, the tier wants {VERSIONS}: run "
            "tests/trainers/install.sh"
        )
    return None


def load(
    kind: str, tokenizer: Path, data: Path, out: Path, *extra: str, timeout: float = 300
) -> list[dict]:
    """The rows ({"input_ids", "loss_mask"}) the trainer's loader `kind` (see loaders.py) makes of `data`."""
    r = subprocess.run(
        [str(python()), str(LOADERS), kind, str(tokenizer), str(data), *extra, str(out)]
        if kind != "specforge-conversations"
        else [
            str(python()),
            str(LOADERS),
            kind,
            str(tokenizer),
            str(data),
            extra[0],
            str(out),
            *extra[1:],
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    if r.returncode != 0:
        raise AssertionError(
            f"loader {kind} on {data} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        )
    return json.loads(out.read_text())["rows"]


TRAIN_STEPS = HERE / "trainers" / "train_steps.py"


def train(
    tokens: Path, tokenizer: Path, work: Path, steps: int, port: int, timeout: float = 600
) -> list[dict]:
    """SpecForge's training loop run `steps` steps on the CPU from the rows of `tokens` (see train_steps.py); the
    metrics it logged per step ({"step", "loss", "grad_norm", ...})."""
    import ast
    import re

    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "MASTER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "2",
    }
    r = subprocess.run(
        [
            str(python()),
            str(TRAIN_STEPS),
            str(tokens),
            str(tokenizer),
            str(work),
            str(steps),
            str(work / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    if r.returncode != 0:
        raise AssertionError(
            f"SpecForge training exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        )
    metrics = []
    for m in re.finditer(r"^step (\d+): (\{.*\})$", r.stdout + r.stderr, re.M):
        metrics.append({"step": int(m.group(1)), **ast.literal_eval(m.group(2))})
    return metrics
