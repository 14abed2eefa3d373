"""The real engine: SGLang's server, launched on the node's GPUs from the job spec (never a shell string)."""

from __future__ import annotations

import sys

from .base import LOOPBACK, Engine, free_port

__all__ = ["SGLangEngine", "MANAGED_FLAGS", "check_extra_args"]

# Flags the toolkit sets itself; a job's extra_args must not fight over them.
MANAGED_FLAGS = (
    "--model-path", "--model", "--tokenizer-path", "--tp-size", "--tensor-parallel-size", "--tp",
    "--dp-size", "--data-parallel-size", "--dp", "--host", "--port", "--api-key", "--trust-remote-code",
    "--nccl-port",
)


def check_extra_args(extra: list[str]) -> list[str]:
    """Problems with a job's extra server args (empty when fine)."""
    problems = []
    for a in extra:
        flag = a.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(f"{flag} is set by the toolkit from the spec (model, engine.tp_size/dp_size, ...); remove it from extra_args")
        if flag == "--skip-server-warmup":
            problems.append("--skip-server-warmup marks the server ready before warm-up: readiness would be a false positive")
    return problems


def substitute(template: list[str], **values: str) -> list[str]:
    """Fill `{host}` `{port}` `{model_path}` `{api_key}` placeholders of a custom launch argv."""
    out = []
    for a in template:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


class SGLangEngine(Engine):
    kind = "sglang"

    def argv(self) -> list[str]:
        m, e = self.spec.model, self.engine
        if e.command:
            return substitute(e.command, host=LOOPBACK, port=str(self.port), model_path=m.path, api_key=self.api_key or "")
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", m.path]
        if m.tokenizer_path:
            argv += ["--tokenizer-path", m.tokenizer_path]
        argv += [
            "--tp-size", str(e.tp_size), "--dp-size", str(e.dp_size),
            "--host", LOOPBACK, "--port", str(self.port), "--api-key", self.api_key or "",
            # Several tasks may share a node: give each its own NCCL port too.
            "--nccl-port", str(free_port()),
        ]
        if m.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv + list(e.extra_args)
