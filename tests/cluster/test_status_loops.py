"""`toolkit status` says how many outputs were stopped in a repetition loop ([client] loop_stop), per shard and in
all: from the done manifest once a shard is done (its records with finish "loop"), from the progress file before."""

from __future__ import annotations

import msgspec
import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.cli import main as cli_main
from toolkit.cluster.status import RunStatus
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress, write_progress
from toolkit.formats.records import LOOP
from toolkit.worker.run import DONE, run_shard


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def status(root, capsys) -> tuple[str, RunStatus]:
    cli_main(["status", str(root)])
    table = capsys.readouterr().out
    cli_main(["status", str(root), "--json"])
    return table, msgspec.json.decode(capsys.readouterr().out, type=RunStatus)


def loops_column(table: str) -> dict[int, int]:
    """{shard: LOOPS} read off the table, by the header's column."""
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("SHARD"))
    end = head.index("LOOPS") + len("LOOPS")
    rows = [line for line in lines if line[:5].strip().isdigit()]
    return {int(line[:5]): int(line[end - 5 : end]) for line in rows}


def test_status_counts_the_outputs_stopped_in_a_loop_per_shard_and_in_all(tmp_path, kimi, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        shards=2,
        sampling={"max_new_tokens": 4096},
        stub={"degenerate_fraction": 0.2, "output_scale": 4096},
        client={"concurrency": 8, "loop_stop": True, "segment_tokens": 512},
        audit={"max_degenerate_share": 1.0, "max_length_share": 1.0, "min_think_end_share": 0.0},
    )
    rd, _ = prepared_run(job)

    # before any shard ran: no loops, and the total line does not speak of them
    table, st = status(rd.root, capsys)
    assert loops_column(table) == {0: 0, 1: 0} and st.totals.loops == 0
    assert "loop" not in next(line for line in table.splitlines() if line.startswith("total:"))

    assert run_shard(rd.root, 0).end == DONE
    loops0 = sum(r.finish == LOOP for r in read_shard(rd.shard_file(0)))
    assert loops0 >= 1  # the stub's draw: a fifth of the outputs loop
    assert read_done(rd.done_file(0)).loops == loops0 == read_progress(rd, 0).loops_stopped
    # shard 1 stopped part-way in an earlier attempt: its progress file is all there is
    write_progress(
        rd.progress_file(1),
        msgspec.structs.replace(
            read_progress(rd, 0),
            shard=1,
            state="stopped",
            loops_stopped=3,
            done=5,
            pid=0,
        ),
    )
    table, st = status(rd.root, capsys)
    assert loops_column(table) == {0: loops0, 1: 3}
    assert [s.loops for s in st.shards] == [loops0, 3] and st.totals.loops == loops0 + 3
    assert f"{loops0 + 3} stopped in a repetition loop" in table

    assert run_shard(rd.root, 1).end == DONE
    loops1 = sum(r.finish == LOOP for r in read_shard(rd.shard_file(1)))
    table, st = status(rd.root, capsys)
    assert loops_column(table) == {0: loops0, 1: loops1} and st.totals.loops == loops0 + loops1
    total = next(line for line in table.splitlines() if line.startswith("total:"))
    assert total.startswith(
        f"total: 40/40 prompts (100.0%), 0 failed, {loops0 + loops1} stopped in a repetition loop, "
    )


def test_a_resumed_shard_counts_the_loops_its_earlier_attempts_recorded(tmp_path, kimi, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 30)
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        sampling={"max_new_tokens": 4096},
        stub={"degenerate_fraction": 0.3, "output_scale": 4096},
        client={"concurrency": 4, "loop_stop": True, "segment_tokens": 512},
        audit={"max_degenerate_share": 1.0, "max_length_share": 1.0, "min_think_end_share": 0.0},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    first = list(read_shard(rd.shard_file(0)))
    looped = [r.id for r in first if r.finish == LOOP]
    assert len(looped) >= 2  # the stub's draw: about a third of the outputs loop
    # a second attempt generates one looped output and two others again, and keeps the rest
    again = looped[:1] + [r.id for r in first if r.finish != LOOP][:2]
    (tmp_path / "ids.txt").write_text("\n".join(again) + "\n")
    assert cli_main(["retry", str(rd.root), "--ids", str(tmp_path / "ids.txt"), "--quiet"]) == 0
    capsys.readouterr()  # (its audit)
    p = read_progress(rd, 0)
    newest = {r.id: r for r in read_shard(rd.shard_file(0))}
    loops = sum(r.finish == LOOP for r in newest.values())
    assert p.resumed_loops == len(looped) - 1 and p.resumed_loops + p.loops_stopped == loops
    # as `status` shows it while the shard runs: from its progress file, earlier attempts included
    rd.done_file(0).unlink()
    write_progress(rd.progress_file(0), msgspec.structs.replace(p, state="stopped", pid=0))
    table, st = status(rd.root, capsys)
    assert loops_column(table) == {0: loops} and st.totals.loops == loops
