"""Audit reports: `audit.json`, the terminal summary table, and a self-contained `audit.html`.

The HTML page carries its data as JSON and draws the check list, the per-dataset table, length
histograms (inline SVG, one x scale per column shared by the datasets, max_new_tokens marked),
sample outputs (decoded, split at the think-end), failures by kind with a real message each, and the
per-shard table with a small inline script: one file, no network, opens anywhere.
"""

from __future__ import annotations

import html
import textwrap
from pathlib import Path

import msgspec

from toolkit.dataset.audit_report import AuditReport, DatasetStats, TrainingShare, modes_text
from toolkit.formats.files import atomic_write, shown_path
from toolkit.formats.rundir import RunDir

__all__ = ["summary_table", "write_html", "write_reports"]

SHARD_ROWS = 16  # shards listed in the terminal table (all of them in the HTML page)
WIDTH = 120  # of the wrapped check messages


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
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [
        f"audit of run {report.run} ({report.fingerprint}): {verdict}",
        f"{report.planned} planned, {report.ok} ok, {report.failed} failed, {report.missing} "
        f"missing; {report.duplicates} duplicates kept once, {report.continued} partial outputs "
        f"continued, {report.damaged_frames} damaged frames",
        *_skipped_inputs(report),
        *([f"engine: {STUB_WORDS}"] if report.engine == "stub" else []),
        "",
    ]
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
    lines += _table(rows, right=set(range(1, len(head))))
    lines.append(
        f"reasoning modes of ok outputs: {modes_text(report.overall.reasoning)}; "
        f"{report.overall.reasoning.in_reasoning} in reasoning mode"
    )
    lines.append(training_line(report.training))
    lines.append(continued_line(report.overall))
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
    if shown:
        lines.append("")
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
        lines += _table(rows, right=set(range(1, 10)))
    lines += ["", "checks:"]
    for c in report.checks:
        mark = "ok  " if c.passed else "FAIL"
        pad = " " * 32
        body = textwrap.wrap(c.message, width=WIDTH, initial_indent=pad, subsequent_indent=pad) or [
            pad
        ]
        lines.append(f"  {mark}  {c.name:<22}  {body[0][32:]}")
        lines += body[1:]
    files = report.files
    lines += [
        "",
        f"report: {_shown(files.get('html', '-'))}  (and {_shown(files.get('json', '-'))})",
    ]
    if report.missing:
        lines.append(f"missing ids: {_shown(files.get('missing_ids'))}")
    if report.failed:
        lines.append(f"failed ids: {_shown(files.get('failed_ids'))}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# html
# --------------------------------------------------------------------------------------------------
_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#1d232a;
  background:#fff}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px}
h3{font-size:14px;margin:14px 0 6px}
.badge{display:inline-block;padding:2px 10px;border-radius:12px;color:#fff;font-weight:600}
.pass{background:#1f883d} .fail{background:#cf222e}
table{border-collapse:collapse;margin:6px 0 12px}
th,td{padding:4px 10px;border-bottom:1px solid #d8dee4;text-align:right}
th{background:#f6f8fa}
td.l,th.l{text-align:left}
tr.bad td{background:#ffebe9}
td.msg{text-align:left;max-width:760px}
.muted{color:#57606a} .note{color:#57606a;max-width:1000px}
.hgrid{display:grid;grid-template-columns:repeat(3,max-content);gap:12px 18px;align-items:start}
.hist{border:1px solid #d8dee4;border-radius:6px;padding:6px 8px}
.hist h3{font-size:13px;margin:0 0 2px;font-weight:600}
.hist svg text{font-size:10.5px;fill:#57606a} .hist svg text.limit{fill:#cf222e;font-weight:600}
.sample{border:1px solid #d8dee4;border-radius:6px;margin:10px 0;padding:8px 12px;max-width:1100px}
.sample .head{display:flex;flex-wrap:wrap;gap:6px 12px;align-items:center;margin-bottom:4px}
.part{margin:6px 0}
.part .label{font-size:12px;font-weight:600;color:#57606a;text-transform:uppercase;
  letter-spacing:.04em}
pre{white-space:pre-wrap;word-break:break-word;
  font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  margin:3px 0;padding:6px 9px;border-radius:5px;max-height:220px;overflow:auto}
.reasoning pre{background:#f6f8fa;color:#424a53}
.content pre{background:#fff;border:1px solid #d8dee4}
.prompt pre{background:#fff8c5;color:#3b2300;max-height:90px}
pre.empty{color:#8c959f;font-style:italic}
.gap{display:block;color:#8c959f;font-style:italic;margin:4px 0;padding:1px 0;text-align:center;
  border-top:1px dashed #d0d7de;border-bottom:1px dashed #d0d7de}
.tok{display:inline-block;font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  padding:1px 8px;border-radius:10px;
  border:1px solid #54aeff;background:#ddf4ff;color:#0550ae}
.tok.missing{background:#ffebe9;color:#a40e26;border-color:#ff8182}
.tok.stop{background:#dafbe1;color:#116329;border-color:#4ac26b}
.why{color:#a40e26;font-weight:600}
.stub{display:inline-block;margin:10px 0 0;padding:6px 12px;border-radius:6px;background:#fff8c5;
  color:#3b2300;
  border:1px solid #d4a72c;font-weight:600}
"""

_SCRIPT = r"""
const R = JSON.parse(document.getElementById('audit-data').textContent);
const $ = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
};
const NS = 'http://www.w3.org/2000/svg';
const S = (tag, attrs = {}, text) => {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
};
// One decimal as the terminal (Python's format) writes it: the nearest, an exact tie to the even
// digit, where toFixed takes the larger (6.25 -> 6.2, not 6.3). toFixed(100) is the exact value of
// any double shown here.
const fixed1 = v => {
  const tie = /^(\d+)\.(\d)50*$/.exec(Math.abs(v).toFixed(100));
  return tie && +tie[2] % 2 === 0 ? (v < 0 ? '-' : '') + tie[1] + '.' + tie[2] : v.toFixed(1);
};
const pct = x => fixed1(100 * x) + '%';
const num = v =>
  v >= 10000 ? (v % 1000 ? fixed1(v / 1000) : (v / 1000).toFixed(0)) + 'k' : String(v);
function table(id, head, rows, left, bad) {
  const t = $('table', {id});
  t.append($('tr', {}, ...head.map((h, i) => $('th', left.includes(i) ? {class: 'l'} : {}, h))));
  rows.forEach((r, j) => t.append($('tr', bad && bad(j) ? {class: 'bad'} : {},
    ...r.map((c, i) => $('td',
      left.includes(i) ? {class: i === r.length - 1 && id === 'checks' ? 'msg' : 'l'} : {}, c)))));
  return t;
}
// Round ticks from 0 to at least `max`: steps of 1, 2, 2.5 or 5 times a power of ten (whole
// numbers only).
function ticks(max, n) {
  if (max <= 0) return [0, 1];
  const raw = max / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = Math.max(1,
    [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw && Number.isInteger(s)) || 10 * mag);
  const out = [];
  for (let i = 0; out.length === 0 || out[out.length - 1] < max; i++)
    out.push(Math.round(i * step * 1000) / 1000);
  return out;
}
// A histogram on a given x domain (shared by every dataset), a y axis of counts, and marks at
// `limits`.
function hist(title, h, xmax, limits) {
  const W = 380, H = 168, L = 46, Rm = 14, T = 20, B = 36, pw = W - L - Rm, ph = H - T - B;
  const yt = ticks(Math.max(1, ...h.counts), 4), ym = yt[yt.length - 1];
  const xt = ticks(xmax, 5), xm = xt[xt.length - 1];
  const x = v => L + pw * v / xm, y = c => T + ph - ph * c / ym;
  const svg = S('svg', {width: W, height: H, 'data-xmax': xm, 'data-kind': title});
  for (const v of yt) {
    svg.append(S('line',
      {x1: L, x2: L + pw, y1: y(v), y2: y(v), stroke: v ? '#eaeef2' : '#8c959f'}));
    svg.append(S('text', {x: L - 6, y: y(v) + 3.5, 'text-anchor': 'end', class: 'ytick'}, num(v)));
  }
  h.counts.forEach((c, i) => {
    if (!c) return;
    const x0 = x(h.edges[i]), x1 = x(h.edges[i + 1]);
    const r = S('rect',
      {x: x0 + 0.5, y: y(c), width: Math.max(1, x1 - x0 - 1), height: y(0) - y(c),
       fill: '#0969da'});
    r.append(S('title', {}, `${h.edges[i]}–${h.edges[i + 1] - 1} tokens: ${c}`));
    svg.append(r);
  });
  for (const v of xt) {
    svg.append(S('line', {x1: x(v), x2: x(v), y1: T + ph, y2: T + ph + 4, stroke: '#8c959f'}));
    svg.append(S('text',
      {x: x(v), y: T + ph + 15, 'text-anchor': 'middle', class: 'xtick'}, num(v)));
  }
  svg.append(S('text', {x: L + pw / 2, y: H - 3, 'text-anchor': 'middle'}, 'tokens'));
  svg.append(S('text',
    {x: 11, y: T + ph / 2, 'text-anchor': 'middle', transform: `rotate(-90 11 ${T + ph / 2})`},
    'count'));
  // several (the "all" row): labels one below the other
  [...limits].sort((a, b) => b - a).forEach((lim, i) => {
    const lx = x(lim), ly = T - 7 + 12 * i, right = lx > L + pw / 2;
    svg.append(S('line', {x1: lx, x2: lx, y1: ly + 3, y2: T + ph, stroke: '#cf222e',
                          'stroke-width': 1.5, 'stroke-dasharray': '4 3', class: 'limit'}));
    svg.append(S('text',
                 {x: right ? lx - 4 : lx + 4, y: ly, 'text-anchor': right ? 'end' : 'start',
                  class: 'limit'},
                 `max_new_tokens ${lim}`));
  });
  return svg;
}
const main = document.getElementById('main');
main.append($('h1', {}, `Audit of run ${R.run} `,
  $('span', {class: 'badge ' + (R.passed ? 'pass' : 'fail')}, R.passed ? 'PASSED' : 'FAILED')));
main.append($('div', {class: 'muted'},
  `fingerprint ${R.fingerprint} · ${R.created} · ${R.planned} planned, ${R.ok} ok, ` +
  `${R.failed} failed, ${R.missing} missing, ${R.duplicates} duplicates kept once, ` +
  `${R.continued} partial outputs continued, ${R.damaged_frames} damaged frames`));
if (R.engine === 'stub')
  main.append($('p', {id: 'engine', class: 'stub'}, 'Engine: ' + R.stub_words));
main.append($('h2', {}, 'Checks'));
main.append(table('checks', ['', 'check', 'value', 'limit', 'what was seen'],
  R.checks.map(c => [c.passed ? 'ok' : 'FAIL', c.name,
    c.value === null ? '-' : (c.unit === 'share' ? pct(c.value) : c.value),
    c.limit === null ? '-' : (c.unit === 'share' ? pct(c.limit) : c.limit), c.message]),
  [0, 1, 4], j => !R.checks[j].passed));
const ds = R.datasets.length > 1 ? [...R.datasets, R.overall] : R.datasets;
main.append($('h2', {}, 'Datasets'));
main.append(table('datasets', ['dataset', 'planned', 'ok', 'failed', 'missing', 'prompt tokens',
  'cached', 'output tokens', 'output p50', 'p90', 'p99', 'max', 'reasoning p50', 'content p50',
  'think-end', 'length', 'loops', 'finish reasons'],
  ds.map(d => [d.name, d.planned, d.ok, d.failed, d.missing, d.prompt_tokens,
    d.prompt_tokens ? pct(d.cached_tokens / d.prompt_tokens) : '-', d.output_tokens,
    d.output_len.p50,
    d.output_len.p90, d.output_len.p99, d.output_len.max, d.reasoning_len.p50, d.content_len.p50,
    d.reasoning.expected ? pct(d.reasoning.think_end / d.reasoning.expected) : '-',
    pct(d.length_share),
    d.degenerate || 0,
    Object.entries(d.finish).map(([k, v]) => `${k} ${v}`).join(', ')]), [0, 17]));

// Length histograms: one x scale per column, shared by every dataset; max_new_tokens marked on the
// outputs.
const limitsOf = {};
for (const s of R.samples || []) if (s.max_new_tokens) limitsOf[s.dataset] = [s.max_new_tokens];
limitsOf[R.overall.name] = [...new Set(Object.values(limitsOf).flat())];
const kinds = [['output', 'output', 'output_len'], ['reasoning', 'reasoning', 'reasoning_len'],
  ['content', 'content', 'content_len']];
const domain = {};
for (const [k] of kinds)
  domain[k] = Math.max(1, ...ds.map(d => d.histograms[k].edges[d.histograms[k].edges.length - 1]),
                       ...(k === 'output' ? Object.values(limitsOf).flat() : []));
main.append($('h2', {}, 'Length histograms (tokens)'));
main.append($('p', {class: 'note'},
  'Each column shares one x scale across datasets, so they compare at a glance; ' +
  'the dashed line is the dataset\'s max_new_tokens. Hover a bar for its range and count.'));
const grid = $('div', {class: 'hgrid', id: 'histograms'});
for (const d of ds)
  for (const [k, label, len] of kinds)
    grid.append($('div', {class: 'hist'}, $('h3', {}, `${d.name}: ${label} `,
      $('span', {class: 'muted'},
        `(${d[len].count} outputs, p50 ${d[len].p50}, max ${d[len].max})`)),
      hist(label, d.histograms[k], domain[k], k === 'output' ? (limitsOf[d.name] || []) : [])));
main.append(grid);

// Sample outputs, decoded with the run's tokenizer; every string goes in as text (never as markup).
function part(cls, label, head, tail, omitted, tokens) {
  const pre = $('pre', head || tail ? {} : {class: 'empty'});
  if (!head && !tail) pre.append('(empty)');
  else {
    pre.append(head);
    if (tail) {
      pre.append($('span', {class: 'gap'},
        omitted ? `… ${omitted} tokens not shown …` : '… not shown …'));
      pre.append(tail);
    }
  }
  return $('div', {class: 'part ' + cls},
    $('span', {class: 'label'}, `${label} · ${tokens} tokens`), pre);
}
function sample(s) {
  const head = $('div', {class: 'head'}, $('strong', {}, s.id),
    $('span', {class: 'muted'}, `${s.output_tokens} output tokens · finish ${s.finish}`));
  if (s.why !== 'first outputs') head.append($('span', {class: 'why'}, s.why));
  const te = s.think_end !== null
    ? $('span', {class: 'tok', title: 'think-end token: reasoning ends here'},
      `${s.think_end}  id ${s.think_end_id}`)
    : $('span', {class: 'tok missing', title: 'the output holds no think-end id'},
      `no think-end (id ${s.think_end_id}) in this output`);
  const m = s.matched_stop;
  const stop = s.stop_token !== null
    ? $('span', {class: 'tok stop', title: 'the stop token SGLang matched (last output id)'},
      `${s.stop_token}  id ${m} · finish ${s.finish}`)
    : $('span', {class: 'tok missing'},
      (typeof m === 'string' ? `stop string ${JSON.stringify(m)}` : 'no stop token') +
      ` · finish ${s.finish}`);
  const prompt = $('div', {class: 'part prompt'},
    $('span', {class: 'label'}, 'prompt · last user message'),
    s.prompt === null || s.prompt === undefined
      ? $('pre', {class: 'empty'}, '(source line not readable)') : $('pre', {}, s.prompt));
  return $('div', {class: 'sample'}, head, prompt,
    part('reasoning', 'reasoning', s.reasoning_head, s.reasoning_tail, s.reasoning_omitted,
      s.reasoning_tokens),
    $('div', {}, te),
    part('content', 'content', s.content_head, s.content_tail, s.content_omitted, s.content_tokens),
    $('div', {}, stop));
}
if ((R.samples || []).some(d => d.outputs.length)) {
  main.append($('h2', {}, 'Sample outputs'));
  main.append($('p', {class: 'note'},
    'The first outputs of each dataset in planned order, each under its prompt (its last user ' +
    'message, shortened; one swapped for an output that looks wrong, when there is one), decoded ' +
    'from merged/records.zst with the run\'s tokenizer and split where the audit splits them: at ' +
    'the think-end id. Long parts show their head and tail.'));
  const box = $('div', {id: 'samples'});
  for (const d of R.samples) {
    if (!d.outputs.length) continue;
    box.append($('h3', {}, d.dataset));
    for (const s of d.outputs) box.append(sample(s));
  }
  main.append(box);
}

// Failures: counted by kind (numbers folded), each with one message as the server wrote it.
const fails = [];
for (const d of R.datasets) {
  const ex = ((R.samples || []).find(x => x.dataset === d.name) || {errors: {}}).errors;
  for (const [kind, n] of Object.entries(d.errors))
    fails.push([d.name, n, kind, (d.error_examples || {})[kind] || ex[kind] || '-']);
}
if (fails.length) {
  main.append($('h2', {}, 'Failures'));
  main.append(table('failures', ['dataset', 'count', 'kind', 'example message'], fails, [0, 2, 3]));
}
main.append($('h2', {}, 'Shards'));
main.append(table('shards', ['shard', 'done', 'planned', 'records', 'ok', 'failed', 'missing',
  'duplicates', 'damaged', 'output tokens', 'tok/s', 'mean latency s', 'host', 'restarts',
  'checksum'],
  R.shards.map(s => [s.index, s.done ? 'yes' : 'no', s.planned, s.records, s.ok, s.failed,
    s.missing, s.duplicates, s.damaged_frames, s.output_tokens,
    s.tok_per_s === null ? '-' : Math.round(s.tok_per_s),
    s.mean_latency_s === null ? '-' : s.mean_latency_s, s.host || '-',
    s.engine_restarts === null ? '-' : s.engine_restarts,
    s.matches_done === null ? '-' : (s.matches_done ? 'ok' : 'CHANGED')]),
  [1, 12, 14], j => {
    const s = R.shards[j];
    return s.missing || s.damaged_frames || s.matches_done === false;
  }));
const rm = R.overall.reasoning;
main.append($('h2', {}, 'Reasoning modes'));
main.append(table('modes', ['ok outputs', 'opened by the template', 'opened by the model itself',
  'closed by the template', 'template unaware of think tokens', 'in reasoning mode',
  'holding a think token'],
  [[R.ok, rm.mode_opened, rm.mode_model_opens, rm.closed_by_template, rm.mode_unknown,
    rm.in_reasoning, rm.think_tokens]],
  [], () => R.checks.some(c => c.name === 'reasoning_mode' && !c.passed)));
const t = R.tokens;
main.append($('p', {class: 'muted'},
  `tokenizer ${t.tokenizer}: think ${t.think_start} ${t.think_start_id} / ` +
  `${t.think_end} ${t.think_end_id}, eos ${t.eos_ids.join(', ')}, ${t.vocab_size} ids; ` +
  `the template ` +
  `${t.template_opens_reasoning ? 'opens' : 'does not open'} reasoning. ` +
  `Re-rendered prompts: ${R.reprompt.sampled} sampled, ${R.reprompt.mismatched} differ.`));
"""


def write_html(report: AuditReport, path: Path) -> None:
    """A single HTML file with inline data, style and script (no network access needed to view
    it)."""
    # "<" only ever occurs inside JSON strings: as \u003c, no text of the run can close or open a
    # tag here.
    data = msgspec.json.encode({**msgspec.to_builtins(report), "stub_words": STUB_WORDS}).decode()
    data = data.replace("<", "\\u003c")
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
