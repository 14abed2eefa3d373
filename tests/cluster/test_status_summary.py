"""`status` of a run of many shards: a summary (the shards per state, a row for each that needs attention), every
row with `--all`, and a total with the percent done and the run's ETA, checked against the progress files and done
manifests the test wrote. No engine: the run's files are written directly (tests/runs.py)."""

from __future__ import annotations

import time

import msgspec
import pytest

import runs
from toolkit.cli import main as cli_main
from toolkit.cluster.status import RunStatus
from toolkit.cluster.table import SUMMARY_OVER
from toolkit.errors import EXIT_FAILED
from toolkit.formats.progress import Progress, write_progress

SHARDS, PER = 40, 3
RUNNING = {
    30: (2, 0, 20.0),
    31: (1, 0, 50.0),
    32: (2, 1, 8.0),
    33: (1, 0, 3.0),
    34: (0, 0, 5.0),
    35: (2, 0, 40.0),
}
FAILED, STALLED, CHANGED, NOT_STARTED = 36, 37, 5, (38, 39)


@pytest.fixture
def many(tmp_path, toy_tokenizer) -> runs.Synth:
    """40 shards of 3 prompts: 0-29 done (5 changed since), 30-35 generating (done, resumed, seconds generating),
    36 failed, 37 stalled (progress not written for 100 s), 38-39 not started."""
    s = runs.plan_run(
        tmp_path, toy_tokenizer("kimi"), datasets={"math": SHARDS * PER}, shards=SHARDS
    )
    assert SHARDS > SUMMARY_OVER and all(sp.count == PER for sp in s.plan.shards)
    runs.write_run(s, done=range(30), skip=range(30 * PER, SHARDS * PER))
    with open(s.rd.shard_file(CHANGED), "ab") as f:
        f.write(b"\0" * 5)  # cut or grown since its done manifest: changed
    now = time.time()
    for k, (done, resumed, secs) in RUNNING.items():
        write_progress(
            s.rd.progress_file(k),
            Progress(
                shard=k,
                state="generating",
                total=PER,
                done=done,
                resumed=resumed,
                started=now - secs,
                tok_per_s=10.0,
            ),
        )
    write_progress(
        s.rd.progress_file(FAILED),
        Progress(shard=FAILED, state="failed", total=PER, done=1, error="engine died"),
    )
    stalled = Progress(
        shard=STALLED, state="generating", total=PER, done=1, started=now - 400, updated=now - 100
    )
    s.rd.progress_file(STALLED).write_bytes(msgspec.json.encode(stalled))
    return s


def status(root, capsys, *flags: str) -> tuple[int, str]:
    code = cli_main(["status", str(root), *flags])
    return code, capsys.readouterr().out


def shard_rows(table: str) -> list[int]:
    head = table.splitlines().index(
        next(line for line in table.splitlines() if line.startswith("SHARD"))
    )
    rows = []
    for line in table.splitlines()[head + 1 :]:
        if line.startswith("total:"):
            return rows
        rows.append(int(line.split()[0]))
    raise AssertionError(table)


def test_many_shards_show_a_summary_with_a_row_for_each_that_needs_attention(many, capsys):
    code, table = status(many.root, capsys)
    assert code == EXIT_FAILED
    assert shard_rows(table) == [CHANGED, FAILED, STALLED]  # not 40 rows
    lines = table.splitlines()
    assert (
        lines[1] == "shards: 40, by state (the 3 that need attention below; --all: a row for each)"
    )
    by_state = {line.split()[0]: (int(line.split()[1]), line.split()[2]) for line in lines[2:8]}
    assert by_state == {
        "changed": (1, "5"),
        "completed": (29, "0-4,6-29"),
        "failed": (1, "36"),
        "not_started": (2, "38-39"),
        "running": (6, "30-35"),
        "stale": (1, "37"),
    }
    code, every = status(many.root, capsys, "--all")
    assert code == EXIT_FAILED and shard_rows(every) == list(range(SHARDS))
    assert not any(line.startswith("shards: 40, by state") for line in every.splitlines())


def test_the_total_gives_the_percent_done_and_the_runs_eta_from_the_progress_files(many, capsys):
    code, table = status(many.root, capsys, "--json")
    t = msgspec.json.decode(table, type=RunStatus).totals
    progress = {
        k: msgspec.json.decode(many.rd.progress_file(k).read_bytes(), type=Progress)
        for k in [*RUNNING, FAILED, STALLED]
    }
    # done: the done manifests' records (the changed shard's no longer count), and the progress files' counts
    done = 29 * PER + sum(p.done for p in progress.values())
    assert (t.done, t.total) == (done, SHARDS * PER)
    assert t.percent == pytest.approx(100 * done / (SHARDS * PER))
    # the pace: records per second of each generating shard's attempt, from its start to its last write
    pace = {
        k: (p.done - p.resumed) / (p.updated - p.started)
        for k, p in progress.items()
        if k in RUNNING and p.done > p.resumed
    }
    assert set(pace) == {30, 31, 32, 33, 35}
    left = sum(
        PER - RUNNING[k][0] for k in RUNNING
    )  # only the shards something runs: not the failed, stale, ...
    assert t.per_s == pytest.approx(sum(pace.values()))
    assert t.eta_s == pytest.approx(left / sum(pace.values()))
    _, table = status(many.root, capsys)
    total = next(line for line in table.splitlines() if line.startswith("total:"))
    eta = int(t.eta_s)
    assert total.startswith(
        f"total: {done}/{SHARDS * PER} prompts ({int(1000 * done / (SHARDS * PER)) / 10:.1f}%), "
    )
    assert (
        f", run ETA {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d} at {t.per_s:,.2f} prompts/s; "
        in total
    )


def test_a_run_with_nothing_generating_has_no_eta(many, capsys):
    for k in RUNNING:
        many.rd.progress_file(k).unlink()
    code, table = status(many.root, capsys)
    total = next(line for line in table.splitlines() if line.startswith("total:"))
    assert "ETA" not in total and code == EXIT_FAILED
    t = msgspec.json.decode(status(many.root, capsys, "--json")[1], type=RunStatus).totals
    assert t.eta_s is None and t.per_s == 0.0
    # --watch draws the same summary (and ends: nothing runs the run)
    code, watched = status(many.root, capsys, "--watch", "-i", "0.1")
    assert code == EXIT_FAILED and shard_rows(watched) == [CHANGED, FAILED, STALLED]
    assert (
        "shards: 40, by state (the 3 that need attention below; --all: a row for each)" in watched
    )


def test_a_few_shards_keep_a_row_each(tmp_path, toy_tokenizer, capsys):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6}, shards=3)
    runs.write_run(s, done=[0])
    code, table = status(s.root, capsys)
    assert shard_rows(table) == [0, 1, 2] and "by state" not in table
    assert next(line for line in table.splitlines() if line.startswith("total:")).startswith(
        "total: 2/6 prompts (33.3%), "
    )
