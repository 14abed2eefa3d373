"""Login-node cost of a large run: plan and submit 1,000 shards / 100,000 prompts, then `toolkit status` on it.

Targets: `toolkit submit` under 10 s wall with no per-prompt file in the run directory; `toolkit status` under 2 s.

The prompts are real English text (pydoc_data.topics) split over eight datasets, as in a real job; the job uses
the demo tokenizer and the stub engine, one GPU per task, and `[slurm] extra = { hold = true }` so that every
array task stays held in the queue: nothing runs, only the login-node side is measured. Each command runs as a
subprocess, end to end, as a user types it; wall time and CPU time (the command and the Slurm commands it runs)
are taken:

- `toolkit submit JOB`: spec, every prompt line, tokenizer and template check, plan, run directory, submitit
  pickles, one sbatch per array (MaxArraySize splits the shards) and the merge job. Repeated on fresh run
  directories, the previous run cancelled first.
- `toolkit submit JOB --dry-run`: the same without the run directory and the sbatch calls.
- `toolkit status RUN` on the submitted (held) run: squeue, sacct and one row per shard.

The files the submit created in the run directory are counted. Every submitted run is cancelled at the end
(`toolkit cancel`) and the temporary folder deleted. When a target is missed (or with --profile), where the
time goes is printed too: the slowest imports (python -X importtime) and a cProfile of each command.

Needs the local Slurm cluster (or a real one): `eval "$(bash slurm/start.sh)"` first, which exports SLURM_CONF.

    python benchmarks/bench_submit.py [--shards 1000] [--prompts 100000] [--datasets 8] [--repeat 3] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.cluster.jobs import read_jobs  # noqa: E402
from toolkit.formats.rundir import RunDir  # noqa: E402

TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"
SUBMIT_TARGET_S = 10.0
STATUS_TARGET_S = 2.0
STATUS_REPEAT = 5

JOB_HEAD = """name = "bench-submit"
output_dir = "{run}"
[model]
path = "{tokenizer}"
[engine]
kind = "stub"
[sampling]
max_new_tokens = 256
[sharding]
shards = {shards}
[slurm]
time = "01:00:00"
gpus_per_node = 1
cpus_per_task = 1
array_parallelism = 1
extra = {{ hold = true }}
"""


def write_datasets(folder: Path, prompts: int, datasets: int) -> list[tuple[str, Path]]:
    """`prompts` chat prompts of real English words, split evenly over `datasets` JSONL files."""
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    span = len(words) - 40
    out = []
    per = prompts // datasets
    for j in range(datasets):
        n = per + (1 if j < prompts % datasets else 0)
        path = folder / f"dataset{j}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                g = j * per + i
                start = (g * 7) % span
                text = " ".join(words[start : start + 12 + (g % 5) * 3])
                f.write(
                    json.dumps(
                        {"id": f"d{j}-{i:05d}", "messages": [{"role": "user", "content": text}]}
                    )
                    + "\n"
                )
        out.append((f"dataset{j}", path))
    return out


def write_job(path: Path, run: Path, shards: int, datasets: list[tuple[str, Path]]) -> Path:
    lines = [JOB_HEAD.format(run=run, tokenizer=TOKENIZER, shards=shards)]
    for name, p in datasets:
        lines.append(f'[[datasets]]\nname = "{name}"\npath = "{p}"\n')
    path.write_text("\n".join(lines))
    return path


def timed(argv: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, float, str]:
    """Run a command to completion: (wall s, CPU s of it and its children, stdout); an exit code not in `ok` stops
    the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in ok:
        raise SystemExit(f"`{' '.join(argv)}` exited {r.returncode}:\n{r.stderr or r.stdout}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r.stdout


def toolkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *args]


def count_files(root: Path) -> tuple[int, int, Counter]:
    """Files (symlinks included) and folders under `root`, and how many files of each kind."""
    kinds: Counter = Counter()
    files = folders = 0
    for folder, dirs, names in os.walk(root):
        folders += len(dirs)
        rel = Path(folder).relative_to(root).parts
        for name in names:
            files += 1
            link = " (symlinks)" if os.path.islink(os.path.join(folder, name)) else ""
            if (
                rel and rel[0] == "slurm" and name != "jobs.json"
            ):  # submitit's files: one folder per job / array task
                kinds[f"slurm/{'<job>/' if len(rel) > 1 else ''}*{Path(name).suffix}{link}"] += 1
            else:
                kinds["/".join([*rel, name])] += 1
    return files, folders, kinds


def check_held(run: Path) -> tuple[int, Counter]:
    """squeue on the run's jobs: every array task must be pending (held), none running. Returns (arrays, states)."""
    jobs = read_jobs(RunDir(run))
    sub = jobs.submissions[-1]
    array_ids = [a.job_id for a in sub.arrays]
    out = subprocess.run(
        ["squeue", "-h", "-r", "-j", ",".join(array_ids), "-o", "%i|%T|%r"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    states: Counter = Counter()
    for line in out.splitlines():
        _, state, reason = line.split("|", 2)
        states[f"{state} ({reason})"] += 1
    tasks = sum(
        len(a.tasks) or 1 for a in sub.arrays
    )  # claiming arrays: as many tasks as may run at once
    pending = sum(n for s, n in states.items() if s.startswith("PENDING"))
    if pending != tasks:
        raise SystemExit(
            f"expected {tasks} pending array tasks of {run}, squeue shows {dict(states)}"
        )
    return len(sub.arrays), states


def cancel(run: Path) -> None:
    if RunDir(run).jobs_file.exists():
        subprocess.run(toolkit("cancel", str(run)), capture_output=True, text=True)


def top_imports(argv: list[str], n: int = 12) -> list[str]:
    """The slowest modules to import in `argv` (cumulative, as python -X importtime reports them)."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True
    )
    rows = []
    for line in r.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cum_us, name = line[len("import time:") :].split("|", 2)
        rows.append((int(cum_us), int(self_us), name.rstrip()))
    # top-level imports and the ones directly below them: the indentation of the name is the nesting level
    rows = [r for r in rows if len(r[2]) - len(r[2].lstrip()) <= 4]
    rows.sort(reverse=True)
    return [
        f"{cum / 1e6:6.2f} s cumulative {self / 1e6:6.3f} s self  {name.strip()}"
        for cum, self, name in rows[:n]
    ]


def profile(argv: list[str], out: Path, n: int = 15) -> list[str]:
    """cProfile of a toolkit command run in its own process: the toolkit's functions by cumulative time, then
    every function by its own time."""
    import io

    subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(out), *argv[1:]],
        capture_output=True,
        text=True,
    )
    lines = []
    for sort, restrict, title in (
        ("cumulative", "/toolkit/", "toolkit functions by cumulative time"),
        ("tottime", "", "all functions by own time"),
    ):
        buf = io.StringIO()
        pstats.Stats(str(out), stream=buf).sort_stats(sort).print_stats(restrict, n)
        text = buf.getvalue()
        lines.append(f"{title}:")
        for line in text[text.find("   ncalls") :].rstrip().splitlines():
            line = line.replace(
                str(REPO) + "/", ""
            )  # paths shown from the package (or the stdlib) on
            lines.append("  " + re.sub(r"\S*/(site-packages|lib/python3\.\d+)/", "", line))
    return lines


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--datasets", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="submits (and dry runs) measured")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print where the time goes even when the targets are met",
    )
    args = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit(
            'SLURM_CONF is not set: start the local Slurm cluster first with `eval "$(bash slurm/start.sh)"` '
            "(or run this on a Slurm login node)"
        )

    work = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    runs: list[Path] = []
    try:
        datasets = write_datasets(work, args.prompts, args.datasets)
        print(
            f"{args.prompts:,} prompts in {args.datasets} datasets "
            f"({sum(p.stat().st_size for _, p in datasets) / 1e6:.1f} MB of JSONL), {args.shards:,} shards, "
            f"demo tokenizer, stub engine, tasks held"
        )

        dry = {"wall": [], "cpu": []}
        sub = {"wall": [], "cpu": []}
        files = folders = kinds = arrays = states = None
        for rep in range(args.repeat):
            run = work / f"dry{rep}"
            wall, cpu, _ = timed(
                toolkit(
                    "submit",
                    str(write_job(work / f"dry{rep}.toml", run, args.shards, datasets)),
                    "--dry-run",
                )
            )
            if run.exists():
                raise SystemExit(f"--dry-run created {run}")
            dry["wall"].append(wall)
            dry["cpu"].append(cpu)

            if runs:
                cancel(runs[-1])
            run = work / f"run{rep}"
            job = write_job(work / f"job{rep}.toml", run, args.shards, datasets)
            runs.append(run)
            wall, cpu, _ = timed(toolkit("submit", str(job)))
            sub["wall"].append(wall)
            sub["cpu"].append(cpu)
            arrays, states = check_held(run)
            files, folders, kinds = count_files(run)

        last = runs[-1]
        stat = {"wall": [], "cpu": []}
        for _ in range(STATUS_REPEAT):
            wall, cpu, out = timed(
                toolkit("status", str(last)), ok=(5,)
            )  # held, so still going: exit 5
            stat["wall"].append(wall)
            stat["cpu"].append(cpu)
        rows = sum(1 for line in out.splitlines() if line[:5].strip().isdigit())

        rd = RunDir(last)
        run_json = rd.plan_file.stat().st_size
        refs = rd.prompts_file.stat().st_size
        print(
            f"\nsubmit ({args.repeat} fresh run directories): wall {[round(x, 2) for x in sub['wall']]} s, "
            f"CPU {[round(x, 2) for x in sub['cpu']]} s"
        )
        print(
            f"dry-run: wall {[round(x, 2) for x in dry['wall']]} s, CPU {[round(x, 2) for x in dry['cpu']]} s"
        )
        print(
            f"status ({STATUS_REPEAT} runs, {rows} shard rows): wall {[round(x, 3) for x in stat['wall']]} s, "
            f"CPU {[round(x, 3) for x in stat['cpu']]} s"
        )
        print(
            f"squeue after submit: {arrays} arrays, "
            + ", ".join(f"{n} {s}" for s, n in states.most_common())
        )
        print(
            f"run directory: {files} files ({files / args.shards:.2f} per shard, "
            f"{files / args.prompts:.4f} per prompt) in {folders} folders"
        )
        for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:6d}  {kind}")
        print(
            f"  run.json {run_json / 1e3:.1f} kB; prompts.msgpack (the prompt index: dataset, line, offset per prompt) "
            f"{refs / 1e6:.2f} MB = {refs / args.prompts:.1f} B per prompt"
        )

        s_w, s_c, d_w, d_c, st_w, st_c = (
            med(sub["wall"]),
            med(sub["cpu"]),
            med(dry["wall"]),
            med(dry["cpu"]),
            med(stat["wall"]),
            med(stat["cpu"]),
        )
        ok_submit = s_w < SUBMIT_TARGET_S
        ok_status = st_w < STATUS_TARGET_S
        print(
            f"\nsubmit: {args.shards:,} shards / {args.prompts:,} prompts: median {s_w:.1f} s wall ({s_c:.1f} s CPU), "
            f"{files:,} files in the run dir ({files / args.shards:.1f} per shard), {arrays} arrays "
            f"[target < {SUBMIT_TARGET_S:.0f} s: {'met' if ok_submit else 'MISSED'}]; "
            f"dry-run: median {d_w:.1f} s wall ({d_c:.1f} s CPU), no files; "
            f"status: median {st_w:.2f} s wall ({st_c:.2f} s CPU) "
            f"[target < {STATUS_TARGET_S:.0f} s: {'met' if ok_status else 'MISSED'}]"
        )

        if args.profile or not ok_status:
            cmd = toolkit("status", str(last))
            print("\nwhere `toolkit status` spends its time -- slowest imports:")
            print("\n".join("  " + line for line in top_imports(cmd)))
            print("cProfile:")
            print("\n".join("  " + line for line in profile(cmd, work / "status.prof")))
        if args.profile or not ok_submit:
            cancel(last)
            run = work / "profiled"
            runs.append(run)
            cmd = toolkit(
                "submit", str(write_job(work / "profiled.toml", run, args.shards, datasets))
            )
            print("\nwhere `toolkit submit` spends its time -- slowest imports (--dry-run):")
            print("\n".join("  " + line for line in top_imports([*cmd, "--dry-run"])))
            print("cProfile:")
            print("\n".join("  " + line for line in profile(cmd, work / "submit.prof", 25)))
    finally:
        for run in runs:
            cancel(run)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
