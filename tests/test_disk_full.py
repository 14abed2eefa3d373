"""A full disk, wherever it strikes (planning, generation and its log, merge, audit, export): one line saying what
to do, no traceback, nothing half-written left behind."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

import runs
from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.dataset.merge import merge_run
from toolkit.formats import files
from toolkit.worker.run import DONE, run_shard


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile(io.BytesIO):
    def write(self, data):
        _full()


def full_for(suffix: str, real=open):
    """An `open` under which files whose name ends with `suffix` take nothing (ENOSPC on write)."""

    def opener(path, mode="r", *args, **kwargs):
        if str(path).endswith(suffix) and "w" in mode:
            real(path, mode, *args, **kwargs).close()  # the file is created, as on a full disk
            return _FullFile()
        return real(path, mode, *args, **kwargs)

    return opener


def one_line(err: str, *words: str) -> None:
    assert err.startswith("toolkit: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Logging error" not in err, err
    assert "No space left on device (ENOSPC)" in err and "free space" in err, err
    for w in words:
        assert w in err, err


@pytest.fixture
def merged(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 8}, shards=2)
    runs.write_run(s)
    return s


def test_merge_audit_and_export_on_a_full_disk(merged, monkeypatch, capsys):
    s = merged
    root = str(s.root)
    with monkeypatch.context() as m:  # the records themselves
        m.setattr(os, "write", _full)
        assert cli_main(["merge", root, "--no-audit"]) == 1
    one_line(
        capsys.readouterr().err,
        "cannot write",
        "merged/records.zst",
        f"`toolkit merge {s.rd.shown}` again",
    )
    assert not [p.name for p in s.rd.merged_dir.iterdir() if p.name.startswith(".")]

    with monkeypatch.context() as m:  # the audit's report
        m.setattr(files, "open", full_for(f"audit.json.{os.getpid()}.tmp"), raising=False)
        assert cli_main(["merge", root]) == 1
        one_line(capsys.readouterr().err, "merged/audit.json")
        assert cli_main(["audit", root]) == 1
        one_line(capsys.readouterr().err, f"`toolkit audit {s.rd.shown}` again")
    assert not [
        p.name for p in s.rd.merged_dir.iterdir() if p.name.startswith(".")
    ]  # no .audit.json.<pid>.tmp

    assert cli_main(["merge", root]) == 0
    capsys.readouterr()
    import toolkit.dataset.export.steps as export  # the module that opens the export's files

    out = s.root / "out.jsonl"
    with monkeypatch.context() as m:
        m.setattr(export, "open", full_for(".tmp"), raising=False)
        assert cli_main(["export", root, "--format", "jsonl", "-o", str(out)]) == 1
    one_line(capsys.readouterr().err, "out.jsonl", "export again")
    assert not out.exists() and not list(s.root.glob(".out.jsonl*"))


def test_planning_on_a_full_disk_leaves_no_run_directory(
    tmp_path, toy_tokenizer, monkeypatch, capsys
):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=4)
    monkeypatch.setattr(files, "open", full_for(".tmp"), raising=False)
    assert cli_main(["run", str(job)]) == 1
    one_line(capsys.readouterr().err, "output_dir", "run it again")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_log_file_on_a_full_disk_is_said_once_not_a_traceback_per_line(
    tmp_path, toy_tokenizer, capsys
):
    """/dev/full takes nothing: the shard's log lines cannot be kept, which is said once; the shard goes on."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=6, sampling={"max_new_tokens": 64})
    rd, _ = prepared_run(job)
    rd.log_file(0).parent.mkdir(parents=True, exist_ok=True)
    rd.log_file(0).symlink_to("/dev/full")
    assert run_shard(rd.root, 0).end == DONE
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err
    assert err.count("toolkit: warning: cannot write the log file") == 1, err
    assert "No space left on device" in err
    assert merge_run(rd.root).ok == 6
