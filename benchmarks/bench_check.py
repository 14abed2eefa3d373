"""Login-node cost of the pre-flight at scale: `toolkit check` on 100,000 (and 1,000,000) short prompts, on one
process and on every core, then what `check` again and `submit` cost once `check` has kept what it learned.

The pre-flight is what `check`, `run` and `submit` (with or without --dry-run) do before anything starts: the
spec, every prompt line, the tokenizer, EVERY prompt rendered with the chat template, its reasoning mode and its
length against the context length. Targets: at most 50 µs of CPU per prompt rendered and tokenized, and `submit`
after `check` within 2 s at 100,000 prompts.

The prompts are short chats of real English text (pydoc_data.topics): a user turn of 12 to 24 words, in 8
datasets; `--kind mixed` writes the eight kinds of a real job instead (questions, math, multi-turn chats, long
documents, tool use, code, multilingual-length prompts, a few very long contexts). The tokenizer is the demo's
(a toy one of 4,000 ids with a Kimi-style template): Jinja rendering costs what it costs with a real template.

Each figure is a fresh process as a user types the command (imports included), CPU being user + system of it and
of its pool's processes; the median of `--repeat` runs:

- `check` with TOOLKIT_RENDER_PROCESSES=1 and with the default (every core this process may use), the kept
  results removed before each run: wall, CPU, CPU per 1,000 prompts; the fixed cost (imports, tokenizer) is taken
  from a check of 1,000 prompts, and what each further prompt costs is printed beside the whole;
- the render stage alone (reading, rendering and measuring every prompt; one process, tokenizer loaded and plan
  made before the clock starts): what the 50 µs target is about;
- `check` again (the results kept), and submit's start after it: `prepare_run` as `toolkit submit` calls it
  (spec, every prompt line, plan, the run directory written; no Slurm).

1,000,000 prompts take minutes of a loaded 2-core machine: by default the 1M figures are extrapolated from those
at 100,000 (and printed as such); `--million` measures them.

    python benchmarks/bench_check.py [--prompts 100000] [--million] [--repeat 3] [--kind short|mixed]
                                     [--code DIR] [--profile]

`--code DIR` runs the commands of another checkout of the toolkit (the figures of an older version, say).
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"
TARGET_US = 50.0
SUBMIT_TARGET_S = 2.0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run Python code and return stdout.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
]
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
DATASETS = 8


def _words() -> list[str]:
    import pydoc_data.topics

    return " ".join(pydoc_data.topics.topics.values()).split()


def write_short(folder: Path, prompts: int) -> list[tuple[str, Path]]:
    """`prompts` one-turn chats of 12 to 24 words, split evenly over DATASETS files."""
    words = _words()
    span = len(words) - 40
    out = []
    per = prompts // DATASETS
    for j in range(DATASETS):
        n = per + (1 if j < prompts % DATASETS else 0)
        path = folder / f"short{j}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                g = j * per + i
                start = (g * 7) % span
                text = " ".join(words[start : start + 12 + (g % 5) * 3])
                f.write(
                    json.dumps(
                        {"id": f"d{j}-{i:07d}", "messages": [{"role": "user", "content": text}]}
                    )
                    + "\n"
                )
        out.append((f"short{j}", path))
    return out


def write_mixed(folder: Path, prompts: int) -> list[tuple[str, Path]]:
    """`prompts` prompts of the eight kinds of a real job, one file per kind."""
    words = _words()
    rng = random.Random(0)
    out = []
    counts = [int(prompts * SHARE[j] / sum(SHARE)) for j in range(DATASETS)]
    counts[0] += prompts - sum(counts)

    def text(lo: int, hi: int) -> str:
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start : start + n])

    for j in range(DATASETS):
        name, (lo, hi), (t_lo, t_hi), system, tools = KINDS[j]
        path = folder / f"{name}.jsonl"
        with open(path, "w") as f:
            for i in range(counts[j]):
                messages = [{"role": "system", "content": text(10, 60)}] if system else []
                for t in range(rng.randint(t_lo, t_hi)):
                    if t:
                        messages.append({"role": "assistant", "content": text(30, 200)})
                    messages.append({"role": "user", "content": text(lo, hi)})
                line = {"id": f"{name}-{i:07d}", "messages": messages}
                if tools:
                    line["tools"] = TOOLS
                f.write(json.dumps(line) + "\n")
        out.append((name, path))
    return out


def write_job(folder: Path, datasets: list[tuple[str, Path]]) -> Path:
    lines = [
        'name = "bench-check"',
        f'output_dir = "{folder / "run"}"',
        "[model]",
        f'path = "{TOKENIZER}"',
        "[engine]",
        'kind = "stub"',
        "[engine.stub]",
        "context_length = 131072",
        "[sampling]",
        "max_new_tokens = 32768",
        "[sharding]",
        "shards = 100",
    ]
    for name, p in datasets:
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{p}"']
    job = folder / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def timed(
    code_dir: Path, argv: list[str], env: dict[str, str] | None = None
) -> tuple[float, float]:
    """(wall s, CPU s of the process and the processes it waited for) of `python argv...` run in `code_dir`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, *argv],
        cwd=code_dir,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(code_dir), **(env or {})},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"`{' '.join(argv)}` exited {r.returncode}:\n{r.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# The render stage alone, in one process: every slice of every dataset read, rendered and measured (the tokenizer
# loaded and the plan made before the clock starts). Prints its CPU seconds.
STAGE = """
import sys, time
from toolkit.job import chat, render_pool, render_slice
from toolkit.job.check import context_length
from toolkit.job.plan import plan_job
from toolkit.job.spec import load_spec
spec = load_spec(sys.argv[1]); m = spec.model
plan, _ = plan_job(spec)
tok = chat.load_tokenizer(m); info = chat.token_info(tok, m)
setting = render_slice.Setting(m, info, context_length(spec)[0], *render_slice.bound_kind(tok, m))
mnt = spec.sampling["max_new_tokens"]
work = [render_slice.Slice(i, d.path, d.name, d.regenerate, mnt, o, n, line)
        for i, d in enumerate(spec.datasets) for o, n, line in render_pool.slices(d.path)]
t = time.process_time()
done = sum(o.prompts for o in render_pool.measure(tok, setting, work, total=plan.total, workers=1))
print(time.process_time() - t, done)
"""

PREPARE = (
    "import sys; from toolkit.job.prepare import prepare_run; "
    "prepare_run(sys.argv[1], as_submitted=True, print_warnings=False)"
)


def median_of(repeat: int, run) -> tuple[float, float, list[float]]:
    """(median wall, median CPU, the walls) of `repeat` calls of run() -> (wall, cpu)."""
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = run()
        walls.append(w)
        cpus.append(c)
    return statistics.median(walls), statistics.median(cpus), walls


def bench(
    code: Path, work: Path, prompts: int, kind: str, repeat: int
) -> dict[str, tuple[float, float]]:
    """The figures of one size: {what: (median wall s, median CPU s)}."""
    folder = work / f"{kind}-{prompts}"
    folder.mkdir()
    job = write_job(folder, (write_short if kind == "short" else write_mixed)(folder, prompts))
    run = folder / "run"
    check = ["-m", "toolkit", "check", str(job)]

    def fresh(env: dict[str, str]):
        def go():
            shutil.rmtree(run, ignore_errors=True)  # nothing kept: every prompt is rendered
            return timed(code, check, env)

        return go

    out = {}
    if (code / "toolkit" / "job" / "render_pool.py").exists():
        r = subprocess.run(
            [sys.executable, "-c", STAGE, str(job)],
            cwd=code,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(code)},
            check=True,
        )
        cpu, done = r.stdout.split()
        out["render stage"] = (0.0, float(cpu))
        print(
            f"  {'render stage (1 process)':<28} CPU {float(cpu):7.2f} s for {int(done):,} prompts "
            f"({float(cpu) / int(done) * 1e6:5.1f} µs CPU per prompt rendered and measured)"
        )
    for label, env in (
        ("check, 1 process", {"TOOLKIT_RENDER_PROCESSES": "1"}),
        ("check, every core", {}),
    ):
        wall, cpu, walls = median_of(repeat, fresh(env))
        out[label] = (wall, cpu)
        print(
            f"  {label:<28} wall {wall:7.2f} s  CPU {cpu:7.2f} s  ({cpu / prompts * 1e6:5.1f} µs CPU per prompt, "
            f"{cpu / prompts * 1e3:.2f} CPU-s per 1,000)  walls {[round(w, 2) for w in walls]}"
        )
    kept = (code / "toolkit" / "job" / "check_cache.py").exists()
    if kept:
        wall, cpu, _ = median_of(repeat, lambda: timed(code, check))
        out["check again"] = (wall, cpu)
        print(f"  {'check again (kept)':<28} wall {wall:7.2f} s  CPU {cpu:7.2f} s")

    def prepare():
        for p in sorted(
            folder.glob("run*")
        ):  # a created run would be resumed: keep only what check kept
            if p.is_dir():
                for child in p.iterdir():
                    if child.name != "check.msgpack":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
        if not kept:
            shutil.rmtree(run, ignore_errors=True)
        return timed(code, ["-c", PREPARE, str(job)])

    if kept:
        timed(code, check)  # what submit finds after a check
    wall, cpu, _ = median_of(repeat, prepare)
    out["submit after check"] = (wall, cpu)
    print(
        f"  {'submit after check' if kept else 'submit (renders again)':<28} wall {wall:7.2f} s  CPU {cpu:7.2f} s  "
        "(prepare_run: spec, prompt lines, plan, run directory; no Slurm)"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument(
        "--million", action="store_true", help="measure 1,000,000 prompts too (else extrapolated)"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kind", choices=("short", "mixed"), default="short")
    ap.add_argument(
        "--code",
        type=Path,
        default=REPO,
        help="the checkout whose toolkit runs (default: this one)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="one more check in this process under cProfile"
    )
    args = ap.parse_args()
    code = args.code.resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-check-"))
    cores = len(os.sched_getaffinity(0))
    print(
        f"toolkit from {code}; {cores} cores; demo tokenizer (4,000 ids, Kimi-style template), stub engine; "
        f"{args.kind} prompts; median of {args.repeat}"
    )
    try:
        print("1,000 prompts (the fixed cost: imports, tokenizer):")
        small = bench(code, work, 1000, args.kind, args.repeat)
        sizes = [args.prompts] + ([1_000_000] if args.million and args.prompts != 1_000_000 else [])
        results = {}
        for n in sizes:
            print(f"{n:,} prompts:")
            results[n] = bench(code, work, n, args.kind, args.repeat)
        n = args.prompts
        fixed = small["check, 1 process"][1]
        one = results[n]["check, 1 process"]
        per = (one[1] - fixed) / (n - 1000) * 1e6
        print(
            f"\nper further prompt (check, 1 process, less the fixed {fixed:.2f} s of 1,000 prompts): "
            f"{per:.1f} µs CPU; target at most {TARGET_US:.0f} µs: {'met' if per <= TARGET_US else 'NOT met'}"
        )
        if "render stage" in results[n]:
            stage = results[n]["render stage"][1] / n * 1e6
            print(
                f"render stage alone (reading, rendering, measuring; 1 process): {stage:.1f} µs CPU per prompt; target "
                f"at most {TARGET_US:.0f} µs: {'met' if stage <= TARGET_US else 'NOT met'}"
            )
        sub = results[n]["submit after check"][0]
        print(
            f"submit after check at {n:,}: wall {sub:.2f} s; target {SUBMIT_TARGET_S:.0f} s: "
            f"{'met' if sub <= SUBMIT_TARGET_S else 'NOT met'}"
        )
        if 1_000_000 not in results:
            every = results[n]["check, every core"]
            scale = (1_000_000 - 1000) / (n - 1000)
            print(
                f"1,000,000 prompts, EXTRAPOLATED linearly from {n:,} (not measured; --million measures it): check "
                f"on 1 process ~{fixed + (one[1] - fixed) * scale:.0f} s CPU, wall ~{small['check, 1 process'][0] + (one[0] - small['check, 1 process'][0]) * scale:.0f} s; "
                f"on every core wall ~{small['check, every core'][0] + (every[0] - small['check, every core'][0]) * scale:.0f} s"
            )
        if args.profile:
            import cProfile
            import pstats

            sys.path.insert(0, str(code))
            from toolkit.job.check import preflight

            prof = cProfile.Profile()
            prof.runcall(preflight, str(work / f"{args.kind}-{n}" / "job.toml"), exact=False)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
