"""Audit reports: `audit.json`, the terminal summary table, and a self-contained `audit.html`.

The HTML page carries its data as JSON and draws the check list, the per-dataset table, length
histograms (inline SVG, one x scale per column shared by the datasets, max_new_tokens marked),
sample outputs (decoded, split at the think-end), failures by kind with a real message each, and the
per-shard table with a small inline script: one file, no network, opens anywhere. The page is a
jinja2 template, `templates/audit.html`, with its style (`audit.css`) and script (`audit.js`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import jinja2
import msgspec

from toolkit.dataset.audit_report import AuditReport, DatasetStats, TrainingShare, modes_text
from toolkit.formats.files import atomic_write, shown_path
from toolkit.formats.rundir import RunDir

__all__ = ["summary_table", "write_html", "write_reports"]

SHARD_ROWS = 16  # shards listed in the terminal table (all of them in the HTML page)
WIDTH = 120  # of the wrapped check messages
PAGE = "audit.html"  # in templates/, with the style (audit.css) and script (audit.js) it includes


def write_reports(rd: RunDir, report: AuditReport) -> tuple[Path, Path]:
    """Write `merged/audit.json` and `merged/audit.html`; return their paths."""
    rd.merged_dir.mkdir(parents=True, exist_ok=True)
    report.files.update(json=str(rd.audit_json), html=str(rd.audit_html))
    atomic_write(rd.audit_json, msgspec.json.format(msgspec.json.encode(report), indent=2))
    write_html(report, rd.audit_html)
    return rd.audit_json, rd.audit_html


# --------------------------------------------------------------------------------------------------
# terminal
# --------------------------------------------------------------------------------------------------
STUB_WORDS = "the STUB: a stand-in for SGLang's protocol, NOT a model; these outputs are synthetic"


def _pct(x: float) -> str:
    # audit.html rounds as this does (its script's fixed1): an exact tie to the even digit, 0.0625
    # -> 6.2%
    return f"{100 * x:.1f}%"


def _num(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _dataset_row(d: DatasetStats) -> list[str]:
    r = d.reasoning
    return [
        d.name,
        str(d.planned),
        str(d.ok),
        str(d.failed),
        str(d.missing),
        _num(d.prompt_tokens),
        _pct(d.cached_tokens / d.prompt_tokens) if d.prompt_tokens else "-",
        _num(d.output_tokens),
        f"{d.output_len.p50}/{d.output_len.p90}/{d.output_len.p99}/{d.output_len.max}",
        str(d.reasoning_len.p50),
        str(d.content_len.p50),
        _pct(r.think_end / r.expected) if r.expected else "-",
        _pct(d.length_share),
    ]


def _shown(path) -> str:
    return shown_path(path) if path else "-"


def _skipped_inputs(report: AuditReport) -> list[str]:
    """The prompt lines the plan left out, per dataset, with the first of them: never silently."""
    out = []
    for s in report.skipped_inputs:
        kinds = [f"{n} {what}" for n, what in ((s.bad_lines, "bad"), (s.too_long, "too long")) if n]
        n = s.bad_lines + s.too_long
        out.append(
            f"inputs skipped in {s.dataset}: {n} line{'s' * (n != 1)} ({', '.join(kinds)}), not "
            "planned" + "".join(f"\n  {e}" for e in s.examples[:3])
        )
    return out


def training_line(t: TrainingShare) -> str:
    """e.g. `training export (tokens): 91.4% of 1.2M decoded output tokens (8.4% cut by
    max_new_tokens, kept); left out: degenerate 8.1% (3 outputs), failed 0.0% (1 record)`."""
    if not t.decoded_tokens and not t.left_out_records:
        return "training export (tokens): no decoded output tokens"
    whole = t.decoded_tokens or 1
    out = (
        f"training export (tokens): {_pct(t.share)} of {_num(t.decoded_tokens)} decoded output "
        f"tokens ({_pct(t.cut_tokens / whole)} cut by max_new_tokens, kept)"
    )
    gone = sorted(t.left_out_records, key=lambda k: (-t.left_out_tokens.get(k, 0), k))
    if gone:
        out += "; left out: " + ", ".join(
            f"{k} {_pct(t.left_out_tokens.get(k, 0) / whole)} ({t.left_out_records[k]} "
            f"{'record' if k == 'failed' else 'output'}{'s' * (t.left_out_records[k] != 1)})"
            for k in gone
        )
    return out


def continued_line(d: DatasetStats) -> str:
    """e.g. `prefix cache of continuations: 99.8% of 1.4M input tokens found (next segments,
    continuations after a stop)`: what the data-parallel ranks' caches kept of the outputs
    continued."""
    if not d.continued_tokens:
        return "prefix cache of continuations: no output was continued"
    return (
        f"prefix cache of continuations: {_pct(d.continued_cached / d.continued_tokens)} of "
        f"{_num(d.continued_tokens)} input tokens found (next segments, continuations after a "
        "stop)"
    )


def summary_table(report: AuditReport) -> str:
    """The audit as a few plain-text tables for a terminal or a job log."""
    lines = _totals_lines(report) + _datasets_lines(report) + _shards_lines(report)
    return "\n".join(lines + _checks_lines(report) + _files_lines(report))


def _totals_lines(report: AuditReport) -> list[str]:
    """The verdict, the run's totals, the inputs the plan left out and the stub's warning."""
    verdict = "PASSED" if report.passed else "FAILED"
    return [
        f"audit of run {report.run} ({report.fingerprint}): {verdict}",
        f"{report.planned} planned, {report.ok} ok, {report.failed} failed, {report.missing} "
        f"missing; {report.duplicates} duplicates kept once, {report.continued} partial outputs "
        f"continued, {report.damaged_frames} damaged frames",
        *_skipped_inputs(report),
        *([f"engine: {STUB_WORDS}"] if report.engine == "stub" else []),
        "",
    ]


def _datasets_lines(report: AuditReport) -> list[str]:
    """One row per dataset (and the run's when there are several), then the run's reasoning modes,
    training share and continuations."""
    head = [
        "dataset",
        "planned",
        "ok",
        "failed",
        "missing",
        "prompt tok",
        "cached",
        "output tok",
        "out p50/p90/p99/max",
        "reason p50",
        "content p50",
        "think-end",
        "length",
    ]
    rows = [head] + [_dataset_row(d) for d in report.datasets]
    if len(report.datasets) > 1:
        rows.append(_dataset_row(report.overall))
    return _table(rows, right=set(range(1, len(head)))) + [
        f"reasoning modes of ok outputs: {modes_text(report.overall.reasoning)}; "
        f"{report.overall.reasoning.in_reasoning} in reasoning mode",
        training_line(report.training),
        continued_line(report.overall),
    ]


def _shards_lines(report: AuditReport) -> list[str]:
    """Every shard, or when there are more than SHARD_ROWS, the first SHARD_ROWS with a problem."""
    shards = report.shards
    shown = (
        shards
        if len(shards) <= SHARD_ROWS
        else [
            s
            for s in shards
            if s.missing or s.damaged_frames or s.duplicates or s.matches_done is False or s.failed
        ][:SHARD_ROWS]
    )
    if not shown:
        return []
    lines = [""]
    if len(shown) < len(shards):
        lines.append(
            f"shards with problems ({len(shown)} shown of {len(shards)}; all in "
            f"{_shown(report.files.get('html', '-'))}):"
        )
    rows = [
        [
            "shard",
            "done",
            "records",
            "ok",
            "failed",
            "missing",
            "dups",
            "damaged",
            "output tok",
            "tok/s",
            "host",
        ]
    ]
    for s in shown:
        rows.append(
            [
                str(s.index),
                "yes" if s.done else "no",
                str(s.records),
                str(s.ok),
                str(s.failed),
                str(s.missing),
                str(s.duplicates),
                str(s.damaged_frames),
                _num(s.output_tokens),
                f"{s.tok_per_s:.0f}" if s.tok_per_s else "-",
                s.host or "-",
            ]
        )
    return lines + _table(rows, right=set(range(1, 10)))


def _checks_lines(report: AuditReport) -> list[str]:
    """Each check, its mark and its message wrapped to WIDTH."""
    lines = ["", "checks:"]
    for c in report.checks:
        mark = "ok  " if c.passed else "FAIL"
        pad = " " * 32
        body = textwrap.wrap(c.message, width=WIDTH, initial_indent=pad, subsequent_indent=pad) or [
            pad
        ]
        lines.append(f"  {mark}  {c.name:<22}  {body[0][32:]}")
        lines += body[1:]
    return lines


def _files_lines(report: AuditReport) -> list[str]:
    """Where the reports and the lists of missing and failed ids are."""
    files = report.files
    lines = [
        "",
        f"report: {_shown(files.get('html', '-'))}  (and {_shown(files.get('json', '-'))})",
    ]
    if report.missing:
        lines.append(f"missing ids: {_shown(files.get('missing_ids'))}")
    if report.failed:
        lines.append(f"failed ids: {_shown(files.get('failed_ids'))}")
    return lines


# --------------------------------------------------------------------------------------------------
# html
# --------------------------------------------------------------------------------------------------
def write_html(report: AuditReport, path: Path) -> None:
    """A single HTML file with inline data, style and script (no network access needed to view
    it)."""
    # "<" only ever occurs inside JSON strings: as \u003c, no text of the run can close or open a
    # tag here.
    data = msgspec.json.encode({**msgspec.to_builtins(report), "stub_words": STUB_WORDS}).decode()
    data = data.replace("<", "\\u003c")
    verdict = "PASSED" if report.passed else "FAILED"
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("toolkit.dataset", "templates"),
        autoescape=True,
        keep_trailing_newline=True,
    )
    page = env.get_template(PAGE).render(run=report.run, verdict=verdict, data=data)
    atomic_write(path, page.encode())
