"""The toolkit worker against SGLang's own load generator (`python -m sglang.bench_serving`), on one real server.

One real SGLang 0.5.23 server on the CPU (the test tier's tiny random model, built here from the demo tokenizer;
tests/realsglang.py), started once through the toolkit's launch path. Against it, in turn (each round starting one
client further, `--pairs` rounds), each client sends the same prompts (chat template applied), every output forced
to the same length, with the same number of requests in flight:

- `toolkit worker` on an `external` engine, [client] loop_stop off and on: raw token ids, one request per output,
  no streaming (outputs shorter than segment_tokens are one request each with the loop stop on too); the length
  forced by min_new_tokens = max_new_tokens (the toolkit refuses ignore_eos);
- bench_serving: `--backend sglang` (/generate, streamed: an SSE chunk per token), `--dataset-name custom` over
  the same prompts, `--apply-chat-template`, `--sharegpt-output-len`, `--max-concurrency`, `--warmup-requests 0`;
  the length forced by its own ignore_eos, and again with the worker's sampling params (min_new_tokens, sent with
  `--extra-request-body`), which cost the server a penalizer per decode step.

Printed per client, medians over the rounds: output tokens/s over the whole process (start-up, tokenizer, every
request; bench_serving's own figure, which counts only its benchmark phase, beside it) and client CPU per output
token (user + system of the process and its children), all included and per extra token (against a run of one
wave of prompts: bench_serving's start-up, importing SGLang, is seconds of CPU), then the ratios and the load
average. On a machine shared with other work the figures move with its load: compare medians of several rounds.

    python benchmarks/bench_vs_bench_serving.py [--prompts 256] [--output-tokens 384] [--concurrency 16] [--pairs 3]

Needs the SGLang test environment ($TOOLKIT_SGLANG_VENV, default .venv-sglang; tests/real_sglang/install.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import KEY_ENV, REPO, external_job, run_child

CLIENTS = (
    "worker, loop stop off",
    "worker, loop stop on",
    "bench_serving",
    "bench_serving, min_new_tokens",
)
WORKERS, BENCH_SERVING = CLIENTS[:2], CLIENTS[2:]


def write_prompts(work: Path, n: int) -> tuple[Path, Path]:
    """The same `n` prompts (English words) as a toolkit dataset and as bench_serving's custom dataset."""
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    ours, theirs = work / f"prompts-{n}.jsonl", work / f"prompts-{n}-bench-serving.jsonl"
    with open(ours, "w") as a, open(theirs, "w") as b:
        for i in range(n):
            k = (i * 13) % (len(words) - 40)
            text = " ".join(words[k : k + 40]) + f" ({i})"
            a.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
            # custom: the first turn is the prompt; the second is only read for a length, which
            # --sharegpt-output-len overrides
            b.write(
                json.dumps({"conversations": [{"content": text}, {"content": "unused"}]}) + "\n"
            )
    return ours, theirs


def run_worker(
    work: Path, name: str, url: str, model: Path, prompts: Path, args, loop_stop: bool, n: int
) -> dict:
    from toolkit.formats.frames import read_shard
    from toolkit.formats.progress import read_progress
    from toolkit.formats.rundir import RunDir
    from toolkit.job.prepare import prepare_run

    run = work / f"run-{name}"
    job = external_job(
        work / f"job-{name}.toml",
        run=run,
        url=url,
        prompts=prompts,
        model=model,
        concurrency=args.concurrency,
        max_new=args.output_tokens,
        client={"loop_stop": loop_stop, "request_timeout_s": 1800},
        sampling={"min_new_tokens": args.output_tokens, "temperature": 0.0},
    )
    prepare_run(str(job))  # planning happens on the login node: not part of the worker's cost
    wall, cpu = run_child(
        [sys.executable, "-m", "toolkit", "worker", str(run), "0"], log=work / f"{name}.log"
    )
    recs = list(read_shard(run / "shards" / "00000.zst"))
    tokens = sum(r.n_output for r in recs)
    short = [r.id for r in recs if r.n_output != args.output_tokens]
    if len(recs) != n or short:
        raise SystemExit(
            f"{name}: {len(recs)} records of {n}, {len(short)} not of "
            f"{args.output_tokens} tokens (e.g. {short[:3]})"
        )
    finishes: dict[str, int] = {}
    for r in recs:
        finishes[r.finish] = finishes.get(r.finish, 0) + 1
    # its own figure, like bench_serving's: tokens over the time from its first request (the progress file's rate)
    own = read_progress(RunDir(run), 0).tok_per_s
    return {"wall": wall, "cpu": cpu, "tokens": tokens, "own_tps": own, "finishes": finishes}


def bench_serving_env(extra_path: str | None) -> dict:
    """The environment bench_serving runs in: the server's key as OPENAI_API_KEY (it sends "Authorization: Bearer
    <key>"), `extra_path` first on PYTHONPATH."""
    env = {**os.environ, "OPENAI_API_KEY": os.environ[KEY_ENV]}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, env.get("PYTHONPATH", "")])
    return env


def run_bench_serving(
    work: Path,
    name: str,
    url: str,
    model: Path,
    prompts: Path,
    args,
    python: str,
    n: int,
    worker_params: bool,
) -> dict:
    out = work / f"{name}.jsonl"
    argv = [
        python,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompts),
        "--num-prompts",
        str(n),
        "--sharegpt-output-len",
        str(args.output_tokens),
        "--apply-chat-template",
        "--max-concurrency",
        str(args.concurrency),
        "--warmup-requests",
        "0",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    if (
        worker_params
    ):  # the worker's sampling_params instead of its own (ignore_eos): the payload's are replaced
        argv += [
            "--extra-request-body",
            json.dumps(
                {
                    "sampling_params": {
                        "temperature": 0.0,
                        "max_new_tokens": args.output_tokens,
                        "min_new_tokens": args.output_tokens,
                    }
                }
            ),
        ]
    wall, cpu = run_child(argv, env=bench_serving_env(args.extra_path), log=work / f"{name}.log")
    res = json.loads(out.read_text().splitlines()[-1])
    if res["completed"] != n or res["total_output_tokens"] != n * args.output_tokens:
        raise SystemExit(
            f"{name}: bench_serving completed {res['completed']} of {n} requests, "
            f"{res['total_output_tokens']} tokens: {work / name}.log"
        )
    return {
        "wall": wall,
        "cpu": cpu,
        "tokens": res["total_output_tokens"],
        "own_tps": res["output_throughput"],
        "finishes": {},
    }


def one_run(
    client: str,
    work: Path,
    name: str,
    url: str,
    model: Path,
    prompts: tuple[Path, Path],
    args,
    n: int,
) -> dict:
    import realsglang

    if client in BENCH_SERVING:
        return run_bench_serving(
            work,
            name,
            url,
            model,
            prompts[1],
            args,
            str(realsglang.python()),
            n,
            worker_params=client.endswith("min_new_tokens"),
        )
    return run_worker(
        work, name, url, model, prompts[0], args, loop_stop=client.endswith("on"), n=n
    )


def rounds(
    args,
    work: Path,
    served,
    model: Path,
    prompts: dict,
    small: int,
    got: dict[str, list[dict]],
    loads: list[float],
) -> None:
    """`args.pairs` rounds of the clients in turn, each run appended to `got`, the load average to `loads`."""
    for rnd in range(args.pairs):
        turn = rnd % len(
            CLIENTS
        )  # each round in turn, starting one further: a slower moment hits every client
        for client in CLIENTS[turn:] + CLIENTS[:turn]:
            name = f"{rnd}-{client.replace(' ', '').replace(',', '-')}"
            few = one_run(
                client, work, name + "-small", served.url, model, prompts[small], args, small
            )
            r = one_run(
                client, work, name, served.url, model, prompts[args.prompts], args, args.prompts
            )
            r["extra_cpu"] = (r["cpu"] - few["cpu"]) / max(r["tokens"] - few["tokens"], 1)
            loads.append(os.getloadavg()[0])
            got[client].append(r)
            own = f", its own {r['own_tps']:.0f} tok/s" if r["own_tps"] else ""
            print(
                f"  round {rnd + 1} {client:<30} {r['tokens'] / r['wall']:7.1f} tok/s ({r['wall']:.1f} s"
                f"{own}), {r['cpu'] / r['tokens'] * 1e6:6.1f} µs CPU/token ({r['cpu']:.2f} s; {small} prompts "
                f"{few['cpu']:.2f} s), {r['extra_cpu'] * 1e6:6.1f} µs per extra token, load {loads[-1]:.2f}"
                + (f", finishes {r['finishes']}" if r["finishes"] else ""),
                flush=True,
            )


def summary(got: dict[str, list[dict]], loads: list[float]) -> None:
    """Medians over the rounds every client finished, and the ratios."""
    done = min(len(rs) for rs in got.values())
    got = {c: rs[:done] for c, rs in got.items()}
    med = {
        c: {
            "tps": statistics.median(r["tokens"] / r["wall"] for r in rs),
            "cpu": statistics.median(r["cpu"] / r["tokens"] for r in rs),
            "extra": statistics.median(r["extra_cpu"] for r in rs),
        }
        for c, rs in got.items()
    }
    print(
        f"medians of {done} rounds (load average over the runs: median {statistics.median(loads):.2f}, "
        f"{min(loads):.2f}-{max(loads):.2f}; 1-minute figures, {os.cpu_count()} CPUs):"
    )
    for c, m in med.items():
        own = statistics.median(r["own_tps"] for r in got[c])
        print(
            f"  {c:<30} {m['tps']:7.1f} tok/s whole process ({own:.1f} its own); client CPU {m['cpu'] * 1e6:6.1f} µs per token "
            f"all included, {m['extra'] * 1e6:6.1f} µs per extra token"
        )
    for b in BENCH_SERVING:
        own = statistics.median(r["own_tps"] for r in got[b])
        bs = med[b]
        print(f"  against {b} (its own figure, its benchmark phase only: {own:.1f} tok/s):")
        for c in WORKERS:
            m = med[c]
            mine = statistics.median(r["own_tps"] for r in got[c])
            print(
                f"    {c}: {m['tps'] / bs['tps']:.2f}x its tok/s whole process, {mine / own:.2f}x own figure to own "
                f"figure; {bs['cpu'] / m['cpu']:.1f}x less client CPU per token all included, "
                f"{bs['extra'] / m['extra']:.1f}x per extra token"
            )
    on, off = med[CLIENTS[1]], med[CLIENTS[0]]
    print(
        f"  loop stop on / off: {on['cpu'] / off['cpu']:.2f}x client CPU per token all included, "
        f"{on['extra'] / off['extra']:.2f}x per extra token, {on['tps'] / off['tps']:.2f}x tok/s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=384)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3, help="rounds of the three clients, alternating")
    ap.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs, runs) and print its path"
    )
    ap.add_argument(
        "--extra-path",
        help="a folder put first on bench_serving's PYTHONPATH: where the packages it "
        "imports and the SGLang test environment lacks are (`datasets`: pip install --target DIR "
        "--no-deps datasets pyarrow pandas multiprocess pytz tzdata)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import realsglang

    why = realsglang.missing()
    if why:
        raise SystemExit(why)
    os.environ[KEY_ENV] = "unused"
    probe = subprocess.run(
        [str(realsglang.python()), "-c", "import datasets"],
        env=bench_serving_env(args.extra_path),
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        raise SystemExit(
            f"{realsglang.python()} cannot import `datasets`, which sglang.bench_serving imports (SGLang "
            "declares it; the test environment leaves it out): install it there, or pip install --target "
            "DIR --no-deps datasets pyarrow pandas multiprocess pytz tzdata and pass --extra-path DIR"
        )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    work = Path(tempfile.mkdtemp(prefix="bench-vs-bench-serving-"))
    served = None
    small = min(args.concurrency, args.prompts)  # one wave: what start-up and a first batch cost
    try:
        model = realsglang.build_model(work / "model")
        prompts = {n: write_prompts(work, n) for n in (small, args.prompts)}
        # the server: as the test tier starts it, with room for the requests in flight
        job = realsglang.sglang_job(
            work / "server", model, n=4, client={"concurrency": args.concurrency}
        )
        served = realsglang.Served(job, str(realsglang.python()), work / "server.log")
        os.environ[KEY_ENV] = served.api_key
        print(
            f"SGLang {served.version} on the CPU, tiny model; ready in {served.ready_s:.0f} s; {args.prompts} "
            f"prompts x {args.output_tokens} output tokens, {args.concurrency} in flight; {args.pairs} rounds "
            f"(each client also runs {small} prompts per round: its start-up cost)",
            flush=True,
        )
        got: dict[str, list[dict]] = {c: [] for c in CLIENTS}
        loads = [os.getloadavg()[0]]
        try:
            rounds(args, work, served, model, prompts, small, got, loads)
        except KeyboardInterrupt:  # the rounds finished so far still say something
            print("interrupted", flush=True)
        if min(len(rs) for rs in got.values()):
            summary(got, loads)
    finally:
        if served is not None:
            served.stop()
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
