"""Worker cost per output token, against the stub engine in instant mode, and a naive client for comparison.

Outputs are 4,096 tokens (like real reasoning traces) whose ids come from encoding real English text
(pydoc_data.topics) with the demo job's tokenizer. The stub runs as a separate process (an `external` engine
for the worker), so the CPU time measured is the worker's alone, all of its work included: reading the plan
and prompts, loading the tokenizer, rendering, HTTP, decoding, checking, splitting, encoding, compressing,
fsyncing. The naive client posts the same prompts with aiohttp, parses with stdlib json and writes JSONL+gzip.

    python benchmarks/bench_worker.py [--prompts 4000] [--repeat 3]

It runs each client on N/8 and N prompts, and prints the cost per token all included (start-up, tokenizer
loading and chat-template rendering amortised over the run) and per extra token (the slope between the two).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _common import KEY_ENV, TOKENIZER, child_cpu, external_job, process_cpu

OUTPUT_TOKENS = 4096

NAIVE = r"""
import asyncio, gzip, json, sys
import aiohttp
from transformers import AutoTokenizer

async def main(url, key, prompts_path, out_path, concurrency):
    tok = AutoTokenizer.from_pretrained(sys.argv[6])
    prompts = [json.loads(l) for l in open(prompts_path)]
    sem = asyncio.Semaphore(concurrency)
    out = gzip.open(out_path, "wt")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async def one(p):
            ids = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            async with sem:
                async with s.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8192}}) as r:
                    body = json.loads(await r.text())
            out.write(json.dumps({"id": p["id"], "prompt_ids": ids, **body}) + "\n")
        await asyncio.gather(*(one(p) for p in prompts))
    out.close()

asyncio.run(main(*sys.argv[1:5], int(sys.argv[5])))
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    import pydoc_data.topics

    from toolkit.engines.stub import start_standalone
    from toolkit.job.prepare import prepare_run

    words = " ".join(pydoc_data.topics.topics.values()).split()
    work = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    key = "benchkey"
    os.environ[KEY_ENV] = key  # the workers read the server's key from their environment
    stub, url = start_standalone(
        str(TOKENIZER),
        "--api-key",
        key,
        "--fixed-output-tokens",
        str(OUTPUT_TOKENS),
        "--context-length",
        "32768",
    )
    try:
        prompts = work / "prompts.jsonl"
        with open(prompts, "w") as f:
            for i in range(args.prompts):
                f.write(
                    json.dumps({"id": f"p{i}", "prompt": " ".join(words[i * 13 : i * 13 + 40])})
                    + "\n"
                )
        sizes_n = [max(1, args.prompts // 8), args.prompts]
        cpu = {(who, n): [] for who in ("toolkit", "naive") for n in sizes_n}
        disk = {}
        stub_cpu: list[float] = []  # the stub's CPU per request, over the toolkit's large runs
        for rep in range(args.repeat):
            for n in sizes_n:
                part = work / f"prompts{n}.jsonl"
                part.write_text("".join(prompts.read_text().splitlines(keepends=True)[:n]))
                run = work / f"run{rep}-{n}"
                job = external_job(
                    work / f"job{rep}-{n}.toml",
                    run=run,
                    url=url,
                    prompts=part,
                    concurrency=args.concurrency,
                    max_new=8192,
                )
                prepare_run(
                    str(job)
                )  # planning happens on the login node: not part of the worker's cost
                stub_before = process_cpu(stub.pid)
                cpu["toolkit", n].append(
                    child_cpu([sys.executable, "-m", "toolkit", "worker", str(run), "0"])
                )
                if n == sizes_n[-1]:
                    stub_cpu.append((process_cpu(stub.pid) - stub_before) / n)
                disk["toolkit", n] = (run / "shards" / "00000.zst").stat().st_size
                out = work / f"naive{rep}-{n}.jsonl.gz"
                cpu["naive", n].append(
                    child_cpu(
                        [
                            sys.executable,
                            "-c",
                            NAIVE,
                            url,
                            key,
                            str(part),
                            str(out),
                            str(args.concurrency),
                            str(TOKENIZER),
                        ]
                    )
                )
                disk["naive", n] = out.stat().st_size
        small, large = sizes_n
        med = {k: statistics.median(v) for k, v in cpu.items()}
        tok_l, tok_s = large * OUTPUT_TOKENS, small * OUTPUT_TOKENS
        print(
            f"outputs of {OUTPUT_TOKENS} tokens; runs of {small} and {large} prompts; medians of {args.repeat}"
        )
        rows = {}
        for who in ("toolkit", "naive"):
            total = med[who, large] / tok_l * 1e9
            marginal = (med[who, large] - med[who, small]) / (tok_l - tok_s) * 1e9
            fixed = med[who, large] - marginal * tok_l / 1e9
            rows[who] = (total, marginal, disk[who, large] / tok_l)
            print(
                f"  {who:<8}: {med[who, large]:6.2f} CPU s for {tok_l:,} tokens = {total:6.1f} ns/token all included; "
                f"{marginal:6.1f} ns/token per extra token (fixed start-up {fixed:4.1f} s); "
                f"{disk[who, large] / tok_l:4.2f} B/token on disk"
            )
        t, n = rows["toolkit"], rows["naive"]
        print(
            f"  ratios  : {n[0] / t[0]:4.1f}x less CPU per token all included, {n[1] / t[1]:4.1f}x per extra token, "
            f"{n[2] / t[2]:4.1f}x fewer bytes"
        )
        print(
            f"  stub    : {statistics.median(stub_cpu) * 1e6:6.0f} µs CPU per {OUTPUT_TOKENS}-token request "
            f"(FastAPI on uvicorn, in its own process; not part of the figures above)"
        )
        print(
            "  all runs (CPU s): "
            + "  ".join(f"{who} {n}: {[round(x, 2) for x in v]}" for (who, n), v in cpu.items())
        )
    finally:
        os.killpg(stub.pid, 9)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
