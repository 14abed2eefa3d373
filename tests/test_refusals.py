"""No tracebacks, no half-done refusals: a run directory that cannot be written is refused at `check`, a refused
submission leaves nothing behind, two `toolkit run` of one job share the work, several runs in one output_dir."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import runs
from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.dataset.finish import merge_and_audit
from toolkit.formats.frames import read_shard

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("toolkit: error: "), err
    return err


def at(job: Path, output_dir: Path) -> Path:
    job.write_text(
        job.read_text().replace(
            f'output_dir = "{job.parent / "run"}"', f'output_dir = "{output_dir}"'
        )
    )
    return job


# ---------------------------------------------------------------------------------------------------
# an output_dir that cannot be written: said at check, in one line
# ---------------------------------------------------------------------------------------------------
def test_output_dir_under_a_file_is_refused_at_check_dry_run_and_run(tmp_path, kimi, capsys):
    (tmp_path / "notes.txt").write_text("a file\n")
    job = at(make_job(tmp_path, kimi, n=4), tmp_path / "notes.txt" / "run")
    for argv in (["check", str(job)], ["submit", str(job), "--dry-run"], ["run", str(job)]):
        assert cli_main(argv) == 2, argv
        err = one_line_error(capsys)
        assert (
            f"output_dir {tmp_path / 'notes.txt' / 'run'}: {tmp_path / 'notes.txt'} is a file, not a folder"
            in err
        )


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A folder on a read-only file system (a tmpfs mounted read-only), or, where nothing may be mounted, one the
    file system says is read-only (os.access and statvfs answering as they do there)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        real_access, real_statvfs = os.access, os.statvfs
        monkeypatch.setattr(
            os, "access", lambda p, mode: False if Path(p) == ro else real_access(p, mode)
        )

        class ReadOnly:
            f_flag = os.ST_RDONLY

        monkeypatch.setattr(
            os, "statvfs", lambda p: ReadOnly() if Path(p) == ro else real_statvfs(p)
        )
    yield ro
    if mounted:
        subprocess.run(["umount", str(ro)], check=True)


def test_output_dir_on_a_read_only_file_system_is_refused_at_check(
    tmp_path, kimi, capsys, read_only_dir
):
    job = at(make_job(tmp_path, kimi, n=4), read_only_dir / "runs" / "t")
    for argv in (["check", str(job)], ["submit", str(job), "--dry-run"], ["run", str(job)]):
        assert cli_main(argv) == 2, argv
        assert (
            f"output_dir {read_only_dir / 'runs' / 't'}: {read_only_dir} is on a read-only file system"
            in one_line_error(capsys)
        )


@pytest.mark.parametrize("place", ["/proc", "/sys"])
def test_output_dir_where_no_file_can_be_made_is_refused_at_check_dry_run_and_run(
    tmp_path, kimi, capsys, place
):
    """/proc and /sys say writable to root (os.access), yet no run can be made there: all three refuse it."""
    if not Path(place).is_dir():
        pytest.skip(f"no {place} here")
    job = at(make_job(tmp_path, kimi, n=4), Path(place) / "runs" / "t")
    for argv in (["check", str(job)], ["submit", str(job), "--dry-run"], ["run", str(job)]):
        assert cli_main(argv) == 2, argv
        assert f"output_dir {place}/runs/t: a folder cannot be made in {place} (" in one_line_error(
            capsys
        )
    ok = at(make_job(tmp_path / "fine", kimi, n=4), tmp_path / "fine" / "runs" / "t")
    assert cli_main(["check", str(ok)]) == 0
    assert not list((tmp_path / "fine").glob(".toolkit-check-*"))  # the probe leaves nothing


def test_export_into_a_folder_writes_the_default_name_there_and_a_failed_audit_is_a_warning(
    tmp_path, kimi, capsys
):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 4}, shards=1)
    runs.write_run(s)
    assert merge_and_audit(s.root).passed
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    capsys.readouterr()
    assert cli_main(["export", str(s.root), "--format", "jsonl", "-o", str(out_dir)]) == 0
    # the run is planned with the stub engine: its one warning says the records are synthetic
    warned = [w for w in capsys.readouterr().err.splitlines() if "warning" in w]
    assert (out_dir / "records.jsonl").is_file() and [w for w in warned if "STUB" not in w] == []
    # a path ending with a slash is a folder too (made when its parent exists); no --format: the exact-ids tokens
    assert cli_main(["export", str(s.root), "-o", f"{tmp_path / 'new'}/"]) == 0
    out = capsys.readouterr().out
    assert (
        tmp_path / "new" / "tokens.jsonl"
    ).is_file() and "(tokens, the default: the model's exact ids" in out
    assert not (tmp_path / "new").is_file()
    # a failed audit: the export is written, with a warning line naming the failed checks
    audit = s.root / "merged" / "audit.json"
    report = json.loads(audit.read_text())
    report["passed"] = False
    report["checks"][0]["passed"] = False
    audit.write_text(json.dumps(report))
    assert cli_main(["export", str(s.root), "-o", str(out_dir)]) == 0
    err = capsys.readouterr().err
    assert f"warning: the audit of run {s.root} failed ({report['checks'][0]['name']})" in err
    assert (
        err.count("\n") == 2 and "warning: the records are the STUB engine's" in err
    )  # one line each


# ---------------------------------------------------------------------------------------------------
# submit: refusals before anything is written
# ---------------------------------------------------------------------------------------------------
NO_SLURM = {"gpus_per_node": 1, "cpus_per_task": 1, "time": "00:10:00"}


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """No Slurm command anywhere: a refusal must come before Slurm is asked."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nothing" / "slurm.conf"))


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--time", "5", "--signal-delay-s", "300"],
            "--time 00:05:00 (300 s) is not longer than --signal-delay-s 300",
        ),
        (["--cpus-per-task", "0"], "--cpus-per-task 0: must be at least 1"),
        (["--array-parallelism", "0"], "--array-parallelism 0: must be at least 1"),
        (["--signal-delay-s", "0"], "--signal-delay-s 0: must be at least 1"),
    ],
)
def test_a_refused_submission_leaves_nothing_behind(tmp_path, kimi, capsys, no_slurm, args, says):
    job = make_job(tmp_path, kimi, n=4, slurm=NO_SLURM)
    for dry in ([], ["--dry-run"]):
        assert cli_main(["submit", str(job), *args, *dry]) == 2
        assert says in one_line_error(capsys)
        assert not (tmp_path / "run").exists(), "a refused submission creates no run directory"
    # A run already planned: its run.json keeps its settings (the job's new [slurm] time is refused with it).
    prepared_run(job)
    before = (tmp_path / "run" / "run.json").read_bytes()
    job.write_text(job.read_text().replace('time = "00:10:00"', 'time = "00:20:00"'))
    assert cli_main(["submit", str(job), *args]) == 2
    assert says in one_line_error(capsys)
    assert (tmp_path / "run" / "run.json").read_bytes() == before
    assert not (tmp_path / "run" / "slurm" / "jobs.json").exists()


def test_zero_from_the_job_table_is_refused_too(tmp_path, kimi, capsys, no_slurm):
    job = make_job(tmp_path, kimi, n=4, slurm={**NO_SLURM, "cpus_per_task": 0})
    assert cli_main(["submit", str(job), "--dry-run"]) == 2
    assert "[slurm] cpus_per_task = 0: must be at least 1" in one_line_error(capsys)


# ---------------------------------------------------------------------------------------------------
# several runs in one output_dir
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_new_run_twice_resumes_the_new_run_and_plain_run_takes_the_newest(tmp_path, kimi, capsys):
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 32})
    assert cli_main(["run", str(job)]) == 0
    job.write_text(
        job.read_text().replace("max_new_tokens = 32", "max_new_tokens = 24")
    )  # another job now
    assert cli_main(["run", str(job)]) == 2
    assert "holds another run" in capsys.readouterr().err
    assert cli_main(["run", str(job), "--new-run"]) == 0
    beside = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert len(beside) == 1
    first = {r.id: r for r in read_shard(beside[0] / "shards" / "00000.zst")}
    capsys.readouterr()
    for argv in (
        ["run", str(job), "--new-run"],
        ["run", str(job)],
    ):  # the same job: resumed, never generated again
        assert cli_main(argv) == 0
        assert f"run directory: {beside[0]}" in capsys.readouterr().out
        assert [p for p in tmp_path.iterdir() if p.name.startswith("run.")] == beside
        assert [r.id for r in read_shard(beside[0] / "shards" / "00000.zst")] == list(first)
    job.write_text(
        job.read_text().replace("max_new_tokens = 24", "max_new_tokens = 32")
    )  # the first job again
    assert cli_main(["run", str(job)]) == 0
    assert f"run directory: {tmp_path / 'run'}\n" in capsys.readouterr().out
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("run.")]) == 1


def test_run_help_says_what_it_does_with_several_runs(capsys):
    with pytest.raises(SystemExit):
        cli_main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "the newest run of this same job (same fingerprint) among them is resumed, with or without --new-run"
        in out
    )


# ---------------------------------------------------------------------------------------------------
# two `toolkit run` of one job at once
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_runs_of_one_job_at_once_share_the_shards_and_merge(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=8,
        shards=2,
        stub={"token_delay_s": 0.04, "fixed_output_tokens": 100},
        sampling={"max_new_tokens": 100},
        client={"concurrency": 2},
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "toolkit", "run", str(job)]
    a = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while (
        not (run / "progress" / "00000.json").exists()
        or msgspec.json.decode((run / "progress" / "00000.json").read_bytes())["state"]
        != "generating"
    ):
        assert time.monotonic() < deadline and a.poll() is None, (
            "the first run never started generating"
        )
        time.sleep(0.1)
    b = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    outs = [p.communicate(timeout=180) for p in (a, b)]
    for p, (out, err) in zip((a, b), outs):
        assert p.returncode == 0, out + err
        assert "shards failed" not in out and "Traceback" not in err
        assert "audit of run t" in out and ": PASSED" in out, (
            out
        )  # each merged once every shard was done
    said = "".join(err for _, err in outs)
    # the run that finds nothing left to claim says which shard the other holds, and waits for it
    assert re.search(
        r"shard [01] is being generated elsewhere \(pid \d+ on " + re.escape(os.uname().nodename),
        said,
    ), said
    merged = list(read_shard(run / "merged" / "records.zst"))
    assert sorted(r.index for r in merged) == list(range(8)) and all(
        r.status == "ok" for r in merged
    )
    for k in (0, 1):  # each shard generated once: by one of the two
        assert len({r.id for r in read_shard(run / "shards" / f"{k:05d}.zst")}) == len(
            list(read_shard(run / "shards" / f"{k:05d}.zst"))
        )
