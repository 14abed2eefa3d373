"""Login-node cost of the pre-flight on a real-sized job: `toolkit check` on 100,000 prompts in 8 datasets.

The pre-flight is what `check`, `run` and `submit` (with or without --dry-run) do before anything starts: the
spec, every prompt line, the tokenizer, EVERY prompt rendered with the chat template, its reasoning mode and its
length against the context length. Target: well under a minute on a login node (one core).

The prompts are real English text (pydoc_data.topics) shaped like the datasets of a real job, eight kinds of chat
lengths: short questions, math problems, multi-turn chats with a system prompt, long documents to summarise, tool
use (a tools list and tool turns), code, multilingual-length prompts, and a few very long contexts. The tokenizer is
a toy one (toolkit.stub.toy_tokenizer, qwen3 family, 4,000 ids): Jinja rendering costs what it costs with a real
template; a real 150k-vocabulary tokenizer encodes somewhat slower per token.

Each run is `python -m toolkit check JOB` in a fresh process (imports included): wall and CPU (user + system)
seconds, median of `--repeat`; peak RSS of the process.

    python benchmarks/bench_check.py [--prompts 100000] [--datasets 8] [--repeat 3] [--profile]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_S = 60.0
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the documentation.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
         {"type": "function", "function": {"name": "run_python", "description": "Run Python code and return stdout.",
          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
# (name, words per user turn (min, max), turns (min, max), system prompt, tools)
KINDS = [
    ("questions", (15, 80), (1, 1), False, False),
    ("math", (40, 200), (1, 1), False, False),
    ("chat", (20, 150), (2, 4), True, False),
    ("summarise", (800, 2500), (1, 1), True, False),
    ("tools", (20, 100), (1, 2), True, True),
    ("code", (100, 600), (1, 2), False, False),
    ("multilingual", (30, 300), (1, 3), False, False),
    ("long-context", (3000, 6000), (1, 1), True, False),
]
SHARE = [0.2, 0.2, 0.15, 0.08, 0.12, 0.12, 0.11, 0.02]  # of the prompts, per kind


def write_datasets(folder: Path, prompts: int, datasets: int) -> list[tuple[str, Path]]:
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    rng = random.Random(0)
    out = []
    counts = [int(prompts * SHARE[j % len(SHARE)] / sum(SHARE[: min(datasets, len(SHARE))])) for j in range(datasets)]
    counts[0] += prompts - sum(counts)

    def text(lo: int, hi: int) -> str:
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start : start + n])

    for j in range(datasets):
        name, (lo, hi), (t_lo, t_hi), system, tools = KINDS[j % len(KINDS)]
        path = folder / f"{name}-{j}.jsonl"
        with open(path, "w") as f:
            for i in range(counts[j]):
                messages = [{"role": "system", "content": text(10, 60)}] if system else []
                for t in range(rng.randint(t_lo, t_hi)):
                    if t:
                        messages.append({"role": "assistant", "content": text(30, 200)})
                    messages.append({"role": "user", "content": text(lo, hi)})
                line = {"id": f"{name}-{j}-{i:06d}", "messages": messages}
                if tools:
                    line["tools"] = TOOLS
                f.write(json.dumps(line) + "\n")
        out.append((f"{name}-{j}", path))
    return out


def write_job(folder: Path, tokenizer: Path, datasets: list[tuple[str, Path]]) -> Path:
    lines = ['name = "bench-check"', f'output_dir = "{folder / "run"}"', "[model]", f'path = "{tokenizer}"',
             "[engine]", 'kind = "stub"', "[engine.stub]", "context_length = 131072",
             "[sampling]", "max_new_tokens = 32768", "[sharding]", "shards = 100"]
    for name, p in datasets:
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{p}"']
    job = folder / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def timed_check(job: Path) -> tuple[float, float, float, str]:
    """`toolkit check JOB` in a fresh process: (wall s, CPU s, peak RSS MB, stdout)."""
    code = ("import resource, sys, time; from toolkit.cli import main; t = time.process_time(); rc = main(sys.argv[1:]); "
            "r = resource.getrusage(resource.RUSAGE_SELF); "
            "print(f'#cpu {r.ru_utime + r.ru_stime:.3f} #rss {r.ru_maxrss / 1024:.1f}', file=sys.stderr); sys.exit(rc)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "check", str(job)], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"toolkit check exited {r.returncode}:\n{r.stderr[-3000:]}")
    tail = r.stderr.rsplit("#cpu ", 1)[1].split()
    return wall, float(tail[0]), float(tail[2]), r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--datasets", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one more run in this process under cProfile")
    args = ap.parse_args()

    from toolkit.stub.toy_tokenizer import build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-check-"))
    try:
        tokenizer = build_tokenizer(work / "tokenizer", "qwen3")
        datasets = write_datasets(work, args.prompts, args.datasets)
        job = write_job(work, tokenizer, datasets)
        size = sum(p.stat().st_size for _, p in datasets)
        print(f"{args.prompts:,} prompts in {args.datasets} datasets ({size / 1e6:.0f} MB of JSONL), toy qwen3 tokenizer, "
              f"stub engine (context 131,072), max_new_tokens 32,768")
        walls, cpus, rss = [], [], []
        out = ""
        for _ in range(args.repeat):
            w, c, m, out = timed_check(job)
            walls.append(w), cpus.append(c), rss.append(m)
        print(out.rstrip())
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(f"\ntoolkit check: wall {[round(x, 2) for x in walls]} s, CPU {[round(x, 2) for x in cpus]} s; "
              f"median wall {wall:.2f} s, CPU {cpu:.2f} s ({cpu / args.prompts * 1e6:.0f} µs CPU per prompt); "
              f"peak RSS {max(rss):.0f} MB")
        print(f"target: under {TARGET_S:.0f} s wall: {'met' if wall < TARGET_S else 'NOT met'}")
        if args.profile:
            import cProfile
            import pstats

            from toolkit.job.check import preflight

            prof = cProfile.Profile()
            prof.runcall(preflight, job)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
