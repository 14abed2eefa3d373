"""What stopping repetition loops in flight costs and saves ([client] loop_stop).

Two ways to see a loop while it is generated: stream `/generate` and watch the ids as they come, or ask for the
output in segments of a few thousand tokens and look between segments (the next segment goes on from prompt +
output so far; the server's radix cache holds that prefix). This prints:

1. Client CPU per output token of the worker (all of it: HTTP, parsing, checks, records, compression), against
   the stub engine in its own process: loop stop off (one request per output, today's) and segments of 4,096,
   2,048 and 1,024 tokens, runs alternating. No loops here: the cost every output pays.
2. Client CPU per token of a streaming client (SSE, an event per token, incremental output_ids: the cheapest a
   stream gets), against the one-request client (engines/endpoints.generate) in the same process and harness.
3. Decoded tokens spent on looping outputs against running them to max_new_tokens: measured with the worker on the
   stub (its loops set in within the first 40 tokens), and computed with the detector itself on synthetic outputs
   for loops that set in later (at a point drawn uniformly, or like the mission's output lengths: lognormal,
   median 5k, sigma 0.9), which no method stops before they set in.

    python benchmarks/bench_loop_stop.py [--prompts 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec
import numpy as np
from _common import KEY_ENV, TOKENIZER, child_cpu, external_job

MAX_NEW = 32768  # the recipes' max_new_tokens
SCALE = 16384  # the stub's outputs: uniform 8-95 % of this (mean ~8k tokens), a tenth longer
KEY = "benchkey"


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker_run(
    work: Path, url: str, prompts: Path, name: str, segment: int | None
) -> tuple[float, list]:
    """(worker CPU s, records) of one shard run by `toolkit worker` on the external stub."""
    from toolkit.formats.frames import read_shard
    from toolkit.job.prepare import prepare_run

    run, job = work / f"run-{name}", work / f"job-{name}.toml"
    external_job(
        job,
        run=run,
        url=url,
        prompts=prompts,
        concurrency=32,
        max_new=MAX_NEW,
        client={"loop_stop": bool(segment), "segment_tokens": segment or 4096},
    )
    prepare_run(str(job))  # planning happens on the login node: not part of the worker's cost
    cpu = child_cpu([sys.executable, "-m", "toolkit", "worker", str(run), "0"])
    return cpu, list(read_shard(run / "shards" / "00000.zst"))


def write_prompts(path: Path, n: int, offset: int = 0) -> Path:
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    with open(path, "w") as f:
        for i in range(offset, offset + n):
            k = (i * 13) % (len(words) - 40)
            f.write(
                json.dumps({"id": f"p{i}", "prompt": " ".join(words[k : k + 40]) + f" ({i})"})
                + "\n"
            )
    return path


def stub(*args: str):
    from toolkit.engines.stub import start_standalone

    return start_standalone(str(TOKENIZER), "--api-key", KEY, "--context-length", "65536", *args)


# --- 1. the worker's CPU per token --------------------------------------------------------------------------------
def worker_cpu(work: Path, n: int, repeat: int) -> dict:
    proc, url = stub("--output-scale", str(SCALE))
    methods = {
        "one request (today)": None,
        "segments of 4096": 4096,
        "segments of 2048": 2048,
        "segments of 1024": 1024,
    }
    got: dict = {m: [] for m in methods}
    tokens = requests = 0
    try:
        prompts = write_prompts(work / "prompts.jsonl", n)
        for rep in range(repeat):
            for (
                m,
                seg,
            ) in methods.items():  # alternating, so that a slower moment of the machine hits each
                cpu, recs = worker_run(work, url, prompts, f"{rep}-{seg}", seg)
                got[m].append(cpu)
                tokens = sum(r.n_output for r in recs)
                outs = {r.id: r.output_ids for r in recs}
                if seg is None:
                    ref = outs
                elif outs != ref:
                    raise SystemExit(
                        f"segments of {seg}: the outputs differ from the one-request outputs"
                    )
                requests = sum(r.segments for r in recs)
    finally:
        os.killpg(proc.pid, 9)
    med = {m: statistics.median(v) for m, v in got.items()}
    base = med["one request (today)"]
    print(
        f"1. worker CPU per output token, all included (start-up, rendering, HTTP, parsing, checks, records), "
        f"{n} prompts, outputs of {tokens / n:,.0f} tokens on average, max_new_tokens {MAX_NEW:,}; medians of "
        f"{repeat}; outputs token-identical in every method"
    )
    for m, v in med.items():
        print(
            f"   {m:<22} {v / tokens * 1e9:6.1f} ns/token  ({v:5.2f} CPU s for {tokens:,} tokens; "
            f"{v / base:4.2f}x today's, {(v - base) / tokens * 1e9:+6.1f} ns/token)"
        )
    print(
        f"   (requests at segments of 1024: {requests:,} for {n} outputs; runs: "
        + "  ".join(f"{m.split(' of ')[-1]} {[round(x, 2) for x in v]}" for m, v in got.items())
        + ")"
    )
    return med


# --- 2. a streaming client ----------------------------------------------------------------------------------------
class _Chunk(msgspec.Struct):
    output_ids: list[int]


_chunk = msgspec.json.Decoder(_Chunk)


async def _stream_one(host: str, port: int, body: bytes, check_every: int) -> int:
    """One streamed /generate: SSE events read off the chunked body, each decoded, ids gathered, the loop check
    run every `check_every` tokens (as a streaming loop stop would). Returns the tokens received."""
    from toolkit.formats.loops import repetition_loop

    reader, writer = await asyncio.open_connection(host, port, limit=1 << 24)
    writer.write(
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAuthorization: "
        f"Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await reader.readuntil(b"\r\n\r\n")
    ids: list[int] = []
    buf, next_check = b"", check_every
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            break
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event[6:] if event.startswith(b"data: ") else b""
            if not data or data == b"[DONE]":
                continue
            ids += _chunk.decode(data).output_ids
            if len(ids) >= next_check:
                repetition_loop(np.array(ids, dtype="<u4"))
                next_check += check_every
    writer.close()
    return len(ids)


async def _requests(url: str, n: int, tokens: int, stream: bool) -> int:
    from urllib.parse import urlsplit

    from toolkit.engines.client import HttpClient
    from toolkit.engines.endpoints import generate

    u = urlsplit(url)
    sem = asyncio.Semaphore(16)
    http = HttpClient(url, api_key=KEY)
    params = {"max_new_tokens": tokens, "ignore_eos": True}

    async def one(i: int) -> int:
        ids = list(range(100 + i, 140 + i))
        async with sem:
            if stream:
                body = json.dumps(
                    {"input_ids": ids, "sampling_params": params, "stream": True}
                ).encode()
                return await _stream_one(u.hostname, u.port, body, 1024)
            return len((await generate(http, ids, params, timeout=600, retries=0)).output_ids)

    try:
        return sum(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        http.close()


def streaming_cpu(n: int, tokens: int, repeat: int) -> dict:
    proc, url = stub("--incremental-streaming-output")
    out: dict = {"one request": [], "streamed": []}
    try:
        for _ in range(repeat):
            for how in out:
                t0 = self_cpu()
                got = asyncio.run(_requests(url, n, tokens, how == "streamed"))
                out[how].append((self_cpu() - t0) / got * 1e9)
    finally:
        os.killpg(proc.pid, 9)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(
        f"2. client CPU per token, {n} requests of {tokens} tokens, 16 at once (medians of {repeat}): one request "
        f"{med['one request']:.0f} ns/token, streamed (an event per token, incremental ids, a loop check every "
        f"1,024) {med['streamed']:.0f} ns/token: {med['streamed'] / med['one request']:.0f}x"
    )
    return med


# --- 3. tokens spent on loops -------------------------------------------------------------------------------------
def loops_on_the_stub(work: Path, n: int, fraction: float) -> None:
    proc, url = stub("--output-scale", str(SCALE), "--degenerate-fraction", str(fraction))
    try:
        prompts = write_prompts(work / "prompts-loops.jsonl", n, offset=10_000)
        _, off = worker_run(work, url, prompts, "loops-off", None)
        _, on = worker_run(work, url, prompts, "loops-on", 4096)
    finally:
        os.killpg(proc.pid, 9)
    from toolkit.dataset.quality import record_loop
    from toolkit.formats.records import LOOP

    looping = {r.id for r in off if r.finish == "length" and record_loop(r) is not None}
    stopped = {r.id: r for r in on if r.finish == LOOP}
    spent_off = sum(r.n_output for r in off if r.id in looping)
    spent_on = sum(stopped[i].n_output for i in looping if i in stopped)
    all_off, all_on = sum(r.n_output for r in off), sum(r.n_output for r in on)
    print(
        f"3a. the worker on the stub, {n} prompts, {len(looping)} looping ({fraction:.0%} drawn), max_new_tokens "
        f"{MAX_NEW:,}, segments of 4096: {len(stopped)} stopped; tokens decoded on them {spent_on:,} against "
        f"{spent_off:,} run to max_new_tokens ({spent_on / max(spent_off, 1):.1%}); all decoded tokens "
        f"{all_on:,} against {all_off:,} ({1 - all_on / all_off:.1%} fewer)"
    )


def spent_by_onset(segment: int, onsets: np.ndarray, rng: np.random.Generator) -> float:
    """Mean decoded tokens of looping outputs, over max_new_tokens, when each loop sets in at its onset: the
    output is text (distinct-ish ids), then a span of 4-24 ids repeated; stopped at the first segment end at which
    the detector sees it (else at max_new_tokens)."""
    from toolkit.formats.loops import repetition_loop

    spent = []
    for s in onsets:
        s = int(s)
        span = rng.integers(100, 4000, int(rng.integers(4, 25))).astype("<u4")
        ends = range(segment, MAX_NEW, segment)
        stop = MAX_NEW
        for end in ends:
            if end <= s + 64:
                continue
            text = rng.integers(100, 4000, min(s, end)).astype("<u4")[-1024:]
            loop = np.resize(span, end - s)
            if repetition_loop(np.concatenate([text, loop])[-1024:]) is not None:
                stop = end
                break
        spent.append(stop)
    return float(np.mean(spent)) / MAX_NEW


def loops_by_onset(samples: int) -> None:
    rng = np.random.default_rng(0)
    onsets = {
        "early (within 1k tokens)": rng.integers(0, 1024, samples),
        "uniform over max_new_tokens": rng.integers(0, MAX_NEW, samples),
        "like output lengths (lognormal 5k, sigma 0.9)": np.minimum(
            rng.lognormal(np.log(5000), 0.9, samples), MAX_NEW - 1
        ),
    }
    print(
        "3b. decoded tokens of a looping output / max_new_tokens, by where the loop sets in (detector on synthetic "
        f"outputs, {samples} each); the floor is stopping where it sets in"
    )
    for name, on in onsets.items():
        floor = float(np.mean(on)) / MAX_NEW
        row = "  ".join(
            f"seg {seg}: {spent_by_onset(seg, on, rng):5.1%}" for seg in (4096, 2048, 1024)
        )
        print(f"   {name:<46} floor {floor:5.1%}  {row}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--loop-prompts", type=int, default=200)
    ap.add_argument("--loop-fraction", type=float, default=0.05)
    args = ap.parse_args()
    os.environ[KEY_ENV] = KEY  # the workers read the server's key from their environment
    work = Path(tempfile.mkdtemp(prefix="bench-loop-stop-"))
    try:
        worker_cpu(work, args.prompts, args.repeat)
        streaming_cpu(16, 8192, args.repeat)
        loops_on_the_stub(work, args.loop_prompts, args.loop_fraction)
        loops_by_onset(200)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
