"""The trainer's length: `toolkit export` measures the rows it writes (tokens per row: p50, p99, max), says what the
target trainer's default length (SpecForge's data.max_length 2048, speculators' --seq-length 8192) would cut, and
writes beside a tokens export the trainer's config that keeps every row whole; `--max-length N` leaves longer rows
out with their own reason, counted (the trainers' own loaders run on these in tests/trainers/)."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

import runs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import LONGER, Selection, export_run
from toolkit.dataset.finish import merge_and_audit


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, toy_tokenizer):
    """12 reasoning records of 600 to 3,500 output ids: some longer than SpecForge's default 2048."""
    s = runs.plan_run(
        tmp_path_factory.mktemp("long"),
        toy_tokenizer("kimi"),
        datasets={"math": 12},
        shards=1,
        pool_chars=400_000,
    )
    runs.write_run(s, runs.healthy(reasoning=(500, 3300), content=(50, 200)))
    assert merge_and_audit(s.root).passed
    return s


def nearest_rank(values: list[int], q: int) -> int:
    ranked = sorted(values)
    k = -(-len(ranked) * q // 100)  # ceil
    return ranked[k - 1]


def test_the_tokens_export_measures_its_rows_and_writes_the_specforge_config_that_keeps_them_whole(
    long_run, tmp_path, capsys
):
    out = tmp_path / "tokens.jsonl"
    capsys.readouterr()
    assert cli_main(["export", str(long_run.root), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = lines(out)
    lengths = [len(r["input_ids"]) for r in rows]
    assert max(lengths) > 2048 > min(lengths)  # the run is one that SpecForge's default cuts
    s = json.loads((tmp_path / "tokens_summary.json").read_text())["lengths"]
    assert (s["rows"], s["p50"], s["p99"], s["max"]) == (
        len(rows),
        nearest_rank(lengths, 50),
        nearest_rank(lengths, 99),
        max(lengths),
    )
    # what 2048 cuts, counted on the written masks
    supervised = sum(sum(r["loss_mask"]) for r in rows)
    cut = sum(sum(r["loss_mask"][2048:]) for r in rows)
    assert (s["supervised"], s["supervised_cut_by_default"]) == (supervised, cut) and cut > 0
    assert s["rows_cut_by_default"] == sum(n > 2048 for n in lengths)
    assert (s["default_length"], s["setting"], s["needed"]) == (
        2048,
        "data.max_length",
        max(lengths),
    )
    assert (
        f"tokens per row: p50 {s['p50']:,}, p99 {s['p99']:,}, max {max(lengths):,}; at its default "
        f"data.max_length 2048, specforge would cut {s['rows_cut_by_default']} of {len(rows)} rows "
        f"({cut / supervised:.1%} of the supervised tokens)"
    ) in printed
    config = tmp_path / "tokens_specforge.yaml"
    assert f"every row whole: specforge data.max_length: {max(lengths)} (written in" in printed
    c = yaml.safe_load(config.read_text())
    assert c["data"] == {"prompts_path": str(out), "max_length": max(lengths)}
    assert c["model"]["target_model_path"] == long_run.plan.spec.model.path
    assert json.loads((tmp_path / "tokens_summary.json").read_text())["trainer_config"] == str(
        config
    )


def test_the_speculators_export_writes_its_prepare_data_command_with_the_seq_length(
    long_run, tmp_path
):
    s = export_run(long_run.root, output=tmp_path / "t.jsonl", trainer="speculators")
    longest = max(len(r["input_ids"]) for r in lines(tmp_path / "t.jsonl"))
    assert (
        s.lengths.default_length == 8192
        and s.lengths.rows_cut_by_default == 0
        and s.lengths.needed == longest
    )
    cmd = shlex.split((tmp_path / "t_prepare_data.sh").read_text().splitlines()[-1])
    assert cmd[:2] == ["speculators", "prepare-data"]
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    assert flags["--seq-length"] == str(longest) and flags["--data"] == str(tmp_path / "t.jsonl")


def test_max_length_leaves_longer_rows_out_with_their_reason_and_counts_them(
    long_run, tmp_path, capsys
):
    whole = export_run(long_run.root, output=tmp_path / "all.jsonl")
    by_id = {r["id"]: len(r["input_ids"]) for r in lines(tmp_path / "all.jsonl")}
    out = tmp_path / "short.jsonl"
    capsys.readouterr()
    assert cli_main(["export", str(long_run.root), "-o", str(out), "--max-length", "2048"]) == 0
    printed = capsys.readouterr().out
    rows = lines(out)
    longer = {i for i, n in by_id.items() if n > 2048}
    assert longer and {r["id"] for r in rows} == set(by_id) - longer
    assert all(len(r["input_ids"]) <= 2048 for r in rows)  # rows written whole: nothing cut
    assert all(
        r["input_ids"]
        == next(x for x in lines(tmp_path / "all.jsonl") if x["id"] == r["id"])["input_ids"]
        for r in rows
    )
    skipped = lines(tmp_path / "short_skipped.jsonl")
    assert {r["id"] for r in skipped if r["reason"] == LONGER} == longer
    s = json.loads((tmp_path / "short_summary.json").read_text())
    assert s["skipped_by_reason"][LONGER] == len(longer) and s["exported"] == whole.exported - len(
        longer
    )
    assert s["exported"] + s["skipped"] + s["failed"] + s["missing"] + s["filtered"] == s["planned"]
    assert f"{LONGER} {len(longer)}" in printed
    assert s["lengths"]["supervised_cut_by_default"] == 0
    assert (
        yaml.safe_load((tmp_path / "short_specforge.yaml").read_text())["data"]["max_length"]
        == 2048
    )


def test_the_conversations_export_measures_its_rows_as_well(long_run, tmp_path):
    s = export_run(
        long_run.root, "conversations", tmp_path / "c.jsonl", select=Selection(max_length=2048)
    )
    assert (
        s.lengths.rows == s.rows
        and s.lengths.max <= 2048
        and s.skipped_by_reason.get(LONGER, 0) >= 1
    )
    assert s.trainer_config is None and not (tmp_path / "c_specforge.yaml").exists()


@pytest.mark.parametrize("n", ["0", "-5"])
def test_a_max_length_below_one_is_refused_before_anything_is_written(
    long_run, tmp_path, capsys, n
):
    out = tmp_path / "x" / "tokens.jsonl"
    out.parent.mkdir()
    assert cli_main(["export", str(long_run.root), "-o", str(out), "--max-length", n]) == 2
    assert f"--max-length {n}: give a number of tokens, 1 or more" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []
