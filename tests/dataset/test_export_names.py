"""The export's file names: the format follows the output's extension when --format is not given, a --format the
extension does not hold is refused before anything is written, and side files are named per output so that two
exports into one folder keep their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import runs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import ExportError, export_run, side_file
from toolkit.dataset.merge import merge_run


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_tokenizer):
    """A merged kimi run: 6 healthy outputs and one cut by max_new_tokens (kept in the tokens export too)."""
    s = runs.plan_run(
        tmp_path_factory.mktemp("names"), toy_tokenizer("kimi"), datasets={"math": 7}, shards=1
    )
    runs.write_run(s, runs.mix(runs.healthy(), p2=runs.truncated))
    merge_run(s.root)
    return s


def test_an_output_named_parquet_is_written_as_parquet_with_its_own_side_files(
    run, tmp_path, capsys
):
    import pyarrow.parquet as pq

    out = tmp_path / "train.parquet"
    assert cli_main(["export", str(run.root), "-o", str(out)]) == 0
    table = pq.read_table(out)  # a parquet file, not JSON lines under a parquet name
    assert table.num_rows == 7 and "output_ids" in table.column_names
    assert "(parquet, from the output's extension)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "train_parquet_summary.json").read_text())
    assert (summary["format"], summary["exported"], summary["skipped_file"]) == (
        "parquet",
        7,
        str(tmp_path / "train_parquet_skipped.jsonl"),
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "train.parquet",
        "train_parquet_skipped.jsonl",
        "train_parquet_summary.json",
    ]


def test_an_output_named_jsonl_without_format_is_the_default_tokens_export(run, tmp_path):
    out = tmp_path / "train.jsonl"
    assert cli_main(["export", str(run.root), "-o", str(out)]) == 0
    rows = lines(out)
    assert len(rows) == 7 and all(
        set(r) >= {"input_ids", "loss_mask"} for r in rows
    )  # the cut one kept
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["format"] == "tokens" and summary["kept_by_reason"] == {"truncated": 1}
    assert lines(tmp_path / "train_skipped.jsonl") == []


@pytest.mark.parametrize(
    ("fmt", "name", "said"),
    [
        (
            "tokens",
            "train.parquet",
            "--format tokens writes JSON lines, an output named .parquet holds parquet",
        ),
        (
            "conversations",
            "c.parquet",
            "--format conversations writes JSON lines, an output named .parquet",
        ),
        (
            "parquet",
            "train.jsonl",
            "--format parquet writes parquet, an output named .jsonl holds JSON lines",
        ),
        (None, "train.jsonl.gz", "no --format and an output named .gz"),
        ("jsonl", "train.csv", "--format jsonl and an output named .csv"),
    ],
)
def test_a_format_the_extension_does_not_hold_is_refused_with_nothing_written(
    run, tmp_path, capsys, fmt, name, said
):
    argv = ["export", str(run.root), "-o", str(tmp_path / name)] + (
        ["--format", fmt] if fmt else []
    )
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and name in err
    assert list(tmp_path.iterdir()) == []
    assert not (run.root / "export").exists() or name not in {
        p.name for p in (run.root / "export").iterdir()
    }


def test_the_python_export_follows_the_extension_and_refuses_a_mismatch(run, tmp_path):
    import pyarrow.parquet as pq

    s = export_run(run.root, output=tmp_path / "p.parquet")
    assert s.format == "parquet" and pq.read_table(tmp_path / "p.parquet").num_rows == 7
    assert export_run(run.root, output=tmp_path / "t.jsonl").format == "tokens"
    assert (
        export_run(run.root, output=tmp_path / "t").format == "tokens"
    )  # no extension: the default
    with pytest.raises(ExportError, match=r"q.parquet: --format jsonl writes JSON lines"):
        export_run(run.root, "jsonl", tmp_path / "q.parquet")
    assert not (tmp_path / "q.parquet").exists()


def test_two_formats_exported_into_one_folder_keep_both_side_files(run, tmp_path):
    # the default names of jsonl and parquet share a stem: records.jsonl and records.parquet
    assert cli_main(["export", str(run.root), "--format", "jsonl", "-o", f"{tmp_path}/"]) == 0
    assert cli_main(["export", str(run.root), "--format", "parquet", "-o", f"{tmp_path}/"]) == 0
    assert cli_main(["export", str(run.root), "-o", f"{tmp_path}/"]) == 0  # tokens
    names = {p.name for p in tmp_path.iterdir()}
    assert {
        "records.jsonl",
        "records_summary.json",
        "records_skipped.jsonl",
        "records.parquet",
        "records_parquet_summary.json",
        "records_parquet_skipped.jsonl",
        "tokens.jsonl",
        "tokens_summary.json",
        "tokens_skipped.jsonl",
    } <= names
    formats = {
        n: json.loads((tmp_path / n).read_text())["format"]
        for n in names
        if n.endswith("_summary.json")
    }
    assert formats == {
        "records_summary.json": "jsonl",
        "records_parquet_summary.json": "parquet",
        "tokens_summary.json": "tokens",
    }
    # the jsonl export's own account survived the parquet one: its output is named in it
    assert json.loads((tmp_path / "records_summary.json").read_text())["output"] == str(
        tmp_path / "records.jsonl"
    )


def test_side_file_names():
    assert side_file(Path("d/tokens.jsonl"), "summary", ".json") == Path("d/tokens_summary.json")
    assert side_file(Path("d/records.parquet"), "skipped", ".jsonl") == Path(
        "d/records_parquet_skipped.jsonl"
    )
    assert side_file(Path("d/a.b.json"), "summary", ".json") == Path("d/a.b_json_summary.json")
    assert side_file(Path("d/train"), "summary", ".json") == Path("d/train_summary.json")
