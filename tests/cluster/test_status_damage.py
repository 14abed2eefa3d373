"""`status` tells the truth about what merge and export will find: the demo run (the stub engine, 44 prompts in 2
shards), complete, then damaged one way at a time (a finished shard file changed, cut, deleted or grown after its
done manifest; prompts.msgpack cut, changed or deleted; a done manifest gone or damaged; the merged dataset
damaged). For every kind, `status` is not "complete": it names what is damaged and the command that repairs it; a
merge keeps the complete merged dataset rather than replace it with a smaller one; and `export` exits 0 only with
every row the undamaged run exports. The repairs status names are run on a few kinds, and complete the run again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from toolkit.cli import main as cli_main
from toolkit.cluster.status import RunStatus
from toolkit.errors import EXIT_OK
from toolkit.formats.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
SHARD = 1  # the shard damaged


def demo_job(tmp: Path) -> Path:
    """jobs/demo.toml, its files named by absolute paths, its run in `tmp/run`."""
    text = (REPO / "jobs" / "demo.toml").read_text()
    text = text.replace('output_dir = "../runs/demo"', f'output_dir = "{tmp / "run"}"')
    text = text.replace('path = "demo/', f'path = "{REPO / "jobs" / "demo"}/')
    job = tmp / "demo.toml"
    job.write_text(text)
    return job


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The demo run, complete (merged, audited) and exported once: (job, run directory, rows exported)."""
    tmp = tmp_path_factory.mktemp("demo")
    job = demo_job(tmp)
    assert cli_main(["run", str(job), "--quiet"]) == EXIT_OK
    rd = RunDir(tmp / "run")
    assert cli_main(["export", str(rd.root)]) == EXIT_OK
    rows = len(rd.export_file("tokens").read_text().splitlines())
    assert rows > 30
    return job, rd, rows


def a_copy(pristine, tmp: Path) -> RunDir:
    """A copy of the complete run (times kept, as `cp -p` or rsync -t keeps them)."""
    _, rd, _ = pristine
    shutil.copytree(rd.root, tmp / "run", symlinks=True)
    return RunDir(tmp / "run")


def later(path: Path, seconds: int = 1) -> None:
    """A change made after the run finished: the file's mtime moves on, as a later edit would."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 1_000_000_000))


def flip(path: Path, where: float) -> None:
    data = bytearray(path.read_bytes())
    i = min(len(data) - 1, int(len(data) * where))
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    later(path)


def cut(path: Path, keep: float | int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    later(path)


def grow(path: Path, extra: bytes) -> None:
    with open(path, "ab") as f:
        f.write(extra)
    later(path)


def shard_file(rd: RunDir) -> Path:
    return rd.shard_file(SHARD)


def swap_shards(rd: RunDir) -> None:
    shutil.copyfile(rd.shard_file(0), rd.shard_file(SHARD))
    later(rd.shard_file(SHARD))


def edited_done(rd: RunDir, **fields) -> None:
    path = rd.done_file(SHARD)
    m = json.loads(path.read_text())
    m.update(fields)
    path.write_text(json.dumps(m))
    later(path, 3600)  # edited an hour after the shard finished


# kind -> (damage, what status's last line names: the shard or file, and the command that repairs it)
SHARD_CMD = ("shard 1", "`toolkit retry {run}`")
PROMPTS_CMD = ("prompts.msgpack", "`toolkit run JOB`")
MERGE_CMD = ("merged", "`toolkit merge {run}`")
DAMAGE = {
    "shard byte flipped in the middle": (lambda rd: flip(shard_file(rd), 0.5), SHARD_CMD),
    "shard byte flipped in the header": (lambda rd: flip(shard_file(rd), 0.0), SHARD_CMD),
    "shard byte flipped in the last frame": (lambda rd: flip(shard_file(rd), 0.98), SHARD_CMD),
    "shard last byte flipped": (lambda rd: flip(shard_file(rd), 1.0), SHARD_CMD),
    "shard truncated by half": (lambda rd: cut(shard_file(rd), 0.5), SHARD_CMD),
    "shard truncated by one byte": (lambda rd: cut(shard_file(rd), -1), SHARD_CMD),
    "shard emptied": (lambda rd: cut(shard_file(rd), 0), SHARD_CMD),
    "shard deleted": (lambda rd: shard_file(rd).unlink(), SHARD_CMD),
    "shard appended garbage": (lambda rd: grow(shard_file(rd), b"\x00garbage" * 8), SHARD_CMD),
    "shard appended its own first bytes": (
        lambda rd: grow(shard_file(rd), shard_file(rd).read_bytes()[:200]),
        SHARD_CMD,
    ),
    "shard replaced by the other shard's file": (swap_shards, SHARD_CMD),
    "done manifest deleted": (lambda rd: rd.done_file(SHARD).unlink(), SHARD_CMD),
    "done manifest truncated": (lambda rd: cut(rd.done_file(SHARD), 0.5), SHARD_CMD),
    "done manifest emptied": (lambda rd: cut(rd.done_file(SHARD), 0), SHARD_CMD),
    "done manifest with another size": (lambda rd: edited_done(rd, bytes=12345), SHARD_CMD),
    "done manifest with another sha256": (lambda rd: edited_done(rd, sha256="0" * 64), SHARD_CMD),
    "prompts.msgpack truncated": (lambda rd: cut(rd.prompts_file, 0.5), PROMPTS_CMD),
    "prompts.msgpack cut by one byte": (lambda rd: cut(rd.prompts_file, -1), PROMPTS_CMD),
    "prompts.msgpack byte flipped in an id": (lambda rd: flip(rd.prompts_file, 0.5), PROMPTS_CMD),
    "prompts.msgpack first byte flipped": (lambda rd: flip(rd.prompts_file, 0.0), PROMPTS_CMD),
    "prompts.msgpack deleted": (lambda rd: rd.prompts_file.unlink(), PROMPTS_CMD),
    "prompts.msgpack emptied": (lambda rd: cut(rd.prompts_file, 0), PROMPTS_CMD),
    "merged records byte flipped": (lambda rd: flip(rd.merged_file, 0.5), MERGE_CMD),
    "merged records truncated": (lambda rd: cut(rd.merged_file, 0.5), MERGE_CMD),
    "merged records deleted": (lambda rd: rd.merged_file.unlink(), MERGE_CMD),
    "merge manifest damaged": (lambda rd: cut(rd.manifest_file, 0.5), MERGE_CMD),
}


def status(rd: RunDir, capsys) -> tuple[int, str, RunStatus]:
    capsys.readouterr()
    code = cli_main(["status", str(rd.root)])
    table = capsys.readouterr().out
    assert cli_main(["status", str(rd.root), "--json"]) == code
    return code, table, msgspec.json.decode(capsys.readouterr().out, type=RunStatus)


def test_the_undamaged_demo_run_is_complete(pristine, tmp_path, capsys):
    rd = a_copy(pristine, tmp_path)
    code, table, _ = status(rd, capsys)
    assert code == EXIT_OK, table
    assert (
        table.splitlines()[-1] == "run: complete: every shard done, merged, audit passed (exit 0)"
    )


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_status_names_each_kind_of_damage_and_its_repair(kind, pristine, tmp_path, capsys):
    rd = a_copy(pristine, tmp_path)
    damage, (what, command) = DAMAGE[kind]
    damage(rd)
    code, table, st = status(rd, capsys)
    last = table.splitlines()[-1]
    assert code != EXIT_OK, table
    assert what in last and command.format(run=rd.shown) in last, table
    assert st.exit == code and st.verdict in last


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_merge_keeps_the_complete_dataset_and_export_never_exits_0_short(
    kind, pristine, tmp_path, capsys
):
    _, _, rows = pristine
    rd = a_copy(pristine, tmp_path)
    before = rd.merged_file.read_bytes() if rd.merged_file.exists() else None
    damage, _ = DAMAGE[kind]
    damage(rd)
    merged = cli_main(["merge", str(rd.root)])
    if (
        merged != EXIT_OK
        and before is not None
        and rd.merged_file.exists()
        and not kind.startswith("merge")
    ):
        assert (
            rd.merged_file.read_bytes() == before
        )  # refused: the earlier merged dataset is kept as it was
    if merged == EXIT_OK:
        m = json.loads(rd.manifest_file.read_text())
        assert m["complete"] and m["records"] == 44, (
            m
        )  # never a smaller one in place of the complete one
    capsys.readouterr()
    if cli_main(["export", str(rd.root)]) == EXIT_OK:
        out = capsys.readouterr().out
        assert len(rd.export_file("tokens").read_text().splitlines()) == rows, out


def repaired(rd: RunDir, capsys) -> None:
    code, table, _ = status(rd, capsys)
    assert code == EXIT_OK, table


@pytest.mark.parametrize(
    "kind",
    [
        "shard byte flipped in the middle",
        "shard truncated by half",
        "shard deleted",
        "shard appended garbage",
        "done manifest truncated",
    ],
)
def test_the_command_status_names_repairs_a_damaged_shard(kind, pristine, tmp_path, capsys):
    rd = a_copy(pristine, tmp_path)
    DAMAGE[kind][0](rd)
    assert cli_main(["retry", str(rd.root), "--quiet"]) == EXIT_OK
    repaired(rd, capsys)
    assert json.loads(rd.manifest_file.read_text())["records"] == 44


@pytest.mark.parametrize(
    "kind", ["prompts.msgpack byte flipped in an id", "prompts.msgpack deleted"]
)
def test_planning_the_job_again_repairs_prompts_msgpack(kind, tmp_path, capsys):
    job = demo_job(tmp_path)
    assert cli_main(["run", str(job), "--quiet"]) == EXIT_OK
    rd = RunDir(tmp_path / "run")
    DAMAGE[kind][0](rd)
    assert (
        cli_main(["run", str(job), "--quiet"]) == EXIT_OK
    )  # writes the damaged file again, generates nothing
    repaired(rd, capsys)
