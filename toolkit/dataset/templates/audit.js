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
