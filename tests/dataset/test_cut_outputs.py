"""Outputs cut by max_new_tokens are the model's own tokens: the drafters' export (`tokens`) keeps them, masked over
every id the model wrote and nothing added, unless `--exclude truncated`; loops and NaN stops stay out with their
reason, and chat rows leave cut outputs out (the template would close the turn). The audit says what share of the
decoded tokens reaches the training export and why the rest does not: checked here against the records themselves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobfiles import make_job, prepared_run
from toolkit import read_run, unpack_ids
from toolkit.cli import main as cli_main
from toolkit.dataset.export import Selection, export_run
from toolkit.formats.loops import repetition_loop
from toolkit.formats.records import NAN_MATCHED


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory, toy_tokenizer):
    """A stub run whose outputs are drawn as shares of 100 tokens and cut at 64 (about a third of them), a fifth of
    them in a repetition loop, every 9th request a NaN stop (sent again, perhaps failing for good)."""
    tmp = tmp_path_factory.mktemp("cut")
    job = make_job(
        tmp,
        toy_tokenizer("kimi"),
        n=40,
        sampling={"max_new_tokens": 64},
        stub={"output_scale": 100, "degenerate_fraction": 0.2, "nan_every": 9},
        client={
            "concurrency": 4,
            "request_timeout_s": 30,
            "retries": 1,
            "backoff_s": 0.01,
            "backoff_max_s": 0.02,
            "max_tries": 2,
        },
        audit={
            "max_length_share": 1.0,
            "max_degenerate_share": 1.0,
            "min_think_end_share": 0.0,
            "max_failed_share": 1.0,
        },
    )
    assert cli_main(["run", str(job)]) in (0, 1)
    rd, _ = prepared_run(job)
    return rd.root


def kinds(root: Path) -> dict[str, set[str]]:
    """The records by what they are, decided here from their ids and finish: cut (by max_new_tokens, no loop),
    looped (a repetition loop), nan (NaN stop or failed on it), failed (other failures), stopped."""
    out: dict[str, set[str]] = {k: set() for k in ("cut", "looped", "nan", "failed", "stopped")}
    for r in read_run(root):
        if r.status != "ok":
            out["nan" if r.failure == "nan" else "failed"].add(r.id)
        elif r.matched_stop == NAN_MATCHED:
            out["nan"].add(r.id)
        elif r.finish == "length":
            loop = repetition_loop(np.frombuffer(r.output_ids, "<u4"))
            out["looped" if loop is not None else "cut"].add(r.id)
        else:
            out["stopped"].add(r.id)
    return out


@pytest.mark.slow
def test_the_tokens_export_keeps_cut_outputs_masked_whole_and_leaves_loops_out(cut_run, tmp_path):
    root = cut_run
    k = kinds(root)
    assert len(k["cut"]) >= 3 and len(k["looped"]) >= 2  # the run has both to tell apart
    stored = {r.id: (unpack_ids(r.prompt_ids), unpack_ids(r.output_ids)) for r in read_run(root)}
    out = tmp_path / "tokens.jsonl"
    summary = export_run(root, output=out)  # the default format: the drafters'
    rows = {row["id"]: row for row in lines(out)}
    skipped = {x["id"]: x["reason"] for x in lines(tmp_path / "tokens_skipped.jsonl")}
    assert k["cut"] <= set(rows) and summary.kept_by_reason == {"truncated": len(k["cut"])}
    for i in k["cut"]:
        prompt, output = stored[i]
        row = rows[i]
        # the model's ids as it wrote them, nothing appended (no stop token, no think-end), every output id supervised
        assert row["input_ids"] == prompt + output and len(output) == 64
        assert row["loss_mask"][len(prompt) :] == [1] * len(output) and len(
            row["loss_mask"]
        ) == len(row["input_ids"])
        assert row["input_ids"][-1] == output[-1]
    for trainer in (
        "specforge",
        "speculators",
    ):  # both trainers' masks: the output whole, the prompt's head not
        t = tmp_path / f"t-{trainer}.jsonl"
        export_run(root, output=t, trainer=trainer)
        for row in lines(t):
            if row["id"] in k["cut"]:
                n = len(stored[row["id"]][0])
                assert row["loss_mask"][n:] == [1] * 64 and row["loss_mask"][0] == 0
    # loops, NaN stops and failures stay out, each with its reason
    assert not (k["looped"] | k["nan"] | k["failed"]) & set(rows)
    assert all(skipped[i] == "degenerate" for i in k["looped"]) and all(
        skipped[i] == "nan" for i in k["nan"]
    )
    # --exclude truncated (the CLI) leaves the cut ones out, named
    assert (
        cli_main(["export", str(root), "-o", str(tmp_path / "x.jsonl"), "--exclude", "truncated"])
        == 0
    )
    assert not k["cut"] & {row["id"] for row in lines(tmp_path / "x.jsonl")}
    assert {
        i
        for i, why in ((x["id"], x["reason"]) for x in lines(tmp_path / "x_skipped.jsonl"))
        if why == "truncated"
    } == k["cut"]
    # chat rows cannot hold a cut output (the template would close its turn): left out, named
    conv = export_run(root, "conversations", tmp_path / "c.jsonl")
    assert conv.skipped_by_reason.get("truncated") == len(k["cut"])
    assert {
        x["id"] for x in lines(tmp_path / "c_skipped.jsonl") if x["reason"] == "truncated"
    } == k["cut"]
    # kept there only when asked, and then said
    asked = export_run(
        root,
        "conversations",
        tmp_path / "c2.jsonl",
        select=Selection(include=frozenset({"truncated"})),
    )
    assert any(
        "closes their turn with an end of turn the model never wrote" in w for w in asked.warnings
    )


@pytest.mark.slow
def test_the_audit_says_the_share_of_decoded_tokens_the_training_export_holds_and_why_not_the_rest(
    cut_run, tmp_path, capsys
):
    root = cut_run
    k = kinds(root)
    n_out = {r.id: len(r.output_ids) // 4 for r in read_run(root)}
    decoded = sum(n_out.values())
    out = tmp_path / "tokens.jsonl"
    export_run(root, output=out)
    exported = sum(n_out[row["id"]] for row in lines(out))
    capsys.readouterr()
    assert cli_main(["audit", str(root)]) in (0, 1)
    printed = capsys.readouterr().out
    t = json.loads((Path(root) / "merged" / "audit.json").read_text())["training"]
    assert (t["decoded_tokens"], t["exported_tokens"]) == (decoded, exported)
    assert t["share"] == round(exported / decoded, 6) and 0 < t["share"] < 1
    assert (t["cut_tokens"], t["cut_records"]) == (sum(n_out[i] for i in k["cut"]), len(k["cut"]))
    assert t["left_out_tokens"]["degenerate"] == sum(n_out[i] for i in k["looped"])
    assert t["left_out_records"]["degenerate"] == len(k["looped"])
    assert t["left_out_records"].get("nan", 0) == len(k["nan"]) and t["left_out_records"].get(
        "failed", 0
    ) == len(k["failed"])
    left = sum(t["left_out_tokens"].values())
    assert exported + left == decoded  # every decoded token is in the export or named
    assert f"training export (tokens): {100 * exported / decoded:.1f}% of " in printed
    assert f"({100 * t['cut_tokens'] / decoded:.1f}% cut by max_new_tokens, kept)" in printed
    assert (
        f"degenerate {100 * t['left_out_tokens']['degenerate'] / decoded:.1f}% ({len(k['looped'])} outputs)"
        in printed
    )
