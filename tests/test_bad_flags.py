"""One line, exit 2, nothing written, for every bad flag of `run`, `worker`, `logs` and `export`, through the real
command line (`python -m toolkit`): no traceback, no run directory made before the refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run
from toolkit.errors import EXIT_BAD_INPUT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def toolkit(cwd: Path, *args: str, gpus: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def refused(r: subprocess.CompletedProcess) -> str:
    """The one line of a refusal (exit 2, nothing else on stderr, no traceback)."""
    lines = r.stderr.splitlines()
    assert r.returncode == EXIT_BAD_INPUT and len(lines) == 1 and "Traceback" not in r.stderr, (
        r.stderr
    )
    assert lines[0].startswith("toolkit: error: ")
    return lines[0]


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize(
    "args, job_tables, gpus, says",
    [
        (["--shards", "7"], {}, None, "--shards 7: no such shard; the run has 2 shards, 0..1"),
        (
            ["--shards", "0", "-1"],
            {},
            None,
            "--shards -1: give at least 0 (shard indices count from 0)",
        ),
        (["--parallel", "0"], {}, None, "--parallel 0: give at least 1"),
        (
            [],
            {"stub": {"extra_args": ["--no-such-flag"]}},
            None,
            "[engine.stub] the stub refuses its arguments: unrecognized arguments: --no-such-flag",
        ),
        (
            [],
            {"stub": {"fail_5xx": "three"}},
            None,
            "[engine.stub] the stub refuses its arguments: --fail-5xx wants START:COUNT (two integers), got 'three'",
        ),
        # workers x GPUs per engine that leave visible GPUs idle
        (
            ["--parallel", "1"],
            {},
            "0,1,2,3",
            "1 worker of 1 GPU per engine uses 1 of the 4 visible GPUs (0,1,2,3): GPUs 1,2,3 would sit idle for the whole "
            "run; give --parallel 4, or CUDA_VISIBLE_DEVICES=0 to name only the GPUs to use",
        ),
        (
            [],
            {"engine": {"tp_size": 3}},
            "0,1,2,3,4,5,6,7",
            "2 workers of 3 GPUs per engine use 6 of the 8 visible GPUs (0,1,2,3,4,5,6,7): GPUs 6,7 would sit idle for the "
            "whole run; give CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 to name only the GPUs to use",
        ),
    ],
    ids=[
        "shards-7",
        "shards-minus-1",
        "parallel-0",
        "stub-flag",
        "stub-fail-5xx",
        "parallel-idle",
        "tp3-on-8",
    ],
)
def test_a_bad_flag_of_run_is_one_line_exit_2_and_no_run_directory(
    tmp_path, kimi, args, job_tables, gpus, says
):
    job = make_job(tmp_path, kimi, n=4, shards=2, **job_tables)
    r = toolkit(tmp_path, "run", str(job), *args, "--quiet", gpus=gpus)
    assert says in refused(r)
    assert not (tmp_path / "run").exists(), "refused before the run directory is written"


def test_a_good_stub_flag_still_runs(tmp_path, kimi):
    """The stub's own check takes what the stub takes: a run with a stub flag of its own is not refused."""
    job = make_job(
        tmp_path,
        kimi,
        n=4,
        shards=1,
        stub={"extra_args": ["--tool-call-fraction", "0"], "fail_5xx": "2:1"},
    )
    r = toolkit(tmp_path, "run", str(job), "--quiet")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["logs", "{run}", "0", "-n", "-5"], "-n -5: give at least 0 (lines of tail to print)"),
        (["worker", "{run}", "7"], "shard 7: no such shard; the run has 2 shards, 0..1"),
        (
            ["worker", "{run}", "--claim", "0", "7"],
            "--claim 7: no such shard; the run has 2 shards, 0..1",
        ),
        (["worker", "{run}", "--claim", "-1"], "--claim -1: no such shard"),
        (["worker", "{run}", "--claim", "0", "--workers", "0"], "--workers 0: give at least 1"),
        (
            ["worker", "{run}", "--claim", "0", "--worker", "2", "--workers", "2"],
            "--worker 2: give 0..1",
        ),
        (["export", "{run}", "--sample", "-1"], "--sample -1: give at least 0"),
        (["export", "{run}", "--turn", "-2"], "--turn -2: give at least 0"),
    ],
    ids=[
        "logs-n",
        "worker-shard",
        "worker-claim",
        "worker-claim-minus",
        "workers-0",
        "worker-past",
        "export-sample",
        "export-turn",
    ],
)
def test_a_bad_flag_on_a_run_is_one_line_exit_2_and_changes_nothing(tmp_path, kimi, args, says):
    rd, _ = prepared_run(make_job(tmp_path, kimi, n=4, shards=2))
    before = files(rd.root)
    r = toolkit(tmp_path, *(a.format(run=rd.root) for a in args))
    assert says in refused(r)
    assert files(rd.root) == before
