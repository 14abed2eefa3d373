"""Merge + audit throughput and peak memory, and export throughput, on synthetic runs of real-ish token ids.

A run of >= 50 M output tokens is written straight to shard files (no engine): 4,096-token outputs cut from
English text (pydoc_data.topics) encoded with a toy Kimi-style tokenizer — reasoning, the think-end id, an
answer, EOS (a tenth cut by max_new_tokens instead: no EOS, finish length, so the audit's repetition-loop check
runs on them) — each record at its own random offsets, records in the order a worker with 64 requests in flight
completes them, frames of 64 records as the worker writes them. `toolkit merge RUN` (merge and audit, the run's
final job) then runs in a subprocess that reports its CPU time and its peak RSS (VmHWM); the same is done on a
run ten times smaller to show memory does not depend on run size. The exports (jsonl, parquet, conversations, with
its round trip of every row) and `to_dataset` run on the large run, each in a fresh process (its imports left out
of the figures), `--repeat` times; with `--before CHECKOUT` the same is done with the toolkit of that checkout,
alternating with this one, on the same run, and the files both write are compared byte for byte.

    python benchmarks/bench_merge.py [--tokens 50000000] [--repeat 3] [--keep] [--before CHECKOUT]

Figures are printed; the temporary runs are deleted at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.formats.manifests import write_done  # noqa: E402
from toolkit.formats.records import OK, Record  # noqa: E402
from toolkit.formats.shardfile import ShardWriter  # noqa: E402
from toolkit.job import chat  # noqa: E402
from toolkit.job.plan import create_run, plan_job  # noqa: E402
from toolkit.job.spec import load_spec  # noqa: E402
from toolkit.stub.toy_tokenizer import build_tokenizer, corpus  # noqa: E402

OUTPUT_TOKENS = 4096
IN_FLIGHT = 64  # a worker's concurrency: how far completion order strays from planned order
FLUSH_RECORDS = 64  # records per frame, as the worker writes them
SHARDS = 16

MEASURED = """
import resource, sys, time
t0 = time.perf_counter()
from toolkit.cli import main
rc = main(sys.argv[1:])
ru = resource.getrusage(resource.RUSAGE_SELF)
hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("MEASURED", rc, ru.ru_utime + ru.ru_stime, time.perf_counter() - t0, int(hwm) / 1024, file=sys.stderr)
"""


EXPORT = """
import resource, sys, time
import toolkit
from toolkit.dataset.export import export_run
fmt, run, out = sys.argv[1:4]
kwargs = {"check_sample": int(sys.argv[4])} if len(sys.argv) > 4 else {}
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
c0, w0 = cpu(), time.perf_counter()
if fmt == "to_dataset":
    ds = toolkit.to_dataset(run, ok_only=False, cache_dir=out)
    n = ds.num_rows
else:
    n = export_run(run, fmt, out, **kwargs).rows
print("MEASURED", n, cpu() - c0, time.perf_counter() - w0, file=sys.stderr)
"""
EXPORTS = ("jsonl", "parquet", "conversations", "to_dataset")
SAMPLED = 100  # the conversations export again with --check-sample SAMPLED (this checkout only)


def make_run(
    root: Path, tokenizer: Path, tok, pool: np.ndarray, tokens: int, seed: int
) -> tuple[Path, int]:
    """Plan a run of `tokens` output tokens and write its shard files and done manifests directly."""
    n = -(-tokens // OUTPUT_TOKENS)
    root.mkdir(parents=True)
    prompts = root / "prompts.jsonl"
    words = " ".join(corpus()).split()
    with open(prompts, "w") as f:
        for i in range(n):
            text = " ".join(words[(i * 13) % (len(words) - 40) :][: 12 + i % 20])
            f.write(json.dumps({"id": f"bench-{i:07d}", "prompt": text}) + "\n")
    (root / "job.toml").write_text(
        f'name = "bench"\noutput_dir = "{root / "run"}"\n[model]\npath = "{tokenizer}"\n'
        f'chat_template_kwargs = {{ thinking = true }}\n[engine]\nkind = "stub"\n'
        f"[sampling]\nmax_new_tokens = {OUTPUT_TOKENS * 2}\n[sharding]\nshards = {SHARDS}\n"
        f'[[datasets]]\nname = "bench"\npath = "{prompts}"\n'
    )
    spec = load_spec(root / "job.toml")
    plan, refs = plan_job(spec)
    rd = create_run(plan, refs)
    info = chat.token_info(tok, spec.model)
    from toolkit.job.inputs import read_prompt_at

    ds = plan.datasets[0]
    prompt_ids = chat.render_many(
        tok,
        spec.model,
        (read_prompt_at(ds.path, ds.name, r.line, r.offset, r.length) for r in refs),
    )
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    te, eos = info.think_end_id, info.eos_ids[0]
    written = 0
    for sp in plan.shards:
        order = sorted(
            range(sp.first, sp.first + sp.count), key=lambda p: p + rng.random() * IN_FLIGHT
        )
        w = ShardWriter(
            rd.shard_file(sp.index), plan.fingerprint, sp.index, flush_records=FLUSH_RECORDS
        )
        w.open(range(sp.first, sp.first + sp.count))
        for pos in order:
            reasoning = int(nprng.integers(OUTPUT_TOKENS // 4, OUTPUT_TOKENS * 9 // 10))
            content = OUTPUT_TOKENS - reasoning - 2
            a, b = nprng.integers(0, len(pool) - OUTPUT_TOKENS, 2)
            cut = (
                pos % 10 == 0
            )  # a tenth cut by max_new_tokens (the audit looks for repetition loops in those)
            out = np.concatenate(
                [pool[a : a + reasoning], [te], pool[b : b + content + cut], [] if cut else [eos]]
            ).astype("<u4")
            p = prompt_ids[pos]
            w.add(
                Record(
                    id=refs[pos].id,
                    dataset=ds.name,
                    index=pos,
                    status=OK,
                    prompt_ids=np.array(p, "<u4").tobytes(),
                    output_ids=out.tobytes(),
                    reasoning_end=reasoning,
                    tool_call_at=None,
                    finish="length" if cut else "stop",
                    matched_stop=None if cut else eos,
                    prompt_tokens=len(p),
                    completion_tokens=OUTPUT_TOKENS,
                    cached_tokens=0,
                    latency_s=round(rng.uniform(20, 90), 3),
                    attempts=1,
                )
            )
            written += OUTPUT_TOKENS
        w.close()
        write_done(
            rd.done_file(sp.index),
            rd.shard_file(sp.index),
            sp.index,
            plan.fingerprint,
            positions=range(sp.first, sp.first + sp.count),
        )
    return rd.root, written


def measure_merge(run: Path) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds, peak RSS MB) of `toolkit merge RUN` (merge + audit) in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, "merge", str(run)], env=env, capture_output=True, text=True
    )
    line = next((x for x in proc.stderr.splitlines() if x.startswith("MEASURED")), None)
    if line is None:
        raise SystemExit(f"merge failed:\n{proc.stderr[-3000:]}")
    _, rc, cpu, wall, rss = line.split()
    if rc != "0":
        raise SystemExit(f"the audit failed on the benchmark run:\n{proc.stdout[-3000:]}")
    return float(cpu), float(wall), float(rss)


def cpu_now() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure_to_dataset(run: Path, tokens: int, cache: Path) -> None:
    """toolkit.to_dataset of every record of `run`: time, and the bytes per output token it leaves in the
    `datasets` cache (`cache`)."""
    import toolkit

    c0, w0 = cpu_now(), time.perf_counter()
    ds = toolkit.to_dataset(run, ok_only=False, cache_dir=cache)
    cpu, wall = cpu_now() - c0, time.perf_counter() - w0
    size = sum(f.stat().st_size for f in cache.rglob("*.arrow"))
    print(
        f"to_dataset     : {ds.num_rows} records, {tokens / 1e6:.1f} M output tokens in {wall:.1f} s wall "
        f"({wall / tokens * 1e9:.0f} ns/token), CPU {cpu:.1f} s; cache {size / 1e6:.0f} MB = "
        f"{size / tokens:.2f} B per output token (output_ids {ds.data.schema.field('output_ids').type})"
    )


def measure_export(
    code: Path, run: Path, fmt: str, out: Path, *sample: str
) -> tuple[int, float, float]:
    """(rows, CPU seconds, wall seconds) of one export (or `to_dataset`, its cache in `out`) made by the toolkit
    of `code` in a fresh process; its imports are not counted, its tokenizer threads are."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(
        [sys.executable, "-c", EXPORT, fmt, str(run), str(out), *sample],
        env=env,
        capture_output=True,
        text=True,
        cwd=out.parent,
    )
    line = next((x for x in proc.stderr.splitlines() if x.startswith("MEASURED")), None)
    if line is None:
        raise SystemExit(f"{fmt} export with {code} failed:\n{proc.stderr[-3000:]}")
    _, n, cpu, wall = line.split()
    return int(n), float(cpu), float(wall)


def digest(out: Path, fmt: str) -> str:
    """sha256 of what an export wrote (its side files too, the summary's own file names aside); of the Arrow
    files `to_dataset` left in its cache."""
    h = hashlib.sha256()
    if fmt == "to_dataset":
        files = sorted(out.rglob("*.arrow"))
    else:
        files = sorted(
            p for p in out.parent.glob(out.stem + "*") if not p.name.endswith("_summary.json")
        )
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def measure_exports(codes: dict[str, Path], run: Path, tokens: int, tmp: Path, repeat: int) -> None:
    """Each export `repeat` times per code, alternating; medians per output token, and whether the codes wrote
    the same bytes."""
    got: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    digests: dict[tuple[str, str], str] = {}
    for i in range(repeat):
        for fmt in EXPORTS:
            for name, code in codes.items():
                d = tmp / f"export-{name}-{fmt}"
                d.mkdir()
                out = d / (
                    "hf"
                    if fmt == "to_dataset"
                    else "out.parquet"
                    if fmt == "parquet"
                    else "out.jsonl"
                )
                got.setdefault((name, fmt), []).append(measure_export(code, run, fmt, out))
                if i == 0:
                    digests[name, fmt] = digest(out, fmt)
                shutil.rmtree(d)
        d = tmp / "export-sampled"
        d.mkdir()
        got.setdefault(("after", "sampled"), []).append(
            measure_export(codes["after"], run, "conversations", d / "out.jsonl", str(SAMPLED))
        )
        shutil.rmtree(d)
    for fmt in (*EXPORTS, "sampled"):
        walls = {}
        for name in codes if fmt != "sampled" else ["after"]:
            runs = got[name, fmt]
            n = runs[0][0]
            cpu, wall = (statistics.median(x[k] for x in runs) for k in (1, 2))
            walls[name] = wall
            label = f"conversations --check-sample {SAMPLED}" if fmt == "sampled" else fmt
            print(
                f"{label:13s} {name:6s}: {n} rows, {tokens / 1e6:.1f} M output tokens: wall {wall:6.2f} s = "
                f"{wall / tokens * 1e9:6.0f} ns/token, CPU {cpu:6.2f} s = {cpu / tokens * 1e9:6.0f} ns/token "
                f"(median of {repeat}; walls {', '.join(f'{x[2]:.2f}' for x in runs)})"
            )
        if "before" in codes and fmt != "sampled":
            same = "identical" if digests["before", fmt] == digests["after", fmt] else "DIFFERENT"
            print(
                f"{fmt:13s} after/before wall {walls['after'] / walls['before']:.2f}x; files {same}"
            )
    for name in codes:
        jsonl = statistics.median(x[2] for x in got[name, "jsonl"])
        ratios = [
            f"{fmt} {statistics.median(x[2] for x in got[name, fmt]) / jsonl:.2f}x"
            for fmt in ("conversations", "sampled")
            if (name, fmt) in got
        ]
        print(f"wall per token against jsonl ({name}): {', '.join(ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50_000_000, help="output tokens of the large run")
    ap.add_argument("--repeat", type=int, default=3, help="merges per run (medians are printed)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary runs")
    ap.add_argument(
        "--before", type=Path, help="a checkout of the toolkit whose exports are measured too"
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        t = time.perf_counter()
        tokenizer = build_tokenizer(tmp / "tokenizer", "kimi")
        from types import SimpleNamespace

        tok = chat.load_tokenizer(
            SimpleNamespace(
                path=str(tokenizer),
                tokenizer_path=None,
                trust_remote_code=False,
                chat_template=None,
                chat_template_kwargs={},
            )
        )
        pool = np.array(tok("".join(corpus()), add_special_tokens=False)["input_ids"], np.uint32)
        pool = pool[~np.isin(pool, list(tok.added_tokens_decoder))]
        runs = {}
        for name, tokens in (("small", args.tokens // 10), ("large", args.tokens)):
            runs[name] = make_run(tmp / name, tokenizer, tok, pool, tokens, seed=len(name))
        size = sum(f.stat().st_size for f in (runs["large"][0] / "shards").glob("*.zst"))
        print(
            f"runs written in {time.perf_counter() - t:.0f} s: large {runs['large'][1] / 1e6:.1f} M output tokens "
            f"({size / 1e6:.0f} MB of shard files, {size / runs['large'][1]:.2f} B/token), small "
            f"{runs['small'][1] / 1e6:.1f} M; text pool {len(pool):,} ids, {OUTPUT_TOKENS}-token outputs, "
            f"{SHARDS} shards"
        )

        figures = {}
        for name, (run, tokens) in runs.items():
            got = [measure_merge(run) for _ in range(args.repeat)]
            cpu, wall, rss = (statistics.median(x[i] for x in got) for i in range(3))
            figures[name] = (tokens, cpu, wall, rss)
            print(
                f"merge+audit {name:5s} {tokens / 1e6:6.1f} M tokens: CPU {cpu:6.2f} s -> {tokens / cpu / 1e6:5.1f} M "
                f"tokens/s per core; wall {wall:6.2f} s; peak RSS {rss:6.1f} MB   (median of {args.repeat}; "
                f"runs: {', '.join(f'{x[0]:.2f}s/{x[2]:.0f}MB' for x in got)})"
            )
        (t_s, c_s, _, r_s), (t_l, c_l, _, r_l) = figures["small"], figures["large"]
        print(
            f"marginal merge+audit rate (large - small, start-up excluded): {(t_l - t_s) / (c_l - c_s) / 1e6:.1f} M "
            f"tokens/s per core; peak RSS large/small {r_l:.0f}/{r_s:.0f} MB"
        )

        run, tokens = runs["large"]
        codes = {"after": REPO, **({"before": args.before.resolve()} if args.before else {})}
        print(
            f"load average before the exports: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
            f"({os.cpu_count()} cores)"
        )
        measure_exports(codes, run, tokens, tmp, args.repeat)
        print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        measure_to_dataset(run, tokens, tmp / "hf")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
