"""One engine's output tokens/s and model load time, measured on the node it runs on: the figures of a job's
[estimate] table (`tokens_per_s`, `load_minutes`), which `check` and `submit --dry-run` turn into node-hours.

The job is run here as it is (its model, engine, sampling and client settings), on a sample of its prompts: the
first --prompts lines of its datasets in turn, one shard, one engine (`toolkit run --parallel 1`), into a
temporary run directory. Its progress file gives the output tokens/s of the shard (from its first request to its
last record: the batch's drain at the end included, so take enough prompts to fill the batch several times,
at least 4 x [client] concurrency); the worker's log gives the load ("engine ready after N s"). On a GPU node,
inside an allocation (salloc, or an sbatch script) that holds the job's GPUs:

    python benchmarks/bench_node_rate.py jobs/kimi-k2.5.toml [--prompts 1024]

With the demo job it runs on the CPU against the stub (whose rate means nothing for a GPU).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.formats.progress import read_progress  # noqa: E402
from toolkit.formats.rundir import RunDir  # noqa: E402
from toolkit.job.spec import load_spec  # noqa: E402


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return (
            "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"
        )
    raise TypeError(v)


def job_text(spec: dict) -> str:
    """A resolved job spec (msgspec.to_builtins of JobSpec) as TOML."""
    lines = []
    tables = {k: v for k, v in spec.items() if isinstance(v, dict) and k != "sampling"}
    for key, value in spec.items():
        if key not in tables and key not in ("datasets", "sampling") and value is not None:
            lines.append(f"{key} = {toml_value(value)}")
    lines += ["[sampling]"] + [f"{k} = {toml_value(v)}" for k, v in spec["sampling"].items()]
    for table, keys in tables.items():
        lines.append(f"[{table}]")
        nested = {
            k: v for k, v in keys.items() if isinstance(v, dict) and k != "env" and k != "extra"
        }
        lines += [
            f"{k} = {toml_value(v)}" for k, v in keys.items() if v is not None and k not in nested
        ]
        for name, sub in nested.items():
            lines.append(f"[{table}.{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in sub.items() if v is not None]
    for d in spec["datasets"]:
        lines.append("[[datasets]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in d.items() if v is not None and v != {}]
    return "\n".join(lines) + "\n"


def sample_prompts(spec: dict, n: int, out: Path) -> int:
    """The first lines of each dataset in turn, up to `n`, into `out`; how many were taken."""
    files = [open(d["path"], "rb") for d in spec["datasets"]]
    taken = 0
    with open(out, "wb") as w:
        while taken < n and files:
            for f in list(files):
                line = f.readline()
                if not line:
                    files.remove(f)
                    continue
                if line.strip():
                    w.write(line if line.endswith(b"\n") else line + b"\n")
                    taken += 1
                    if taken == n:
                        break
    return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", help="the job whose engine is measured")
    ap.add_argument(
        "--prompts", type=int, default=1024, help="prompts to generate (at least 4 x concurrency)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary run")
    args = ap.parse_args()

    spec = msgspec.to_builtins(load_spec(args.job))
    tmp = Path(tempfile.mkdtemp(prefix="bench-node-rate-"))
    try:
        taken = sample_prompts(spec, args.prompts, tmp / "prompts.jsonl")
        spec.update(name="node-rate", output_dir=str(tmp / "run"))
        spec["datasets"] = [{"name": "sample", "path": str(tmp / "prompts.jsonl")}]
        spec["sharding"]["shards"] = 1
        (tmp / "job.toml").write_text(job_text(spec))
        cmd = [
            sys.executable,
            "-m",
            "toolkit",
            "run",
            str(tmp / "job.toml"),
            "--parallel",
            "1",
            "--no-merge",
            "--quiet",
        ]
        r = subprocess.run(cmd, cwd=REPO)
        if r.returncode != 0:
            sys.exit(
                f"toolkit run exited {r.returncode}; the run's logs are in {tmp / 'run' / 'logs'}"
            )
        rd = RunDir(tmp / "run")
        p = read_progress(rd, 0)
        ready = re.findall(
            r"engine ready after ([\d.]+) s", rd.log_file(0).read_text(errors="replace")
        )
        load = float(ready[0]) if ready else None
        kind = spec["engine"]["kind"]
        print(
            f"{taken} prompts, {p.done - p.failed} outputs, {p.output_tokens:,} output tokens on one engine "
            f"({kind}, tp {spec['engine']['tp_size']}, dp {spec['engine']['dp_size']}, concurrency "
            f"{spec['client']['concurrency']})"
        )
        print(
            f"output tokens/s: {p.tok_per_s:,.0f} (first request to last record); load: "
            f"{'unknown' if load is None else f'{load:.0f} s'}"
        )
        print("for the job's [estimate] table:")
        print(f"tokens_per_s = {p.tok_per_s:.0f}")
        if load is not None:
            print(f"load_minutes = {max(1, round(load / 60))}")
        if p.done - p.failed:
            print(f"mean_output_tokens = {round(p.output_tokens / (p.done - p.failed))}")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
