"""The cost said before a submit (job.cost): output tokens, node-hours and wall time, in `check` and
`submit --dry-run`, from the job's [estimate] table or what a run of the job measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job

REPO = Path(__file__).resolve().parents[2]
EXTERNAL = {"kind": "external", "url": "http://127.0.0.1:9"}


def toolkit(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cost_lines(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("cost: "))
    return [lines[start]] + [x for x in lines[start + 1 : start + 3] if x.startswith("  ")]


def test_check_says_tokens_node_hours_and_wall_time(tmp_path, toy_tokenizer):
    # 12 prompts of at most 4096 tokens: 49,152 at most; 12,000 expected at 1,000 a prompt. At 1 token/s
    # that is 13.65 h (at most) and 3.33 h (expected) of generation on one engine, plus one 30-minute load.
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=12,
        engine=EXTERNAL,
        sampling={"max_new_tokens": 4096},
        estimate={"tokens_per_s": 1.0, "load_minutes": 30, "mean_output_tokens": 1000},
        slurm={"gpus_per_node": 0, "time": "48:00:00"},
    )
    r = toolkit("check", str(job))
    assert r.returncode == 0, r.stderr
    assert cost_lines(r.stdout) == [
        "cost: 12 outputs, at most 49.2k output tokens (every output to max_new_tokens) = 14.2 node-hours, "
        "14.2 h wall",
        "  expected 12.0k at 1,000 tokens per output ([estimate] mean_output_tokens) = 3.8 node-hours, 3.8 h wall",
        "  at 1 output tokens/s per engine ([estimate] tokens_per_s), 1 engine(s) of 1 node at once, 30 min per "
        "model load",
    ]
    assert "warning:" not in r.stdout


def test_without_figures_the_estimate_says_what_to_set(tmp_path, toy_tokenizer):
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), n=12, engine=EXTERNAL, slurm={"gpus_per_node": 0}
    )
    out = toolkit("check", str(job)).stdout
    assert "cost: 12 outputs, at most 3.1k output tokens (every output to max_new_tokens)\n" in out
    assert (
        "expected: unknown until the run measures its outputs; set [estimate] mean_output_tokens"
        in out
    )
    assert "node-hours: set [estimate] tokens_per_s" in out


def test_a_time_limit_shorter_than_a_load_and_a_shard_is_warned_in_the_dry_run(
    tmp_path, toy_tokenizer
):
    # one shard of 12 x 1,000 tokens at 2 tokens/s: 100 min; a 20-minute load; 60 min - 5 min before the stop
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=12,
        engine=EXTERNAL,
        sampling={"max_new_tokens": 4096},
        estimate={"tokens_per_s": 2.0, "load_minutes": 20, "mean_output_tokens": 1000},
        slurm={"gpus_per_node": 0, "time": "01:00:00", "signal_delay_s": 300},
    )
    env_path = tmp_path / "bin"
    env_path.mkdir()
    import os

    env = {
        **os.environ,
        "SLURM_CONF": str(tmp_path / "nothing"),
        "PATH": str(env_path),
        "PYTHONPATH": str(REPO),
    }
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert (
        "warning: a task's time limit leaves 55 min before its stop signal, less than a model load (20 min) "
        "plus one shard (100 min at 2 tokens/s)"
    ) in r.stdout
    assert "cost: 12 outputs, at most 49.2k output tokens" in r.stdout
    assert "  expected 12.0k at 1,000 tokens per output ([estimate] mean_output_tokens)" in r.stdout


@pytest.mark.slow
def test_a_run_of_the_job_gives_its_measured_mean(tmp_path, toy_tokenizer):
    import toolkit
    from toolkit.formats.records import OK
    from toolkit.formats.run import Run
    from toolkit.job import cost
    from toolkit.job.schema import JobSpec

    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=40,
        shards=2,
        sampling={"max_new_tokens": 64},
        estimate={"mean_output_tokens": 5},
    )
    assert toolkit_run(job).returncode == 0
    run = Run.open(tmp_path / "run", JobSpec)
    ok = [r for r in toolkit.read_run(tmp_path / "run") if r.status == OK]
    mean, n = cost.measured_mean(run.rd, run.plan)
    assert n == len(ok) == 40 and mean == pytest.approx(
        sum(len(r.output_ids) // 4 for r in ok) / len(ok)
    )
    c = cost.estimate(run.plan, engines=1, measured=(mean, n))
    assert c.mean_source == "measured: the mean of the 40 outputs this run has recorded"
    assert c.expected_tokens == round(40 * mean)


def toolkit_run(job: Path) -> subprocess.CompletedProcess:
    return toolkit("run", str(job), "--quiet")
