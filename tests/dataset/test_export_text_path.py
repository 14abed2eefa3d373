"""The conversations export's round trip checked in batches (one tokenizer call for many rows, on every core) writes
what checking one row at a time wrote, byte for byte; `--check-sample N` checks about N rows, one every planned/N,
and says how many it checked and how many give the model's ids."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

import runs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import conversations as export_conversations
from toolkit.dataset.export import export_run
from toolkit.dataset.export import text as export_text
from toolkit.dataset.finish import merge_and_audit
from toolkit.dataset.trainers import sanitized

OUTPUTS = (
    "conversations.jsonl",
    "conversations_roundtrip.jsonl",
    "conversations_skipped.jsonl",
    "conversations_specforge_template.py",
)


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def split_word(s: runs.Synth) -> list[int]:
    """` the` as one id per character: text the tokenizer writes as fewer ids (a row the round trip cannot give
    back)."""
    chars = [i for c in " the" for i in s.tok(c, add_special_tokens=False)["input_ids"]]
    assert len(s.tok(" the", add_special_tokens=False)["input_ids"]) < len(chars)
    return chars


def conversations_run(tmp_path, toy_tokenizer, family: str) -> runs.Synth:
    s = runs.plan_run(
        tmp_path, toy_tokenizer(family), family, datasets={"math": 14, "tools": 8}, shards=2
    )
    healthy = runs.healthy()

    def differs(s, pos, rng):
        out = healthy(s, pos, rng)
        return runs.Out(out.ids[:-1] + split_word(s) + out.ids[-1:], out.finish, out.matched)

    runs.write_run(s, runs.mix(healthy, p2=differs, p9=differs, p16=differs, p4=runs.truncated))
    assert merge_and_audit(s.root).passed
    return s


def split_rows(s: runs.Synth) -> set[str]:
    """The ids of the records written with a word split into characters."""
    return {r.id for r in s.written.values() if r.index in (2, 9, 16)}


def one_row_at_a_time(s: runs.Synth, trip, rows: list[dict]) -> bytes:
    """The round-trip file as the export wrote it before batching: each row rendered, then encoded by one call of
    the tokenizer, compared with the stored ids of the row's record."""
    enc, out = msgspec.json.Encoder(), b""
    kwargs = {"enable_thinking": True} if trip.reg.enable_thinking else {}
    thinking = trip.reg.parser_type == "thinking"
    for row in rows:
        rec = s.written[row["id"]]
        stored = np.frombuffer(rec.prompt_ids + rec.output_ids, "<u4").tolist()
        text = s.tok.apply_chat_template(
            [sanitized(m, thinking) for m in row["conversations"]],
            tokenize=False,
            add_generation_prompt=False,
            tools=row["tools"] or None,
            **kwargs,
        )
        ids = s.tok(text, add_special_tokens=False)["input_ids"]
        at = None
        if ids[: len(stored)] != stored:
            at = next(
                n
                for n in range(len(ids) + 1)
                if n == min(len(ids), len(stored)) or ids[n] != stored[n]
            )
        out += (
            enc.encode(
                {
                    "id": row["id"],
                    "identical": at is None,
                    "first_difference": at,
                    "arguments_reformatted": 0,
                }
            )
            + b"\n"
        )
    return out


@pytest.mark.parametrize("family", ["kimi", "deepseek"])
def test_the_round_trip_in_batches_writes_what_one_row_at_a_time_wrote(
    tmp_path, toy_tokenizer, monkeypatch, family
):
    s = conversations_run(tmp_path / "run", toy_tokenizer, family)
    trips = []

    class Kept(export_conversations.RoundTrip):
        def __init__(self, *a):
            super().__init__(*a)
            trips.append(self)

    monkeypatch.setattr(export_conversations, "RoundTrip", Kept)
    # one row per tokenizer call, as before
    monkeypatch.setattr(export_conversations, "CHECK_ROWS", 1)
    (tmp_path / "single").mkdir()
    single = export_run(s.root, "conversations", tmp_path / "single" / "conversations.jsonl")
    monkeypatch.setattr(export_conversations, "CHECK_ROWS", 3)
    monkeypatch.setattr(
        export_conversations, "CHECK_TOKENS", 400
    )  # some batches closed by their ids, not their rows
    (tmp_path / "batched").mkdir()
    batched = export_run(s.root, "conversations", tmp_path / "batched" / "conversations.jsonl")
    for name in OUTPUTS:
        assert (tmp_path / "single" / name).read_bytes() == (
            tmp_path / "batched" / name
        ).read_bytes(), name
    rows = lines(tmp_path / "batched" / "conversations.jsonl")
    assert len(rows) == batched.rows == 21  # the truncated record left out
    assert (
        tmp_path / "batched" / "conversations_roundtrip.jsonl"
    ).read_bytes() == one_row_at_a_time(s, trips[1], rows)
    trip = lines(tmp_path / "batched" / "conversations_roundtrip.jsonl")
    differ = {t["id"] for t in trip if not t["identical"]}
    assert split_rows(s) <= differ
    if family == "kimi":  # every other row gives the model's ids back; these differ in their output
        assert differ == split_rows(s)
        assert all(
            t["first_difference"] > s.written[t["id"]].prompt_tokens
            for t in trip
            if t["id"] in differ
        )
    identical = 21 - len(differ)
    assert (batched.roundtrip_rows, batched.roundtrip_identical, batched.roundtrip_sample) == (
        21,
        identical,
        None,
    )
    assert (single.roundtrip_rows, single.roundtrip_identical) == (21, identical)


def test_check_sample_checks_one_row_in_every_planned_over_n_and_says_so(
    tmp_path, toy_tokenizer, capsys
):
    s = conversations_run(tmp_path / "run", toy_tokenizer, "kimi")
    full = export_run(s.root, "conversations", tmp_path / "full.jsonl")
    every_row = lines(tmp_path / "full_roundtrip.jsonl")
    capsys.readouterr()
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "conversations",
                "--check-sample",
                "5",
                "-o",
                str(tmp_path / "sample.jsonl"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "sample_summary.json").read_text())
    sampled = lines(tmp_path / "sample_roundtrip.jsonl")
    # 22 planned, about 5 asked: one row in ceil(22 / 5) = 5 of the 21 written, the first of each five
    assert sampled == every_row[::5] and len(sampled) == 5
    assert (tmp_path / "sample.jsonl").read_bytes() == (tmp_path / "full.jsonl").read_bytes()
    identical = sum(t["identical"] for t in sampled)
    assert {t["id"] for t in sampled if not t["identical"]} == {
        t["id"] for t in sampled
    } & split_rows(s)
    assert (
        summary["roundtrip_rows"],
        summary["roundtrip_identical"],
        summary["roundtrip_sample"],
    ) == (5, identical, 5)
    assert full.roundtrip_rows == 21 and full.roundtrip_sample is None
    assert (
        f"{identical} of 5 rows give the model's exact ids, 1 differ" in printed
        and "rows checked: 5 of 21 (--check-sample)" in printed
    )
    assert (
        cli_main(
            [
                "export",
                str(s.root),
                "--format",
                "conversations",
                "--check-sample",
                "100",
                "-o",
                str(tmp_path / "all.jsonl"),
            ]
        )
        == 0
    )
    assert (tmp_path / "all_roundtrip.jsonl").read_bytes() == (
        tmp_path / "full_roundtrip.jsonl"
    ).read_bytes()


@pytest.mark.parametrize(
    "args, why",
    [
        (["--format", "conversations", "--check-sample", "0"], "1 or more"),
        (["--format", "jsonl", "--check-sample", "5"], "conversations export"),
    ],
)
def test_a_check_sample_that_cannot_be_taken_is_refused_before_anything_is_written(
    tmp_path, toy_tokenizer, capsys, args, why
):
    s = runs.plan_run(tmp_path / "run", toy_tokenizer("kimi"), datasets={"math": 3}, shards=1)
    runs.write_run(s, runs.healthy())
    merge_and_audit(s.root)
    capsys.readouterr()
    assert cli_main(["export", str(s.root), *args, "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--check-sample" in err and why in err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("name", ["deepseek-r1-distill", "kimi-k2-thinking", "qwen3", "glm-4.6"])
def test_the_byte_table_decodes_what_the_tokenizer_decodes(real_tokenizer, name):
    """Every id of the vocabulary, in random runs (partial UTF-8 sequences, control tokens between them)."""
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(real_tokenizer(name))._tokenizer
    decode = export_text._byte_table(backend)
    assert decode is not None
    rng = np.random.default_rng(7)
    size = backend.get_vocab_size(with_added_tokens=True)
    seqs = [rng.permutation(size).tolist()] + rng.integers(0, size, (300, 64)).tolist() + [[]]
    assert decode(seqs) == backend.decode_batch(seqs, skip_special_tokens=False)
    assert decode([[size + 5, 1]]) == backend.decode_batch(
        [[size + 5, 1]], skip_special_tokens=False
    )


def test_a_byte_table_that_would_decode_otherwise_is_not_used(real_tokenizer, monkeypatch):
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(real_tokenizer("qwen3"))._tokenizer
    right = export_text._byte_values()
    wrong = {c: {ord("a"): ord("b"), ord("b"): ord("a")}.get(b, b) for c, b in right.items()}
    monkeypatch.setattr(export_text, "_byte_values", lambda: wrong)
    assert export_text._byte_table(backend) is None


def test_the_text_is_the_same_whether_the_byte_table_or_the_tokenizer_decodes_it(
    tmp_path, toy_tokenizer, monkeypatch
):
    """Many cores: `decode_batch` on all of them; few: the byte table. The jsonl, parquet and conversations exports
    are the same bytes either way."""
    s = conversations_run(tmp_path / "run", toy_tokenizer, "deepseek")
    for many in (False, True):
        monkeypatch.setattr(export_text, "TABLE_CORES", 0 if many else 10_000)
        d = tmp_path / str(many)
        d.mkdir()
        decoder = export_text._batch_decoder(s.tok)
        assert (
            getattr(decoder, "__name__", "") == "decode"
        ) is not many  # the table's own function, or not
        for fmt, name in (
            ("jsonl", "out.jsonl"),
            ("parquet", "out.parquet"),
            ("conversations", "conv.jsonl"),
        ):
            export_run(s.root, fmt, d / name)
    for name in ("out.jsonl", "out.parquet", "conv.jsonl", "conv_roundtrip.jsonl"):
        assert (tmp_path / "False" / name).read_bytes() == (
            tmp_path / "True" / name
        ).read_bytes(), name
    assert lines(tmp_path / "True" / "out.jsonl")[0]["reasoning"]
