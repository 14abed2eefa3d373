"""The `stub` engine: the toolkit's stand-in for SGLang's protocol (toolkit.stub), launched like a
server.

It is a test double of the protocol, not a model: outputs are synthetic, built from the job's
tokenizer. It runs the demo job and the test suite on CPU nodes, and every log line it writes says
what it is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from toolkit.engines.base import LOOPBACK, Engine, EngineError, free_port

__all__ = ["StubEngine", "start_standalone", "stub_args_problem"]

CHECK_ARGS_S = 60.0  # the stub parsing its command line (`--check-args`) takes about a second
_FAIL_5XX = re.compile(r"\d+:\d+")


class StubEngine(Engine):
    kind = "stub"
    is_model = False

    def __init__(self, *args, shard: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.shard = shard

    def argv(self) -> list[str]:
        m, s = self.spec.model, self.engine.stub
        argv = [
            sys.executable,
            "-m",
            "toolkit.stub",
            "--model-path",
            m.path,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--think-start",
            m.think_start,
            "--think-end",
            m.think_end,
            "--context-length",
            str(s.context_length),
            "--version",
            s.version,
            "--tp-size",
            str(self.engine.tp_size),
            "--dp-size",
            str(self.engine.dp_size),
            # SGLang polls every 5 s while draining; the stub need not make tests wait
            "--drain-poll",
            "0.2",
        ]
        # the key, in the file SGLang's --config reads (toolkit.engines.keys)
        if self.key_files is not None:
            argv += ["--config", str(self.key_files.config())]
        if m.tokenizer_path:
            argv += ["--tokenizer-path", m.tokenizer_path]
        if m.trust_remote_code:
            argv.append("--trust-remote-code")
        for flag, value in (
            ("--load-delay", s.load_delay_s),
            ("--warmup-delay", s.warmup_delay_s),
            ("--token-delay", s.token_delay_s),
            ("--fixed-output-tokens", s.fixed_output_tokens),
            ("--crash-after", s.crash_after),
            ("--hang-after", s.hang_after),
            ("--fail-5xx", s.fail_5xx),
            ("--exit-at-start", s.exit_at_start),
            ("--nan-every", s.nan_every),
            ("--degenerate-fraction", s.degenerate_fraction),
            ("--output-scale", s.output_scale or self._segmented_scale()),
        ):
            if value:
                argv += [flag, str(value)]
        if s.exit_at_start_if_exists:
            argv += [
                "--exit-at-start-if-exists",
                s.exit_at_start_if_exists.replace("{shard}", str(self.shard)),
            ]
        for flag, on in (
            ("--hang", s.hang),
            ("--ignore-sigterm", s.ignore_sigterm),
            ("--no-think-end", s.no_think_end),
            ("--double-think-start", s.double_think_start),
            ("--identical-samples", s.identical_samples),
        ):
            if on:
                argv.append(flag)
        return argv + list(s.extra_args) + list(self.engine.extra_args)

    def _segmented_scale(self) -> int | None:
        """The largest max_new_tokens of the job when [client] loop_stop asks for some of its
        outputs in segments: the stub's lengths must not follow each segment's max_new_tokens (None:
        no output is segmented)."""
        c = self.spec.client
        tops = [
            int(self.spec.sampling_for(d.name).get("max_new_tokens") or 0)
            for d in self.spec.datasets
        ]
        top = max(tops, default=0)
        return top if c.loop_stop and top > c.segment_tokens else None


def stub_args_problem(spec) -> str | None:
    """Why the stub would refuse the command line the job starts it with (None: it takes it), asked
    of the stub itself (`--check-args`: it parses its arguments and exits), before a run is written.
    Asked only where the job gives the stub a string it parses: [engine.stub] extra_args, a
    fail_5xx not of the form START:COUNT (the rest is typed by the spec, [engine] extra_args are
    judged by SGLang's flags)."""
    s = spec.engine.stub
    if not s.extra_args and (s.fail_5xx is None or _FAIL_5XX.fullmatch(s.fail_5xx)):
        return None
    argv = StubEngine(spec, Path(os.devnull), probe_ids=[]).argv() + ["--check-args"]
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=CHECK_ARGS_S,
            stdin=subprocess.DEVNULL,
            errors="replace",
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the stub did not say whether it takes its arguments: {e}"
    if out.returncode == 0:
        return None
    said = [line for line in out.stderr.splitlines() if line.strip()]
    why = said[-1].split(" error: ", 1)[-1] if said else f"exit {out.returncode}"
    return (
        f"[engine.stub] the stub refuses its arguments: {why}; fix [engine.stub] extra_args or "
        "the key named (python -m toolkit.stub --help lists what it takes)"
    )


def start_standalone(
    model_path: str, *args: str, timeout_s: float = 60.0
) -> tuple[subprocess.Popen, str]:
    """Start a stub server on its own, in its own session, and wait until /health_generate answers
    200.

    For what drives a stub from outside a worker (benchmarks, tests of `external` engines): the
    caller owns the process and kills its group. `args` are toolkit.stub flags (e.g.
    "--fixed-output-tokens", "4096").
    """
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolkit.stub",
            "--model-path",
            str(model_path),
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://{LOOPBACK}:{port}"
    # loopback never goes through a proxy
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with opener.open(url + "/health_generate", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise EngineError(
        f"the stub server at {url} did not become ready within {timeout_s:g} s "
        f"(exit code {proc.poll()})"
    )
