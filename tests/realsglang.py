"""The real-engine test tier: real SGLang 0.5.23 (from PyPI) serving a tiny random model on the CPU.

`tests/real_sglang/install.sh` (run by `make install-test`) makes the virtualenv: SGLang, its CPU runtime and the
toolkit. The tests run the toolkit's commands with that venv's Python, so `kind = "sglang"` starts SGLang through
the toolkit's own launch path (`python -m sglang.launch_server` with the job's flags), exactly as on a GPU node;
only the device differs: `--device cpu` with SGLANG_USE_CPU_ENGINE=1, a KV pool sized for a test machine, and the
test stand-in for sgl-kernel's two CPU bookkeeping ops first on the server's PYTHONPATH.

The model is built at test time from the demo tokenizer (4,000 ids; no hub): its outputs are noise, and it never
closes `</think>`, so whole-job tests relax the audit's content limits. What it proves is the protocol.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobfiles import make_job

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CPU_OPS = HERE / "real_sglang" / "cpu_ops"
TINY_MODEL = HERE / "real_sglang" / "tiny_model.py"
DEMO_TOKENIZER = ROOT / "jobs" / "demo" / "tokenizer"
VERSION = "0.5.23"

# What a CPU needs, on top of the toolkit's own flags: the device, a KV pool sized for a test machine (without it
# the pool takes ~70 % of RAM), and a scheduler that sleeps when idle (else it spins a core).
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "65536", "--sleep-on-idle"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_OPS)}

# Audit limits a random model can meet: it never writes `</think>`, so every output is reasoning to the end.
RANDOM_MODEL_AUDIT = {
    "min_think_end_share": 0.0,
    "max_empty_content_share": 1.0,
    "max_length_share": 1.0,
    "max_stop_without_think_end_share": 1.0,
    "max_empty_reasoning_share": 1.0,
    "max_double_think_start_share": 1.0,
}


# The probe servers (conformance suite): at most two requests run at once, so a third waits in the queue.
PROBE_ARGS = ["--max-running-requests", "2"]
# The stub beside them: the same context length as the tiny model (8,192) and a speed of the order of a real
# server's on this CPU, so that requests are still in flight when a probe aborts them.
STUB_PROBE = {"context_length": 8192, "token_delay_s": 0.004}


def stub_job(tmp: Path, model: Path, **tables: dict[str, Any]) -> Path:
    """The stub engine with the probe settings (realsglang.PROBE_ARGS, STUB_PROBE) on `model`'s tokenizer."""
    engine = {
        "kind": "stub",
        "extra_args": list(PROBE_ARGS),
        "ready_timeout_s": 60,
        **tables.pop("engine", {}),
    }
    return make_job(
        tmp, model, n=4, engine=engine, stub={**STUB_PROBE, **tables.pop("stub", {})}, **tables
    )


def python() -> Path:
    """The Python of the SGLang venv ($TOOLKIT_SGLANG_VENV, default .venv-sglang in the repository)."""
    venv = Path(os.environ.get("TOOLKIT_SGLANG_VENV") or ROOT / ".venv-sglang")
    return venv / "bin" / "python"


def missing() -> str | None:
    """Why the tier cannot run here, or None."""
    py = python()
    if not py.exists():
        return f"no SGLang test environment at {py.parent.parent}: run tests/real_sglang/install.sh (make test does)"
    r = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True,
        text=True,
    )
    if r.stdout.strip() != VERSION:
        return f"{py} has sglang {r.stdout.strip() or 'missing'}, the tier wants {VERSION}: run tests/real_sglang/install.sh"
    return None


def build_model(out: Path) -> Path:
    """The tiny model (random, seed 0) with the demo tokenizer, written to `out` by the venv's torch."""
    subprocess.run(
        [str(python()), str(TINY_MODEL), str(DEMO_TOKENIZER), str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def sglang_job(
    tmp: Path,
    model: Path,
    *,
    n: int = 8,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    **tables: dict[str, Any],
) -> Path:
    """A job whose engine is real SGLang on the CPU (kind = "sglang"), model and tokenizer `model`."""
    engine = {
        "kind": "sglang",
        "extra_args": CPU_ARGS + list(extra_args or []),
        "env": {**CPU_ENV, **(env or {})},
        "ready_timeout_s": 300,
        "max_restarts": 2,
        "shutdown_timeout_s": 20,
        "hang_timeout_s": 60,
    }
    engine.update(tables.pop("engine", {}))
    audit = {**RANDOM_MODEL_AUDIT, **tables.pop("audit", {})}
    sampling = {"max_new_tokens": 48, "temperature": 0.0, **tables.pop("sampling", {})}
    client = {"concurrency": 8, "request_timeout_s": 120, **tables.pop("client", {})}
    return make_job(
        tmp, model, n=n, engine=engine, audit=audit, sampling=sampling, client=client, **tables
    )


def toolkit(
    *args: str, check: bool = True, timeout: float = 900, **kw
) -> subprocess.CompletedProcess:
    """`toolkit ARGS` run by the SGLang venv's Python (a GPU node's interpreter)."""
    r = subprocess.run(
        [str(python()), "-m", "toolkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        **kw,
    )
    if check and r.returncode != 0:
        raise AssertionError(
            f"toolkit {' '.join(args)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        )
    return r


def login_python() -> str:
    """The test environment's own Python: a login node's, without SGLang."""
    return sys.executable


SERVE = HERE / "real_sglang" / "serve.py"


class Served:
    """An engine started by tests/real_sglang/serve.py: its url and key, and how its stop went."""

    def __init__(self, job: Path, python: str, log: Path):
        self.proc = subprocess.Popen(
            [python, str(SERVE), str(job), str(log)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])},
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise AssertionError(
                f"the engine of {job} did not become ready; its log:\n{_tail(log)}"
            )
        info = json.loads(line)
        self.url, self.api_key, self.pid, self.version = (
            info["url"],
            info["api_key"],
            info["pid"],
            info["version"],
        )
        self.ready_s = info["ready_s"]
        self.log = log
        self.stopped: dict | None = None

    def stop(self) -> dict:
        """Stop the engine as a worker does: {"stop_s", "exit_code"}."""
        if self.stopped is None:
            self.proc.stdin.close()
            self.stopped = json.loads(self.proc.stdout.readline() or "{}")
            self.proc.wait(120)
        return self.stopped


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
