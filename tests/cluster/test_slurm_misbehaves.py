"""When Slurm misbehaves: sacct hung, slurmctld unreachable — status stays bounded, falls back to what squeue and
`scontrol show job` still know, says "unknown" instead of guessing, and exits 4. Fake Slurm commands earlier on
PATH stand in for the broken daemons (the real cluster is never touched)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import msgspec
import pytest

import runs
import toolkit.cluster.commands
from toolkit.cli import main as cli_main
from toolkit.cluster.jobs import ArrayJob, Jobs, Submission
from toolkit.cluster.status import RunStatus, run_status

HANG = "#!/bin/sh\nsleep 60\n"
SLURMCTLD_DOWN = (
    "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\n"
    "exit 1\n"
)
SLURMDBD_DOWN = (
    "#!/bin/sh\necho 'sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
    "connection to host:127.0.0.1:6819: Connection refused' >&2\n"
    "echo 'sacct: error: Problem talking to the database: Connection refused' >&2\nexit 1\n"
)


def fake_slurm(tmp: Path, monkeypatch, **scripts: str) -> None:
    """Put scripts named after Slurm's commands first on PATH (squeue=..., sacct=..., scontrol=...)."""
    bin_dir = tmp / "fake-slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setattr(toolkit.cluster.commands, "TIMEOUT_S", 1.0)


def prints(text: str) -> str:
    return "#!/bin/sh\ncat <<'EOF'\n" + text + "\nEOF\n"


@pytest.fixture
def submitted_run(tmp_path, toy_tokenizer):
    """Three shards as array 70 (tasks 70_0..70_2) and merge job 71; shard 0 done, 1 and 2 not written."""
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 9}, shards=3)
    runs.write_run(s, done=[0], skip=range(3, 9))
    sub = Submission(
        submitted=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        arrays=[ArrayJob("70", [0, 1, 2], ["70_0", "70_1", "70_2"])],
        merge_job_id="71",
    )
    s.rd.jobs_file.parent.mkdir(parents=True, exist_ok=True)
    s.rd.jobs_file.write_bytes(msgspec.json.encode(Jobs([sub])))
    return s


@pytest.mark.slow
def test_hung_sacct_falls_back_to_squeue_and_scontrol_within_its_bound(
    submitted_run, tmp_path, monkeypatch, capsys
):
    fake_slurm(
        tmp_path,
        monkeypatch,
        sacct=HANG,
        squeue=prints("70_2|PENDING||(Priority)\n71|PENDING||(Dependency)"),
        scontrol=prints(
            "JobId=73 ArrayJobId=70 ArrayTaskId=1 JobState=FAILED Reason=NonZeroExitCode "
            "NodeList=n2"
        ),
    )
    t0 = time.monotonic()
    _, rows, merge = run_status(submitted_run.root)
    assert time.monotonic() - t0 < 4, "one bounded sacct call, not 30 s"
    assert [(r.state, r.reason) for r in rows] == [
        ("completed", None),
        ("failed", None),
        ("pending", "Priority"),
    ]
    assert rows[1].node == "n2" and merge.state == "pending" and merge.reason == "Dependency"
    assert (
        cli_main(["status", str(submitted_run.root)]) == 1
    )  # known: one failed, so the run cannot complete
    out = capsys.readouterr().out
    assert "REASON" in out.splitlines()[1] and out.splitlines()[4].rstrip().endswith("Priority")
    assert "merge: job 71 pending (Dependency)" in out and "unknown" not in out


def test_unreachable_slurm_is_unknown_not_submitted_and_exits_4(
    submitted_run, tmp_path, monkeypatch, capsys
):
    fake_slurm(
        tmp_path, monkeypatch, sacct=SLURMDBD_DOWN, squeue=SLURMCTLD_DOWN, scontrol=SLURMCTLD_DOWN
    )
    assert cli_main(["status", str(submitted_run.root), "--json"]) == 4
    st = msgspec.json.decode(capsys.readouterr().out, type=RunStatus)
    assert [r.state for r in st.shards] == ["completed", "unknown", "unknown"]
    why = st.shards[1].reason
    assert "Unable to contact slurm controller" in why and "Problem talking to the database" in why
    assert st.merge.state == "unknown" and st.totals.shards == {"completed": 1, "unknown": 2}
    assert cli_main(["status", str(submitted_run.root)]) == 4
    out = capsys.readouterr().out
    assert (
        "    1 unknown " in out
        and "slurm: the state of 2 shards and the merge job is unknown (" in out
    )
    assert "(exit 4)" in out and "submitted" not in out


@pytest.mark.slow
def test_hung_slurm_says_unknown_with_the_bound_it_waited(
    submitted_run, tmp_path, monkeypatch, capsys
):
    fake_slurm(tmp_path, monkeypatch, sacct=HANG, squeue=HANG, scontrol=HANG)
    t0 = time.monotonic()
    assert cli_main(["status", str(submitted_run.root)]) == 4
    assert time.monotonic() - t0 < 6, (
        "each hung command is killed at its bound (with what it started)"
    )
    out = capsys.readouterr().out
    assert "squeue did not answer in 1 s; sacct did not answer in 1 s" in out


@pytest.mark.slow
def test_watch_keeps_refreshing_an_unknown_state_and_gives_up_at_its_limit(
    submitted_run, tmp_path, monkeypatch, capsys
):
    fake_slurm(
        tmp_path, monkeypatch, sacct=SLURMDBD_DOWN, squeue=SLURMCTLD_DOWN, scontrol=SLURMCTLD_DOWN
    )
    t0 = time.monotonic()
    code = cli_main(
        ["status", str(submitted_run.root), "--watch", "-i", "0.2", "--unknown-limit-s", "1"]
    )
    assert code == 4 and time.monotonic() - t0 < 10
    cap = capsys.readouterr()
    assert cap.out.count("still refreshing every 0.2 s: the state has been unknown for") >= 2
    assert "stayed unknown for 1 s" in cap.err


def test_a_job_neither_squeue_nor_sacct_knows_long_after_submission_is_unknown(
    submitted_run, tmp_path, monkeypatch, capsys
):
    jobs = msgspec.json.decode(submitted_run.rd.jobs_file.read_bytes(), type=Jobs)
    jobs.submissions[0].submitted = "2026-01-01T00:00:00+00:00"
    submitted_run.rd.jobs_file.write_bytes(msgspec.json.encode(jobs))
    fake_slurm(tmp_path, monkeypatch, sacct=prints(""), squeue=prints(""), scontrol=prints(""))
    _, rows, merge = run_status(submitted_run.root)
    assert (
        rows[1].state == "unknown" and "neither squeue nor sacct knows job 70_1" in rows[1].reason
    )


# ---------------------------------------------------------------------------------------------------
# a local worker (`toolkit run`, no Slurm job) that died
# ---------------------------------------------------------------------------------------------------
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from toolkit.formats.progress import Progress, write_progress  # noqa: E402


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize(
    "host, pid, expected",
    [
        ("here", "dead", "dead"),
        ("here", "alive", "running"),
        ("gpu-17", "dead", "running"),  # another host's pid is not judged here
    ],
)
def test_a_local_worker_whose_pid_is_gone_shows_dead_not_running(
    tmp_path, toy_tokenizer, capsys, host, pid, expected
):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6}, shards=2)
    runs.write_run(s, done=[0], skip=range(3, 6))
    write_progress(
        s.rd.progress_file(1),
        Progress(
            shard=1,
            state="generating",
            total=3,
            done=1,
            resumed=0,
            output_tokens=300,
            tok_per_s=50.0,
            host=socket.gethostname() if host == "here" else host,
            pid=dead_pid() if pid == "dead" else os.getpid(),
            started=time.time() - 1,
        ),
    )  # (this process, the "alive" worker, started before)
    code = cli_main(["status", str(s.root), "--json"])
    row = msgspec.json.decode(capsys.readouterr().out, type=RunStatus).shards[1]
    assert row.state == expected, row.error
    if expected == "dead":
        assert code == 1 and row.eta_s is None and row.tok_per_s == 0
        assert (
            row.error.startswith("worker gone: pid ")
            and f"`toolkit retry {s.rd.shown}` resumes it here" in row.error
        )
        assert cli_main(["logs", str(s.root), "--failed"]) == 1
        assert "==> shard 1: dead" in capsys.readouterr().out
    else:
        assert code == 5 and row.eta_s is not None  # still going


# ---------------------------------------------------------------------------------------------------
# a resumed shard's output tokens count what is already recorded
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_resumed_shard_counts_the_tokens_already_recorded(tmp_path, toy_tokenizer):
    from jobfiles import make_job, prepared_run
    from toolkit.cluster.retry import request_retry
    from toolkit.formats.frames import read_shard
    from toolkit.formats.manifests import read_done
    from toolkit.formats.progress import read_progress
    from toolkit.formats.shardfile import ShardWriter
    from toolkit.worker.run import DONE, run_shard

    rd, plan = prepared_run(
        make_job(tmp_path, toy_tokenizer("kimi"), n=12, sampling={"max_new_tokens": 64})
    )
    assert run_shard(rd.root, 0).end == DONE
    full = {r.id: r for r in read_shard(rd.shard_file(0))}
    total = read_done(rd.done_file(0)).output_tokens
    assert read_progress(rd, 0).output_tokens == total == sum(r.n_output for r in full.values())

    # Killed after 5 records: the next attempt resumes the file and generates the other 7.
    kept = sorted(full.values(), key=lambda r: r.index)[:5]
    rd.done_file(0).unlink()
    rd.shard_file(0).unlink()
    w = ShardWriter(rd.shard_file(0), plan.fingerprint, 0)
    w.open(range(plan.shards[0].first, plan.shards[0].first + plan.shards[0].count))
    for r in kept:
        w.add(r)
    w.close()
    assert run_shard(rd.root, 0).end == DONE
    p = read_progress(rd, 0)
    assert p.resumed == 5 and p.resumed_tokens == sum(r.n_output for r in kept)
    assert p.output_tokens == read_done(rd.done_file(0)).output_tokens == total, (
        "the total does not drop on resume"
    )

    # Ids generated again do not count twice: their old records are not among the resumed tokens.
    again = [kept[0].id, kept[1].id]
    request_retry(rd.root, again)
    assert run_shard(rd.root, 0).end == DONE
    p = read_progress(rd, 0)
    assert p.resumed_tokens == total - full[again[0]].n_output - full[again[1]].n_output
    assert p.output_tokens == read_done(rd.done_file(0)).output_tokens


# ---------------------------------------------------------------------------------------------------
# sbatch refusing: one line, no traceback
# ---------------------------------------------------------------------------------------------------
FAKE_SCONTROL = """#!/bin/sh
case "$2" in
  config) echo 'MaxArraySize            = 1001' ;;
  partition) echo 'PartitionName=gpu Default=YES State=UP' ;;
esac
"""
FAKE_SINFO = """#!/bin/sh
case "$*" in
  *%m*) echo 21694 ;;
  *) echo 'gpu:4|8' ;;
esac
"""
FAKE_SBATCH = (
    "#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account or account/partition "
    "combination specified' >&2\nexit 1\n"
)


@pytest.mark.slow
def test_sbatch_refusing_is_one_line_not_a_traceback(tmp_path, toy_tokenizer, monkeypatch):
    from jobfiles import make_job

    fake_slurm(
        tmp_path,
        monkeypatch,
        scontrol=FAKE_SCONTROL,
        sinfo=FAKE_SINFO,
        sbatch=FAKE_SBATCH,
        srun="#!/bin/sh\n",
    )
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        shards=2,
        slurm={"gpus_per_node": 1, "cpus_per_task": 1, "time": "00:10:00"},
    )
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job), "-A", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, (
        r.stderr
    )  # as sbatch exits when Slurm refuses
    assert r.stderr.strip().splitlines()[-1] == (
        "toolkit: error: sbatch failed: sbatch: error: Batch job submission failed: Invalid account or "
        "account/partition combination specified; check `squeue --me` for jobs this command may already have submitted"
    )


@pytest.mark.parametrize("command", ["status", "resubmit", "cancel"])
def test_a_damaged_jobs_file_is_one_line_naming_it_and_what_to_do(
    submitted_run, tmp_path, monkeypatch, capsys, command
):
    fake_slurm(
        tmp_path,
        monkeypatch,
        sacct=prints(""),
        squeue=prints(""),
        scontrol=prints(""),
        scancel="#!/bin/sh\nexit 0\n",
        sbatch="#!/bin/sh\nexit 1\n",
    )
    submitted_run.rd.jobs_file.write_bytes(
        b'{"submissions": [{"submitted": "2026-'
    )  # cut by a full disk
    assert cli_main([command, str(submitted_run.root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolkit: error: ") and err.count("\n") == 1 and "Traceback" not in err, (
        err
    )
    assert "jobs.json is damaged" in err and "squeue --me" in err
