"""A run nothing runs any more says so: Ctrl-C, a run of some shards only, a damaged done manifest or merged file.

`status` says "in progress" (exit 5) only while something runs the run: a Slurm job, or a live `toolkit run`,
`retry` or `worker` here (formats.progress.local_run). Ctrl-C exits 130, as the docs say.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobfiles import make_job
from runs import each_id_once
from toolkit.cli import main as cli_main
from toolkit.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_IN_PROGRESS, EXIT_INTERRUPTED, EXIT_OK
from toolkit.formats.progress import live_local_runs
from toolkit.formats.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def toolkit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(what, timeout: float = 60.0, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"not reached within {timeout} s")


@pytest.mark.slow
def test_ctrl_c_of_toolkit_run_exits_130_and_status_says_stopped_with_the_command_that_resumes(
    tmp_path, toy_tokenizer
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=12,
        shards=3,
        sampling={"max_new_tokens": 400},
        stub={"token_delay_s": 0.01, "fixed_output_tokens": 300},
    )
    rd = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "run", str(job)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                rd.log_file(0).exists()
                and "generating" in rd.log_file(0).read_text()
                or rd.log_file(1).exists()
                and "generating" in rd.log_file(1).read_text()
            )
        )
        live = live_local_runs(rd)
        assert [(r.pid, r.command, r.merges) for r in live] == [(proc.pid, "toolkit run", True)]
        st = toolkit("status", str(rd.root))
        assert st.returncode == EXIT_IN_PROGRESS, st.stdout  # something runs it
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert (
        f"stopped by SIGINT: what was done is kept; `toolkit retry {rd.shown}` resumes the run"
        in out
    )
    assert live_local_runs(rd) == [] and not any(rd.local_run_file("h", 0).parent.iterdir())
    st = toolkit("status", str(rd.root))
    last = st.stdout.strip().splitlines()[-1]
    assert st.returncode == EXIT_FAILED, st.stdout
    assert last.startswith("run: stopped: shards ") and "nothing runs them" in last
    assert f"`toolkit retry {rd.root}` resumes them here" in last
    watch = toolkit("status", str(rd.root), "--watch", "-i", "0.2", timeout=30)  # ends by itself
    assert watch.returncode == EXIT_FAILED
    # the command it gives resumes the run, and completes it
    again = toolkit("retry", str(rd.root), timeout=300)
    assert again.returncode == EXIT_OK, again.stderr[-2000:]
    assert toolkit("status", str(rd.root)).returncode == EXIT_OK


@pytest.mark.slow
def test_a_run_of_some_shards_without_merge_is_not_in_progress(tmp_path, toy_tokenizer, capsys):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2, sampling={"max_new_tokens": 32})
    assert cli_main(["run", str(job), "--shards", "0", "--no-merge"]) == EXIT_OK
    capsys.readouterr()
    rd = RunDir(tmp_path / "run")
    assert cli_main(["status", str(rd.root)]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "    1 not_started" in out
    assert (
        f"run: stopped: shard 1 not_started and nothing runs them: `toolkit retry {rd.shown}` resumes"
        in out
    )
    assert cli_main(["status", str(rd.root), "--watch", "-i", "0.1"]) == EXIT_FAILED  # ends
    follow = toolkit(
        "logs", str(rd.root), "1", "-f", timeout=30
    )  # ends too: nothing will write that log
    assert follow.returncode == 0
    assert (
        f"(shard 1 not started, and nothing runs it (`toolkit retry {rd.root}` runs it here): stopped following)"
        in follow.stderr
    )


def test_a_dead_local_process_is_not_taken_as_running(tmp_path, toy_tokenizer):
    """A process killed -9 leaves its file behind, but no lock: it runs nothing."""
    from toolkit.formats.progress import local_run

    rd = RunDir(tmp_path)
    code = (
        "import sys, os; from toolkit.formats.progress import local_run; from toolkit.formats.rundir import RunDir\n"
        f"cm = local_run(RunDir({str(tmp_path)!r}), [0, 1], 'toolkit run'); cm.__enter__()\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        assert [r.shards for r in live_local_runs(rd)] == [[0, 1]]
        p.kill()
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert len(list(rd.local_run_file("h", 0).parent.iterdir())) == 1  # left behind by kill -9
    assert live_local_runs(rd) == []
    with local_run(rd, [2], "toolkit worker"):  # this process: alive
        assert [r.shards for r in live_local_runs(rd)] == [[2]]
    assert live_local_runs(rd) == []


@pytest.fixture
def complete_run(tmp_path, toy_tokenizer, capsys):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2, sampling={"max_new_tokens": 32})
    assert cli_main(["run", str(job)]) == EXIT_OK
    rd = RunDir(tmp_path / "run")
    capsys.readouterr()
    assert cli_main(["status", str(rd.root)]) == EXIT_OK
    capsys.readouterr()
    return rd


@pytest.mark.slow
def test_status_agrees_with_merge_on_a_damaged_done_manifest(complete_run, capsys):
    rd = complete_run
    rd.done_file(1).write_text("{garbage")
    assert cli_main(["status", str(rd.root)]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "    1 unfinished" in out and f"`toolkit retry {rd.shown}` resumes them here" in out
    assert cli_main(["merge", str(rd.root)]) != EXIT_OK  # merge refuses it too
    capsys.readouterr()
    assert (
        cli_main(["retry", str(rd.root)]) == EXIT_OK
    )  # the advice works: the manifest is written again
    assert cli_main(["status", str(rd.root)]) == EXIT_OK


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_status_agrees_with_the_audit_on_a_damaged_merged_file(complete_run, capsys, damage):
    rd = complete_run
    data = bytearray(rd.merged_file.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-7:]
    rd.merged_file.write_bytes(bytes(data))
    assert cli_main(["status", str(rd.root)]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert (
        "the merged dataset is damaged (" in out
        and f"`toolkit merge {rd.shown}` makes it again" in out
    )
    assert cli_main(["merge", str(rd.root)]) == EXIT_OK
    assert cli_main(["status", str(rd.root)]) == EXIT_OK


@pytest.mark.slow
def test_logs_server_of_a_shard_served_by_another_shards_engine_shows_that_engines_log(
    complete_run, capsys
):
    """One worker claims both shards with one engine: the engine writes the log of the shard it was started for;
    the other shard's --server shows that log, and says so."""
    rd = complete_run
    own = [k for k in (0, 1) if rd.server_log_file(k).exists()]
    assert len(own) == 1
    first, other = own[0], 1 - own[0]
    assert cli_main(["logs", str(rd.root), str(other), "--server", "-n", "5"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert out.splitlines() == rd.server_log_file(first).read_text().splitlines()[-5:]
    assert f"(shard {other} was served by the engine worker 0 (pid " in err
    assert f"started for shard {first}: " in err and err.rstrip().endswith(
        f"{first:05d}.server.log)"
    )


# ---------------------------------------------------------------------------------------------------
# a damaged run.json or prompts.msgpack: one line, with the command that recovers; that command recovers
# ---------------------------------------------------------------------------------------------------
DAMAGES = {
    "garbage": lambda b: b"\x00garbage\xff",
    "empty": lambda b: b"",
    "truncated": lambda b: b[: len(b) // 2],
    "flipped": lambda b: b[:40] + b"\xc1" + b[41:],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["run.json", "prompts.msgpack"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_plan_file_is_one_line_and_planning_again_recovers_without_generating(
    complete_run, capsys, name, damage
):
    rd = complete_run
    job = rd.root.parent / "job.toml"
    shards = [rd.shard_file(k).read_bytes() for k in (0, 1)]
    path = rd.root / name
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    commands = [["merge"], ["export", "--format", "jsonl"], ["audit"]] + (
        [["status"], ["logs", "--failed"]] if name == "run.json" else []
    )
    for cmd in commands:
        code = cli_main([cmd[0], str(rd.root), *cmd[1:]])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("toolkit: error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (cmd, err)
        assert (
            f"{path} is damaged (" in lines[0]
            and "plan the job again into this folder to recover it: "
            "`toolkit run JOB` (or `toolkit submit JOB`)"
            in lines[0]
        ), lines[0]
    assert cli_main(["run", str(job)]) == EXIT_OK  # planned again into the same folder
    out, err = capsys.readouterr()
    assert "claims shard" not in err and "generating" not in err  # nothing generated again
    assert [rd.shard_file(k).read_bytes() for k in (0, 1)] == shards
    assert cli_main(["status", str(rd.root)]) == EXIT_OK


@pytest.mark.slow
def test_a_damaged_run_json_among_another_jobs_shards_is_not_planned_over(complete_run):
    rd = complete_run
    rd.plan_file.write_bytes(b"")
    from toolkit.formats.runplan import PlanError
    from toolkit.job.findrun import find_run
    from toolkit.job.prepare import prepare_run

    plan = prepare_run(rd.root.parent / "job.toml", dry_run=True, keep_learned=False).preflight.plan
    assert find_run(plan) == (
        rd.root,
        False,
    )  # its shard files are this job's: planned again into it
    plan.fingerprint = "0" * 16  # another job's plan
    with pytest.raises(PlanError, match="its shard files are not of this job"):
        find_run(plan)


def test_a_failed_merge_job_says_so_in_one_line_without_a_traceback(tmp_path, toy_tokenizer):
    """What Slurm runs as the merge job (cluster.tasks.MergeTask, under submitit, which prints the traceback of any
    Exception its callable raises): a refused merge ends the job with the merge's exit code and one line."""
    from jobfiles import prepared_run

    job = make_job(tmp_path, toy_tokenizer("kimi"), n=4, shards=2)
    rd, _ = prepared_run(job)  # planned, no shard run: the merge refuses it
    code = (
        "import submitit.core.submission as s, sys\n"
        "from toolkit.cluster.tasks import MergeTask\n"
        "try:\n"
        f"    MergeTask({str(rd.root)!r})()\n"
        "except Exception as e:  # as submitit.core.submission.process_job catches\n"
        "    raise\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == (
        f"merge job: `toolkit merge {rd.root}` exited 2 (the lines above say why); once that is "
        f"fixed, `toolkit merge {rd.root}` merges here, or `toolkit resubmit {rd.root}` on Slurm"
    )
    assert lines[-2].startswith("toolkit: error: ") and "shards are not done" in lines[-2]


# ---------------------------------------------------------------------------------------------------
# advice that works: a finished shard file damaged, another run's file, a damaged header
# ---------------------------------------------------------------------------------------------------
def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_damaged_finished_shard_file_is_told_a_command_that_finishes_it(
    complete_run, capsys, monkeypatch
):
    from toolkit.cluster import submit
    from toolkit.dataset.audit_report import read_report

    rd = complete_run
    _flip(rd.shard_file(0), rd.shard_file(0).stat().st_size // 2)
    before = rd.merged_file.read_bytes()
    capsys.readouterr()
    assert (
        cli_main(["merge", str(rd.root)]) == EXIT_BAD_INPUT
    )  # refused: its records would go missing
    err = capsys.readouterr().err
    assert (
        "nothing merged, the merged dataset is kept as it was" in err
        and f"`toolkit retry {rd.shown}`" in err
    )
    assert rd.merged_file.read_bytes() == before
    assert cli_main(["status", str(rd.root)]) == EXIT_FAILED
    assert "shard 0 changed since done" in capsys.readouterr().out
    # merged anyway, with no complete merged dataset in place: the audit gives the same advice
    rd.manifest_file.unlink()
    assert cli_main(["merge", str(rd.root), "--allow-incomplete"]) != EXIT_OK
    capsys.readouterr()
    checks = {c.name: c.message for c in read_report(rd).checks}
    for name in ("coverage", "damaged_frames"):
        assert f"`toolkit retry {rd.shown}`" in checks[name] and "resubmit" not in checks[name], (
            checks[name]
        )
    # on Slurm, `resubmit` takes that shard (its done manifest no longer matches the file)
    monkeypatch.setattr(submit, "live_jobs", lambda rd: {})
    monkeypatch.setattr(submit, "validate_resources", lambda plan, r: r)
    monkeypatch.setattr(submit, "_submit_arrays", lambda rd, plan, shards, o: ("submitted", shards))
    saved = rd.done_file(0).read_bytes()
    assert submit.resubmit(rd.root)[2] == [0]
    rd.done_file(0).write_bytes(saved)
    # here, the advice: `toolkit retry RUN` keeps the intact frames, generates the rest, merges
    assert cli_main(["retry", str(rd.root)]) == EXIT_OK
    assert "retrying in 1 shard: 0" in capsys.readouterr().out
    assert cli_main(["status", str(rd.root)]) == EXIT_OK
    # nothing left to retry: it says so, and which id list a retry by ids would take
    rd.missing_file.write_text("x\n")
    assert cli_main(["retry", str(rd.root)]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"--ids {rd.missing_file}` generates the ids the merge found missing again" in out
    assert "failed_ids.txt" not in out  # none failed: that list is empty


@pytest.mark.slow
def test_a_shard_file_of_another_run_is_told_to_be_moved_aside_and_that_works(
    complete_run, tmp_path, toy_tokenizer, capsys, caplog
):
    rd = complete_run
    other = make_job(
        tmp_path / "other",
        toy_tokenizer("kimi"),
        n=8,
        shards=2,
        name="other",
        sampling={"max_new_tokens": 40},
    )
    assert cli_main(["run", str(other)]) == EXIT_OK
    rd.shard_file(1).write_bytes((tmp_path / "other" / "run" / "shards" / "00001.zst").read_bytes())
    capsys.readouterr()
    assert cli_main(["retry", str(rd.root)]) == 1
    err = caplog.text
    move = f"mv {rd.shard_file(1)} {rd.shard_file(1)}.other-run"
    assert f"move it aside ({move}) and run the shard again" in err and "--new-run" not in err
    rd.shard_file(1).rename(f"{rd.shard_file(1)}.other-run")
    assert cli_main(["retry", str(rd.root)]) == EXIT_OK
    assert cli_main(["status", str(rd.root)]) == EXIT_OK


@pytest.mark.slow
@pytest.mark.parametrize("at", [2, 20])  # the header's magic, its fingerprint
def test_a_damaged_header_merge_keeps_what_the_workers_salvage_keeps(
    complete_run, capsys, caplog, at
):
    from toolkit.dataset.merge_manifest import load_manifest

    rd = complete_run
    _flip(rd.shard_file(0), at)
    assert (
        cli_main(["merge", str(rd.root), "--no-audit"]) == EXIT_BAD_INPUT
    )  # a finished shard's file changed
    rd.manifest_file.unlink()  # merged anyway, with no complete merged dataset in place
    assert (
        cli_main(["merge", str(rd.root), "--no-audit", "--allow-incomplete"]) == EXIT_FAILED
    )  # the header is said
    m = load_manifest(rd)
    assert m.missing == 0 and m.records == m.planned and [p.offset for p in m.corrupt] == [0]
    merged_before = m.shards[0]
    capsys.readouterr()
    assert (
        cli_main(["retry", str(rd.root)]) == EXIT_OK
    )  # the worker salvages the file: every frame after the header
    err = caplog.text
    assert "keeping its" in err and "damaged header" in err
    m = load_manifest(rd)
    assert (m.missing, m.corrupt, m.shards[0].records) == (0, [], merged_before.records)


@pytest.mark.slow
def test_after_a_full_disk_failed_the_run_status_is_not_in_progress(
    tmp_path, toy_tokenizer, monkeypatch, capsys
):
    """The disk full from the start: neither a shard file nor a progress file can be written; `toolkit run` fails,
    and status says what to run once there is space, with an exit code that is not "in progress"."""
    import errno
    import os

    import toolkit.formats.progress as progress
    import toolkit.formats.shardfile as sf

    job = make_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2, sampling={"max_new_tokens": 32})
    from jobfiles import prepared_run

    rd, _ = prepared_run(job)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_write, real_atomic = sf.os.write, progress.atomic_write
    monkeypatch.setattr(sf.os, "write", full)
    monkeypatch.setattr(progress, "atomic_write", full)
    assert cli_main(["run", str(job)]) == EXIT_FAILED
    monkeypatch.setattr(sf.os, "write", real_write)
    monkeypatch.setattr(progress, "atomic_write", real_atomic)
    capsys.readouterr()
    code = cli_main(["status", str(rd.root)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == EXIT_FAILED and code != EXIT_IN_PROGRESS, last
    assert f"nothing runs them: `toolkit retry {rd.shown}` resumes them here" in last
    assert cli_main(["retry", str(rd.root)]) == EXIT_OK  # space again: the advice finishes the run
    assert cli_main(["status", str(rd.root)]) == EXIT_OK


# ---------------------------------------------------------------------------------------------------
# one resume command: every message that offers one says the same, and that command, run as printed, resumes
# ---------------------------------------------------------------------------------------------------
def backticked(text: str, after: str) -> str:
    """The first `command` quoted in backticks on the line of `text` holding `after`."""
    line = next(line for line in text.splitlines() if after in line)
    return re.search(r"`(toolkit [^`]+)`", line[line.index(after) :]).group(1)


def run_as_printed(command: str) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "toolkit"
    return toolkit(*argv[1:], timeout=300)


def start_and_wait(job: Path, rd: RunDir) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "run", str(job)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: any(
            rd.log_file(k).exists() and "generating" in rd.log_file(k).read_text() for k in (0, 1)
        )
    )
    wait_for(
        lambda: any(rd.shard_file(k).exists() and rd.shard_file(k).stat().st_size for k in (0, 1))
    )
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_every_resume_hint_is_one_command_and_it_resumes_the_stopped_run(
    tmp_path, toy_tokenizer, sig
):
    n = 12
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=3,
        sampling={"max_new_tokens": 400},
        stub={"token_delay_s": 0.01, "fixed_output_tokens": 300},
    )
    rd = RunDir(tmp_path / "run")
    proc = start_and_wait(job, rd)
    try:
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    resume = f"toolkit retry {rd.shown}"
    hints = []
    if sig != "SIGKILL":  # the run's own last line (a process killed -9 says nothing)
        assert proc.returncode != EXIT_OK, err[-2000:]
        hints.append(backticked(out, f"stopped by {sig}: what was done is kept; "))
    st = toolkit("status", str(rd.root))
    assert st.returncode == EXIT_FAILED, st.stdout
    last = st.stdout.strip().splitlines()[-1]
    if sig != "SIGKILL":
        hints.append(backticked(last, "nothing runs them: "))
    else:  # the shard its worker was generating is dead: logs --failed says how to resume it
        failed = toolkit("logs", str(rd.root), "--failed")
        assert "dead" in st.stdout and failed.returncode != EXIT_OK, failed.stdout
        hints.append(backticked(failed.stdout, "worker gone: "))
    assert hints and set(hints) == {resume}, hints
    again = run_as_printed(hints[0])
    assert again.returncode == EXIT_OK, again.stderr[-2000:]
    each_id_once(rd, 3, n)
    assert toolkit("status", str(rd.root)).returncode == EXIT_OK
