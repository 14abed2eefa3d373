"""Audit: the seed's bug fails loudly, a healthy run passes, each planted fault fails its own check, the reports."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

import runs
from jobfiles import make_job
from toolkit.cli import main as cli_main
from toolkit.dataset.audit import AuditReport, audit_run
from toolkit.dataset.finish import AuditFailed, merge_and_audit
from toolkit.formats.records import Record, pack_ids, unpack_ids


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def report(s: runs.Synth) -> AuditReport:
    return msgspec.json.decode((s.rd.merged_dir / "audit.json").read_bytes(), type=AuditReport)


def failing(r: AuditReport) -> set[str]:
    return {c.name for c in r.checks if not c.passed}


def check(r: AuditReport, name: str):
    return next(c for c in r.checks if c.name == name)


# ---------------------------------------------------------------------------------------------------
def test_the_seed_bug_fails_the_audit_with_the_reasoning_message(tmp_path, kimi, capsys):
    """Outputs that stop normally without any think-end: the reasoning would sit in the content, silently."""
    s = runs.plan_run(tmp_path, kimi)
    runs.write_run(s, runs.no_think_end)
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    out = " ".join(capsys.readouterr().out.split())  # the terminal table wraps long messages
    r = report(s)
    assert not r.passed and failing(r) == {"think_end_share", "stop_without_think_end"}
    c = check(r, "stop_without_think_end")
    assert c.value == 1.0 and c.limit == 0.01
    te = s.info.think_end_id
    for words in (
        f"18 of 18 outputs that ended with a stop token have no think-end id {te} ('</think>')",
        "the reasoning sits in the content",
        "The chat template opens reasoning",
        "chat_template_kwargs",
        "[model] think_end",
        "server flags",
        "stop_token_ids",
    ):
        assert words in c.message, words
    assert (
        "audit of run synthetic-kimi" in out
        and ": FAILED" in out
        and "FAIL stop_without_think_end" in out
    )
    assert "the reasoning sits in the content" in out


def test_audit_json_reads_back_typed_without_the_auditor(tmp_path, kimi):
    from toolkit.dataset.audit_report import read_report

    s = runs.plan_run(tmp_path, kimi, datasets={"math": 6}, shards=2)
    runs.write_run(s, failed=[])
    assert read_report(s.rd) is None
    assert merge_and_audit(s.root).passed
    r = read_report(s.rd)
    assert r == report(s) and r.passed and r.files["json"] == str(s.rd.audit_json)


@pytest.mark.parametrize("family", ["kimi", "qwen3"])
def test_a_healthy_run_passes_with_exact_statistics(tmp_path, toy_tokenizer, family, capsys):
    s = runs.plan_run(
        tmp_path, toy_tokenizer(family), family, datasets={"math": 12, "chat": 9}, shards=3
    )
    written = runs.write_run(s, failed=[])
    assert merge_and_audit(s.root).passed
    r = report(s)
    assert (
        r.passed
        and failing(r) == set()
        and (r.planned, r.present, r.ok, r.missing) == (21, 21, 21, 0)
    )
    assert ": PASSED" in capsys.readouterr().out
    # The template opens reasoning for kimi; qwen3's model writes <think> itself (excluded from the reasoning).
    assert r.tokens.template_opens_reasoning == (family == "kimi")
    assert r.overall.reasoning.opened_by_template == (21 if family == "kimi" else 0)
    for d in r.datasets:
        recs = [x for x in written.values() if x.dataset == d.name]
        out_len = np.array([x.n_output for x in recs])
        assert (
            d.ok == len(recs)
            and d.output_tokens == out_len.sum()
            and d.output_len.max == out_len.max()
        )
        assert d.output_len.p50 == int(np.percentile(out_len, 50, method="inverted_cdf"))
        assert d.prompt_tokens == sum(x.n_prompt for x in recs)
        assert d.cached_tokens == sum(x.cached_tokens for x in recs) > 0
        head = 0 if family == "kimi" else 1
        assert d.reasoning_len.total == sum(x.reasoning_end - head for x in recs)
        assert d.content_len.total == sum(
            x.n_output - x.reasoning_end - 2 for x in recs
        )  # think-end and eos excluded
        assert d.finish == {"stop": len(recs)} and d.reasoning.think_end == len(recs)
        assert sum(d.histograms["output"].counts) == len(recs)
    assert [x.records for x in r.shards] == [sp.count for sp in s.plan.shards]
    assert r.reprompt.sampled == 21 and r.reprompt.mismatched == 0


def test_a_run_whose_template_closed_reasoning_fails_and_names_the_kwarg(tmp_path, kimi):
    """thinking = false closes reasoning in the prompt: the outputs hold none, and that must not pass."""
    s = runs.plan_run(tmp_path, kimi, model={"chat_template_kwargs": {"thinking": False}})
    runs.write_run(s, lambda s, pos, rng: runs.Out(s.text(rng, 50) + [s.eos], "stop", s.eos))
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    r = report(s)
    assert r.overall.reasoning.closed_by_template == 18 and r.overall.reasoning.expected == 0
    assert "reasoning_mode" in failing(r) and "think_end_share" in failing(r)
    c = check(r, "reasoning_mode")
    for words in (
        "18 of 18 ok outputs",
        "CLOSED reasoning",
        "chat_template_kwargs = { thinking = true }",
        "expect_reasoning = false",
        "No ok output is in reasoning mode",
    ):
        assert words in c.message, words


def test_non_thinking_data_passes_with_expect_reasoning_false(tmp_path, kimi):
    s = runs.plan_run(
        tmp_path,
        kimi,
        model={"chat_template_kwargs": {"thinking": False}, "expect_reasoning": False},
    )
    runs.write_run(s, lambda s, pos, rng: runs.Out(s.text(rng, 50) + [s.eos], "stop", s.eos))
    assert merge_and_audit(s.root).passed
    r = report(s)
    names = {c.name for c in r.checks}
    assert "no_reasoning" in names and not names & {
        "reasoning_mode",
        "think_end_share",
        "stop_without_think_end",
    }
    assert check(r, "no_reasoning").value == 0.0


def test_expect_reasoning_false_fails_when_outputs_hold_think_tokens(tmp_path, kimi):
    s = runs.plan_run(
        tmp_path,
        kimi,
        model={"chat_template_kwargs": {"thinking": False}, "expect_reasoning": False},
    )
    runs.write_run(
        s,
        runs.mix(
            lambda s, pos, rng: runs.Out(s.text(rng, 50) + [s.eos], "stop", s.eos),
            p3=lambda s, pos, rng: runs.Out(
                [s.info.think_start_id, *s.text(rng, 20), s.info.think_end_id, s.eos], "stop", s.eos
            ),
        ),
    )
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    r = report(s)
    assert failing(r) == {"no_reasoning"} and r.overall.reasoning.think_tokens == 1
    c = check(r, "no_reasoning")
    assert "1 of 18 ok outputs hold a think token" in c.message and "thinking = false" in c.message


def test_no_vacuous_audit_when_no_output_is_in_reasoning_mode(tmp_path, toy_tokenizer):
    """A template where the model opens <think> itself (qwen3) and a model that never does: 0 of N is a failure,
    not '0 of 0 ok outputs in reasoning mode (100%)'."""
    s = runs.plan_run(tmp_path, toy_tokenizer("qwen3"), "qwen3")
    runs.write_run(s, lambda s, pos, rng: runs.Out(s.text(rng, 50), "length", None))
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    r = report(s)
    rc = r.overall.reasoning
    assert (rc.mode_model_opens, rc.in_reasoning, rc.expected) == (18, 0, 18)
    assert {"reasoning_mode", "think_end_share"} <= failing(r)
    assert (
        "No ok output is in reasoning mode (18 opened by the model itself)"
        in check(r, "reasoning_mode").message
    )


def test_outputs_are_counted_per_reasoning_mode(tmp_path, toy_tokenizer):
    for family, field in (("kimi", "mode_opened"), ("qwen3", "mode_model_opens")):
        s = runs.plan_run(tmp_path / family, toy_tokenizer(family), family)
        runs.write_run(s)
        assert merge_and_audit(s.root).passed
        r = report(s)
        rc = r.overall.reasoning
        assert (
            getattr(rc, field) == 18 == rc.in_reasoning == rc.expected
            and rc.closed_by_template == 0
        )
        assert check(r, "reasoning_mode").passed
        raw = json.loads((s.rd.merged_dir / "audit.json").read_text())
        assert raw["overall"]["reasoning"][field] == 18


def test_nan_stops_fail_their_own_check(tmp_path, kimi):
    """SGLang's NaN stop: an ok record from an older run, and a failed record of kind nan, both counted."""
    from toolkit.formats.records import NAN_MATCHED

    s = runs.plan_run(tmp_path, kimi)
    healthy = runs.healthy()

    def nan_out(s, pos, rng):
        out = healthy(s, pos, rng)
        return runs.Out(out.ids, "stop", NAN_MATCHED)

    def plant(rec):
        if rec.index == 5:
            return msgspec.structs.replace(
                rec, failure="nan", error="SGLang stopped it on NaN logits"
            )
        return rec

    runs.write_run(s, runs.mix(healthy, p2=nan_out), failed=[5], edit=plant)
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    r = report(s)
    assert "nan_stop" in failing(r)
    c = check(r, "nan_stop")
    assert (
        c.value == 2 and r.overall.reasoning.nan_stops == 1 and r.overall.reasoning.nan_failed == 1
    )
    assert "NaN logits" in c.message and "toolkit retry" in c.message


# ---------------------------------------------------------------------------------------------------
# one planted fault -> its check fails, and only it
# ---------------------------------------------------------------------------------------------------
def _content_truncated(s, pos, rng):
    return runs.Out([*s.text(rng, 60), s.info.think_end_id, *s.text(rng, 40)], "length", None)


def _double_start(s, pos, rng):
    return runs.Out(
        [s.info.think_start_id, *s.text(rng, 60), s.info.think_end_id, *s.text(rng, 20), s.eos],
        "stop",
        s.eos,
    )


def _empty_content(s, pos, rng):
    return runs.Out([*s.text(rng, 60), s.info.think_end_id, s.eos], "stop", s.eos)


def _empty_reasoning(s, pos, rng):
    return runs.Out([s.info.think_end_id, *s.text(rng, 30), s.eos], "stop", s.eos)


def _edit_at(pos: int, **changes):
    return lambda r: msgspec.structs.replace(r, **changes) if r.index == pos else r


def _other_prompt(r: Record) -> Record:
    ids = unpack_ids(r.prompt_ids)
    ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % 3000
    return msgspec.structs.replace(r, prompt_ids=pack_ids(ids))


def _stop_not_last(r: Record) -> Record:
    return (
        msgspec.structs.replace(
            r, output_ids=r.output_ids[:-4], completion_tokens=r.completion_tokens - 1
        )
        if r.index == 3
        else r
    )


FAULTS = {
    # name: (outputs, edit, failed positions, the only failing check, words of its message)
    "truncation": (
        runs.mix(runs.healthy(), **{f"p{p}": _content_truncated for p in range(1, 18, 2)}),
        None,
        (),
        "length_share",
        "raise max_new_tokens",
    ),
    "double_think_start": (_double_start, None, (), "double_think_start", "opens it again"),
    "empty_content": (_empty_content, None, (), "empty_content", "the answer after the think-end"),
    "empty_reasoning": (_empty_reasoning, None, (), "empty_reasoning", "closes reasoning at once"),
    "completion_tokens": (
        None,
        lambda r: _edit_at(4, completion_tokens=r.completion_tokens + 1)(r),
        (),
        "token_counts",
        "completion_tokens != len(output_ids)",
    ),
    "stop_not_last": (
        None,
        _stop_not_last,
        (),
        "stop_tokens",
        "matched id is not the last output id",
    ),
    "prompt_changed": (
        None,
        _other_prompt,
        (),
        "prompt_rerender",
        "render to other ids than those stored",
    ),
    "split": (
        None,
        lambda r: _edit_at(5, reasoning_end=(r.reasoning_end or 0) + 1)(r),
        (),
        "reasoning_split",
        "not the first think-end",
    ),
    "vocab": (
        None,
        lambda r: _edit_at(
            6,
            output_ids=pack_ids([70000]) + r.output_ids,
            completion_tokens=r.completion_tokens + 1,
            reasoning_end=(r.reasoning_end or 0) + 1,
        )(r),
        (),
        "vocabulary",
        "outside the tokenizer",
    ),
    "failures": (None, None, (2, 9), "failed_share", "2 of 18 prompts failed"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_fails_its_own_check(tmp_path, kimi, fault):
    outputs, edit, failed, name, words = FAULTS[fault]
    s = runs.plan_run(tmp_path, kimi)
    runs.write_run(s, outputs, edit=edit, failed=failed)
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    r = report(s)
    assert failing(r) == {name}
    assert words in check(r, name).message
    if fault == "truncation":  # per dataset: the truncated records are all in one dataset
        by = {d.name: d.length_share for d in r.datasets}
        assert max(by.values()) > 0.2 and "dataset" in check(r, name).message
    if fault == "failures":
        assert (s.rd.merged_dir / "failed_ids.txt").read_text().split() == [
            s.refs[2].id,
            s.refs[9].id,
        ]
        # counted by failure kind, shown with one real message (not folded into "server error N: boom")
        assert r.overall.errors == {"rejected": 2}
        assert r.overall.error_examples == {"rejected": "server error 500: boom"}
        assert "rejected (2); e.g. 'server error 500: boom'" in check(r, name).message


# ---------------------------------------------------------------------------------------------------
# the command, the report files, the browser
# ---------------------------------------------------------------------------------------------------
def test_audit_command_reads_the_merged_dataset(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi)
    runs.write_run(s)
    assert cli_main(["audit", str(s.root)]) == 2  # nothing merged yet
    assert f"toolkit merge {s.root}" in capsys.readouterr().err
    assert cli_main(["merge", str(s.root), "--no-audit"]) == 0
    assert cli_main(["audit", str(s.root)]) == 0
    first = report(s)
    assert (
        first.passed and json.loads((s.rd.merged_dir / "audit.json").read_text())["passed"] is True
    )
    # The merged file changed after the merge: the audit says so.
    merged = s.rd.merged_dir / "records.zst"
    merged.write_bytes(merged.read_bytes() + b"\0")
    assert cli_main(["audit", str(s.root)]) == 1
    assert "merged_file" in failing(audit_run(s.root))


def _png_rows(path: Path) -> tuple[int, int, np.ndarray]:
    """Width, height and the filtered scanlines of a PNG (8-bit RGB or RGBA), read with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            channels = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * channels + 1)
    return width, height, rows[:, 1:]


def test_sample_outputs_are_the_first_in_planned_order_each_beside_its_prompt(tmp_path, kimi):
    import json

    from toolkit.dataset.examples import SAMPLES, shorten

    s = runs.plan_run(tmp_path, kimi, datasets={"math": 24}, shards=2)
    runs.write_run(
        s, window=24
    )  # each shard's records written in an order far from the planned one
    order = [r.index for r in read_merged_in_file_order(s)]
    assert order != sorted(order), "the shards' files hold their records out of planned order"
    merge_and_audit(s.root)
    shown = report(s).samples[0].outputs
    assert [o.id for o in shown] == [s.refs[i].id for i in range(SAMPLES)]
    for o, i in zip(shown, range(SAMPLES)):
        line = (tmp_path / "math.jsonl").read_text().splitlines()[s.refs[i].line - 1]
        assert o.prompt == shorten(json.loads(line)["messages"][-1]["content"])


def read_merged_in_file_order(s: runs.Synth):
    from toolkit.formats.frames import read_shard

    return [r for sp in s.plan.shards for r in read_shard(s.rd.shard_file(sp.index))]


@pytest.mark.slow
def test_audit_html_renders_in_a_headless_browser(tmp_path, kimi):
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(chromium).exists(), (
        "install Chromium: tests/install-browser.sh (apt-get install chromium)"
    )
    s = runs.plan_run(tmp_path, kimi, shards=3, sampling={"max_new_tokens": 600})
    markup = '<script>alert("x")</script> <b>bold</b> & co'
    first = next(
        i for i, r in enumerate(s.refs) if r.dataset == 0
    )  # planned first: shown as a sample

    def with_markup(s, pos, rng):
        ids = s.tok(markup, add_special_tokens=False)["input_ids"]
        return runs.Out(
            [*ids, *s.text(rng, 30), s.info.think_end_id, *s.text(rng, 20), s.eos], "stop", s.eos
        )

    runs.write_run(
        s, runs.mix(runs.healthy(), p4=runs.no_think_end, **{f"p{first}": with_markup}), failed=[7]
    )
    with pytest.raises(AuditFailed):  # the audit fails, and its reports are written
        merge_and_audit(s.root)
    page = s.rd.merged_dir / "audit.html"
    assert b"http://" not in page.read_bytes().replace(
        b"http://www.w3.org/2000/svg", b""
    )  # self-contained
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60
    ).stdout
    # Tables are built by the page's script: present in the DOM only if it ran.
    shards = dom.split('<table id="shards">')[1].split("</table>")[0]
    assert shards.count("<tr") == 1 + 3 and "<td>6</td>" in shards
    checks = dom.split('<table id="checks">')[1].split("</table>")[0]
    assert (
        checks.count('<tr class="bad">') == 2 and "stop_without_think_end" in checks
    )  # 1 of 17: over 1 %
    assert dom.count("<svg") == 9  # output / reasoning / content histograms for math, chat and all
    modes = dom.split('<table id="modes">')[1].split("</table>")[0]
    assert "opened by the template" in modes and modes.count("<tr") == 2
    # Histograms: axes with ticks, one x scale per column across datasets, max_new_tokens marked on the outputs.
    svgs = re.findall(r'<svg [^>]*data-xmax="(\d+)" data-kind="(\w+)">(.*?)</svg>', dom, re.S)
    assert sorted(k for _, k, _ in svgs) == ["content"] * 3 + ["output"] * 3 + ["reasoning"] * 3
    for kind in ("output", "reasoning", "content"):
        assert len({x for x, k, _ in svgs if k == kind}) == 1, f"one shared x scale for {kind}"
    for xmax, kind, body in svgs:
        assert (
            len(re.findall(r'class="xtick">', body)) >= 4
            and len(re.findall(r'class="ytick">', body)) >= 2
        )
        assert ">tokens</text>" in body and ">count</text>" in body
        assert ('class="limit">max_new_tokens 600</text>' in body) == (kind == "output")
        if kind == "output":
            assert int(xmax) >= 600
    # Sample outputs: the split, the think-end and the stop token shown, the model's text escaped.
    samples = dom.split('<div id="samples">')[1].split("<h2>")[0]
    assert samples.count('<div class="sample">') == 6  # 3 per dataset
    te = s.info.think_end_id
    assert (
        f"&lt;/think&gt;  id {te}</span>" in samples
        and f"no think-end (id {te}) in this output" in samples
    )
    assert f"&lt;|im_end|&gt;  id {s.eos} · finish stop" in samples
    assert (
        'alert("x")' in samples
        and "&lt;script&gt;alert" in samples
        and "&lt;b&gt;bold&lt;/b&gt; &amp; co" in samples
    )
    assert samples.count('<div class="part prompt">') == 6 and "last user message" in samples
    assert dom.count("<script") == 2, "only the page's own scripts"
    # Failures: counted by kind, shown with a real message.
    failures = dom.split('<table id="failures">')[1].split("</table>")[0]
    assert (
        ">rejected<" in failures
        and "server error 500: boom" in failures
        and "server error N" not in failures
    )
    png = tmp_path / "audit.png"
    subprocess.run(
        [chromium, *flags, f"--screenshot={png}", "--window-size=1200,1600", page.as_uri()],
        capture_output=True,
        timeout=60,
        check=True,
    )
    width, height, rows = _png_rows(png)
    assert (width, height) == (1200, 1600)
    # A blank page filters to constant scanlines (all 0 after a Sub/Up/Paeth filter, all 255 unfiltered).
    varied = (rows.min(axis=1) != rows.max(axis=1)).mean()
    assert varied > 0.3, f"only {varied:.0%} of the screenshot's rows hold anything"


# ---------------------------------------------------------------------------------------------------
# end to end: the stub engine plays the seed's bug
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_toolkit_run_with_a_stub_that_never_closes_reasoning_fails_the_audit(
    tmp_path, kimi, capsys
):
    job = make_job(
        tmp_path,
        kimi,
        n=8,
        shards=2,
        model={"path": str(kimi), "chat_template_kwargs": {"thinking": True}},
        stub={"no_think_end": True},
        sampling={"max_new_tokens": 96},
    )
    assert cli_main(["run", str(job)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL stop_without_think_end" in out and "the reasoning sits in the content" in out
    audit = json.loads((tmp_path / "run" / "merged" / "audit.json").read_text())
    assert audit["passed"] is False and audit["ok"] == 8 and audit["missing"] == 0


_BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _dom(page: Path, profile: Path) -> str:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(chromium).exists(), (
        "install Chromium: tests/install-browser.sh (apt-get install chromium)"
    )
    return subprocess.run(
        [chromium, *_BROWSER_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


@pytest.mark.slow
def test_audit_html_rounds_shares_as_the_terminal_does_and_says_the_engine_was_the_stub(
    tmp_path, kimi
):
    """1 of 16 outputs cut by max_new_tokens is 6.25 %: the terminal says 6.2 % (Python rounds an exact tie to
    the even digit), and so must the page (JavaScript's toFixed said 6.3 %). The page's rounding, run in the
    browser over shares with exact ties and without, matches Python's for every one; and a run of the stub says
    so on the page and in the terminal summary."""
    from importlib.resources import files

    from toolkit.dataset.report import _pct, summary_table

    s = runs.plan_run(
        tmp_path / "a",
        kimi,
        datasets={"math": 16},
        shards=1,
        sampling={"max_new_tokens": 600},
        audit={"max_length_share": 0.5},
    )
    runs.write_run(s, runs.mix(runs.healthy(), p3=runs.truncated))
    merge_and_audit(s.root)
    rep = report(s)
    assert rep.engine == "stub" and rep.datasets[0].length_share == 1 / 16
    terminal = summary_table(rep)
    row = next(x for x in terminal.splitlines() if x.startswith("math "))
    assert row.endswith(" 6.2%") and "engine: the STUB" in terminal and "NOT a model" in terminal, (
        terminal
    )
    dom = _dom(s.rd.merged_dir / "audit.html", tmp_path / "profile")
    row = dom.split('<table id="datasets">')[1].split("</table>")[0].split("<tr>")[2]
    assert "<td>6.2%</td>" in row and "6.3%" not in row, row
    engine = re.search(r'<p id="engine"[^>]*>(.*?)</p>', dom)
    assert engine and "STUB" in engine.group(1) and "NOT a model" in engine.group(1)

    # The same rounding function over many shares, ties (k/16, k/32, k/1000 ...) and not.
    script = files("toolkit.dataset").joinpath("templates/audit.js").read_text()
    fixed1 = re.search(r"^const fixed1 = .*?^};$", script, re.S | re.M).group(0)
    shares = sorted(
        {k / d for d in (8, 16, 32, 40, 64, 200, 400, 1000, 2000, 3, 7, 9) for k in range(d + 1)}
    )
    page = tmp_path / "round.html"
    page.write_text(
        f"<!DOCTYPE html><html><body><pre id='out'></pre><script>{fixed1}\n"
        f"document.getElementById('out').textContent = {json.dumps(shares)}"
        ".map(x => fixed1(100 * x) + '%').join('\\n');</script></body></html>"
    )
    got = (
        re.search(r"<pre id=\"out\">(.*?)</pre>", _dom(page, tmp_path / "profile2"), re.S)
        .group(1)
        .split("\n")
    )
    want = [_pct(x) for x in shares]
    assert (
        len(got) == len(want) and [(x, g, w) for x, g, w in zip(shares, got, want) if g != w] == []
    )
