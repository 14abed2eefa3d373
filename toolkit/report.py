"""Audit reports: `audit.json`, the terminal summary table, and a self-contained `audit.html`.

The HTML page carries its data as JSON and draws the check list, the per-dataset table, length histograms
(inline SVG) and the per-shard table with a small inline script: one file, no network, opens anywhere.
"""

from __future__ import annotations

import html
import textwrap
from pathlib import Path

import msgspec

from .audit import AuditReport, DatasetStats, modes_text
from .files import atomic_write, shown_path
from .plan import RunDir

__all__ = ["summary_table", "write_html", "write_reports"]

JSON_FILE, HTML_FILE = "audit.json", "audit.html"
SHARD_ROWS = 16  # shards listed in the terminal table (all of them in the HTML page)
WIDTH = 120      # of the wrapped check messages


def write_reports(rd: RunDir, report: AuditReport) -> tuple[Path, Path]:
    """Write `merged/audit.json` and `merged/audit.html`; return their paths."""
    out = rd.merged_dir
    out.mkdir(parents=True, exist_ok=True)
    report.files.update(json=str(out / JSON_FILE), html=str(out / HTML_FILE))
    atomic_write(out / JSON_FILE, msgspec.json.format(msgspec.json.encode(report), indent=2))
    write_html(report, out / HTML_FILE)
    return out / JSON_FILE, out / HTML_FILE


# ---------------------------------------------------------------------------------------------------
# terminal
# ---------------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
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
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _dataset_row(d: DatasetStats) -> list[str]:
    r = d.reasoning
    return [
        d.name, str(d.planned), str(d.ok), str(d.failed), str(d.missing), _num(d.prompt_tokens),
        _pct(d.cached_tokens / d.prompt_tokens) if d.prompt_tokens else "-", _num(d.output_tokens),
        f"{d.output_len.p50}/{d.output_len.p90}/{d.output_len.p99}/{d.output_len.max}",
        str(d.reasoning_len.p50), str(d.content_len.p50),
        _pct(r.think_end / r.expected) if r.expected else "-", _pct(d.length_share),
    ]


def _shown(path) -> str:
    return shown_path(path) if path else "-"


def summary_table(report: AuditReport) -> str:
    """The audit as a few plain-text tables for a terminal or a job log."""
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [
        f"audit of run {report.run} ({report.fingerprint}): {verdict}",
        f"{report.planned} planned, {report.ok} ok, {report.failed} failed, {report.missing} missing; "
        f"{report.duplicates} duplicates kept once, {report.damaged_frames} damaged frames",
        "",
    ]
    head = ["dataset", "planned", "ok", "failed", "missing", "prompt tok", "cached", "output tok", "out p50/p90/p99/max",
            "reason p50", "content p50", "think-end", "length"]
    rows = [head] + [_dataset_row(d) for d in report.datasets]
    if len(report.datasets) > 1:
        rows.append(_dataset_row(report.overall))
    lines += _table(rows, right=set(range(1, len(head))))
    lines.append(f"reasoning modes of ok outputs: {modes_text(report.overall.reasoning)}; "
                 f"{report.overall.reasoning.in_reasoning} in reasoning mode")
    shards = report.shards
    shown = shards if len(shards) <= SHARD_ROWS else [
        s for s in shards if s.missing or s.damaged_frames or s.duplicates or s.matches_done is False or s.failed
    ][:SHARD_ROWS]
    if shown:
        lines.append("")
        if len(shown) < len(shards):
            lines.append(f"shards with problems ({len(shown)} shown of {len(shards)}; all in audit.html):")
        rows = [["shard", "done", "records", "ok", "failed", "missing", "dups", "damaged", "output tok", "tok/s", "host"]]
        for s in shown:
            rows.append([
                str(s.index), "yes" if s.done else "no", str(s.records), str(s.ok), str(s.failed), str(s.missing),
                str(s.duplicates), str(s.damaged_frames), _num(s.output_tokens),
                f"{s.tok_per_s:.0f}" if s.tok_per_s else "-", s.host or "-",
            ])
        lines += _table(rows, right=set(range(1, 10)))
    lines += ["", "checks:"]
    for c in report.checks:
        mark = "ok  " if c.passed else "FAIL"
        pad = " " * 32
        body = textwrap.wrap(c.message, width=WIDTH, initial_indent=pad, subsequent_indent=pad) or [pad]
        lines.append(f"  {mark}  {c.name:<22}  {body[0][32:]}")
        lines += body[1:]
    files = report.files
    lines += ["", f"report: {_shown(files.get('html', '-'))}  (and {_shown(files.get('json', 'audit.json'))})"]
    if report.missing:
        lines.append(f"missing ids: {_shown(files.get('missing_ids'))}")
    if report.failed:
        lines.append(f"failed ids: {_shown(files.get('failed_ids'))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# html
# ---------------------------------------------------------------------------------------------------
_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#1d232a;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;color:#fff;font-weight:600}
.pass{background:#1f883d} .fail{background:#cf222e}
table{border-collapse:collapse;margin:6px 0 12px} th,td{padding:4px 10px;border-bottom:1px solid #d8dee4;text-align:right}
th{background:#f6f8fa} td.l,th.l{text-align:left} tr.bad td{background:#ffebe9} td.msg{text-align:left;max-width:760px}
.hists{display:flex;flex-wrap:wrap;gap:18px} .hist{border:1px solid #d8dee4;border-radius:6px;padding:8px}
.hist h3{font-size:13px;margin:0 0 4px} .muted{color:#57606a}
"""

_SCRIPT = r"""
const R = JSON.parse(document.getElementById('audit-data').textContent);
const $ = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
};
const pct = x => (100 * x).toFixed(1) + '%';
function table(id, head, rows, left, bad) {
  const t = $('table', {id});
  t.append($('tr', {}, ...head.map((h, i) => $('th', left.includes(i) ? {class: 'l'} : {}, h))));
  rows.forEach((r, j) => t.append($('tr', bad && bad(j) ? {class: 'bad'} : {},
    ...r.map((c, i) => $('td', left.includes(i) ? {class: i === r.length - 1 && id === 'checks' ? 'msg' : 'l'} : {}, c)))));
  return t;
}
function hist(title, h) {
  const W = 320, H = 120, n = h.counts.length, top = Math.max(1, ...h.counts), bw = W / n;
  const ns = 'http://www.w3.org/2000/svg', svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('width', W); svg.setAttribute('height', H + 18);
  h.counts.forEach((c, i) => {
    const r = document.createElementNS(ns, 'rect'), hh = Math.round(H * c / top);
    r.setAttribute('x', i * bw + 1); r.setAttribute('y', H - hh); r.setAttribute('width', Math.max(1, bw - 2));
    r.setAttribute('height', hh); r.setAttribute('fill', '#0969da');
    const tip = document.createElementNS(ns, 'title');
    tip.textContent = `${h.edges[i]}-${h.edges[i + 1] - 1} tokens: ${c}`; r.append(tip); svg.append(r);
  });
  for (const [x, v, a] of [[0, h.edges[0], 'start'], [W, h.edges[n], 'end']]) {
    const t = document.createElementNS(ns, 'text');
    t.setAttribute('x', x); t.setAttribute('y', H + 14); t.setAttribute('font-size', '11');
    t.setAttribute('text-anchor', a); t.textContent = v; svg.append(t);
  }
  return $('div', {class: 'hist'}, $('h3', {}, title), svg);
}
const main = document.getElementById('main');
main.append($('h1', {}, `Audit of run ${R.run} `, $('span', {class: 'badge ' + (R.passed ? 'pass' : 'fail')}, R.passed ? 'PASSED' : 'FAILED')));
main.append($('div', {class: 'muted'}, `fingerprint ${R.fingerprint} · ${R.created} · ${R.planned} planned, ${R.ok} ok, ` +
  `${R.failed} failed, ${R.missing} missing, ${R.duplicates} duplicates kept once, ${R.damaged_frames} damaged frames`));
main.append($('h2', {}, 'Checks'));
main.append(table('checks', ['', 'check', 'value', 'limit', 'what was seen'],
  R.checks.map(c => [c.passed ? 'ok' : 'FAIL', c.name, c.value === null ? '-' : (c.unit === 'share' ? pct(c.value) : c.value),
    c.limit === null ? '-' : (c.unit === 'share' ? pct(c.limit) : c.limit), c.message]),
  [0, 1, 4], j => !R.checks[j].passed));
const ds = R.datasets.length > 1 ? [...R.datasets, R.overall] : R.datasets;
main.append($('h2', {}, 'Datasets'));
main.append(table('datasets', ['dataset', 'planned', 'ok', 'failed', 'missing', 'prompt tokens', 'cached', 'output tokens',
  'output p50', 'p90', 'p99', 'max', 'reasoning p50', 'content p50', 'think-end', 'length', 'finish reasons', 'failures'],
  ds.map(d => [d.name, d.planned, d.ok, d.failed, d.missing, d.prompt_tokens,
    d.prompt_tokens ? pct(d.cached_tokens / d.prompt_tokens) : '-', d.output_tokens, d.output_len.p50,
    d.output_len.p90, d.output_len.p99, d.output_len.max, d.reasoning_len.p50, d.content_len.p50,
    d.reasoning.expected ? pct(d.reasoning.think_end / d.reasoning.expected) : '-', pct(d.length_share),
    Object.entries(d.finish).map(([k, v]) => `${k} ${v}`).join(', '),
    Object.entries(d.errors).map(([k, v]) => `${k} (${v})`).join('; ')]), [0, 16, 17]));
main.append($('h2', {}, 'Length histograms (tokens)'));
for (const d of ds) {
  const box = $('div', {class: 'hists'});
  for (const [k, label] of [['output', 'output'], ['reasoning', 'reasoning'], ['content', 'content']])
    box.append(hist(`${d.name}: ${label}`, d.histograms[k]));
  main.append(box);
}
main.append($('h2', {}, 'Shards'));
main.append(table('shards', ['shard', 'done', 'planned', 'records', 'ok', 'failed', 'missing', 'duplicates', 'damaged',
  'output tokens', 'tok/s', 'mean latency s', 'host', 'restarts', 'checksum'],
  R.shards.map(s => [s.index, s.done ? 'yes' : 'no', s.planned, s.records, s.ok, s.failed, s.missing, s.duplicates,
    s.damaged_frames, s.output_tokens, s.tok_per_s === null ? '-' : Math.round(s.tok_per_s),
    s.mean_latency_s === null ? '-' : s.mean_latency_s, s.host || '-', s.engine_restarts === null ? '-' : s.engine_restarts,
    s.matches_done === null ? '-' : (s.matches_done ? 'ok' : 'CHANGED')]),
  [1, 12, 14], j => { const s = R.shards[j]; return s.missing || s.damaged_frames || s.matches_done === false; }));
const t = R.tokens;
main.append($('p', {class: 'muted'}, `tokenizer ${t.tokenizer}: think ${t.think_start} ${t.think_start_id} / ` +
  `${t.think_end} ${t.think_end_id}, eos ${t.eos_ids.join(', ')}, ${t.vocab_size} ids; the template ` +
  `${t.template_opens_reasoning ? 'opens' : 'does not open'} reasoning. Re-rendered prompts: ${R.reprompt.sampled} ` +
  `sampled, ${R.reprompt.mismatched} differ.`));
"""


def write_html(report: AuditReport, path: Path) -> None:
    """A single HTML file with inline data, style and script (no network access needed to view it)."""
    data = msgspec.json.encode(report).decode().replace("</", "<\\/")
    verdict = "PASSED" if report.passed else "FAILED"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Audit {html.escape(report.run)}: {verdict}</title>
<style>{_STYLE}</style></head>
<body><div id="main"></div>
<noscript>Enable JavaScript to see this report; the same data is in audit.json.</noscript>
<script type="application/json" id="audit-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
    atomic_write(path, page.encode())
