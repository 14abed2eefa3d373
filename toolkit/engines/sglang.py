"""The real engine: SGLang's server, launched on the node's GPUs from the job spec (never a shell string)."""

from __future__ import annotations

import logging
import subprocess
import sys

from .base import LOOPBACK, Engine, EngineError

__all__ = ["SGLangEngine", "MANAGED", "check_extra_args"]

log = logging.getLogger(__name__)

# What the toolkit sets itself, by SGLang's destination (so aliases and abbreviations are covered too:
# `--model`, `--tensor-parallel-size`, `--tp`, `--tp-s`, `--api-k` ...), and where a job sets it instead.
MANAGED = {
    "model_path": "[model] path", "tokenizer_path": "[model] tokenizer_path", "tp_size": "[engine] tp_size",
    "dp_size": "[engine] dp_size", "trust_remote_code": "[model] trust_remote_code",
    "host": "nothing: the server listens on 127.0.0.1", "port": "nothing: each start picks a free port",
    "api_key": "nothing: each start draws a random key",
    # 0.5.9 names the destinations after the long spellings
    "tensor_parallel_size": "[engine] tp_size", "data_parallel_size": "[engine] dp_size",
}
# The stub is told these from [engine.stub] as well.
STUB_MANAGED = {"context_length": "[engine.stub] context_length"}
REFUSED = {
    "skip_server_warmup": "marks the server ready before warm-up: readiness would be a false positive",
    "help": "prints SGLang's help and exits: the server would never start",
    "config": "reads more flags from a YAML file the toolkit cannot check (and that could set the port, the "
              "API key or the model); put those flags in extra_args instead",
}


def check_extra_args(extra: list[str], *, version: str | None = None, dp_size: int = 1,
                     kind: str = "sglang") -> list[str]:
    """Problems with a job's extra server args (empty when fine), judged as SGLang `version`'s parser would
    judge them (default: the newest release in sglang_flags.json), then against what the toolkit manages."""
    from .sglang_flags import flag_set

    flags = flag_set(version)
    parsed = flags.parse(list(extra))
    problems = list(parsed.errors)
    managed = {**MANAGED, **(STUB_MANAGED if kind == "stub" else {})}
    for item in parsed.items:
        given = item.token.split("=", 1)[0]
        named = given + (f" (SGLang reads it as {item.option})" if item.abbreviated else "")
        dest = item.flag.dest
        if dest in managed:
            problems.append(f"{named} is set by the toolkit; remove it from extra_args and set {managed[dest]}")
        elif dest in REFUSED:
            problems.append(f"{named} {REFUSED[dest]}; remove it from extra_args")
        elif dest == "nccl_port" and dp_size > 1:
            problems.append(
                f"{named} with dp_size = {dp_size}: every data-parallel replica of SGLang binds this one port, so "
                "the second replica fails to start; remove it (SGLang picks a free port for each replica)")
        elif item.abbreviated:
            log.warning("[engine] extra_args: %s abbreviates %s; SGLang accepts it today, but spell it out: a new "
                        "flag with the same prefix would make it ambiguous", given, item.option)
        if item.flag.deprecated and item.flag.action != "DeprecatedError":
            log.warning("[engine] extra_args: %s is deprecated in SGLang %s (%s)", given, flags.version,
                        item.flag.deprecated)
    return problems


def substitute(template: list[str], **values: str) -> list[str]:
    """Fill `{host}` `{port}` `{model_path}` `{api_key}` placeholders of a custom launch argv."""
    out = []
    for a in template:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


# Run with the engine's own interpreter and environment, before the weights load: SGLang's parser judges the
# command line. A subprocess, so that the worker never imports sglang (and torch) itself.
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


def check_argv_with_sglang(args: list[str], env: dict[str, str], python: str = sys.executable,
                           secret: str | None = None) -> None:
    """Parse `args` (the flags after `-m sglang.launch_server`) with SGLang's own parser, where sglang is
    installed; a refusal raises EngineError with argparse's message. Anything else (no sglang, an import
    that fails, a timeout) is logged and left to the launch itself."""
    try:
        r = subprocess.run([python, "-c", _ARGV_CHECK, *args], env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=ARGV_CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not check the command line with SGLang's parser (%s); launching anyway", e)
        return
    if r.returncode == 0:
        log.info("SGLang's parser accepts the command line" if "no sglang here" not in r.stdout
                 else "sglang is not importable here: the command line is not checked by its parser")
        return
    lines = [x.replace(secret, "***") if secret else x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if "error:" in x]
    if r.returncode == 2 and errors:
        raise EngineError(f"SGLang's parser refuses the server command line: {errors[-1].strip()} — fix "
                          "[engine] extra_args (nothing was launched)")
    log.warning("checking the command line with SGLang's parser failed (exit %s): %s; launching anyway",
                r.returncode, " | ".join(lines[-3:]) or "no output")


class SGLangEngine(Engine):
    kind = "sglang"
    argv_checked = False

    def before_launch(self, argv: list[str], env: dict[str, str]) -> None:
        """Once per engine: SGLang's own parser must accept the flags before a launch loads any weights."""
        if self.engine.command or self.argv_checked:
            return
        check_argv_with_sglang(argv[3:], env, python=argv[0], secret=self.api_key)
        self.argv_checked = True

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
            # No --nccl-port: SGLang picks a free one below the ephemeral range itself, one per data-parallel
            # replica (a pinned port is bound once per replica, so dp_size > 1 could not start).
        ]
        if m.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv + list(e.extra_args)
