"""A worker always ends: a hundred one-prompt shards in a row end every time, with nothing they started left behind,
and the exit guard ends a worker whose tasks do not end (exit 6, a log line naming what did not finish)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jobfiles import make_job, prepared_run
from toolkit.engines.stub import start_standalone
from toolkit.errors import EXIT_STUCK
from toolkit.formats.manifests import read_done
from toolkit.formats.rundir import RunDir
from toolkit.worker.exitguard import ExitGuard

RUNS = 100

# One process runs every shard in a row, as `toolkit run` does: a run that never ends is a hang (the process is
# ended by the exit guard with exit 6, or by the test's timeout).
_DRIVER = textwrap.dedent("""
    import json, sys, threading
    from toolkit.worker.run import run_shard
    run, n = sys.argv[1], int(sys.argv[2])
    baseline = {t.ident for t in threading.enumerate()}
    out = []
    for k in range(n):
        result = run_shard(run, k)
        extra = [t.name for t in threading.enumerate() if t.ident not in baseline and t.is_alive()]
        out.append({"shard": k, "result": result.end.value, "threads_left": extra})
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


@pytest.mark.slow
def test_a_hundred_one_prompt_shards_in_a_row_all_end_with_nothing_left_running(tmp_path, kimi):
    proc, url = start_standalone(str(kimi), "--context-length", "32768")
    try:
        job = make_job(
            tmp_path,
            kimi,
            n=RUNS,
            shards=RUNS,
            engine={"kind": "external", "url": url, "shutdown_timeout_s": 5, "exit_grace_s": 20},
            client={"concurrency": "auto"},
            sampling={"max_new_tokens": 16},
        )
        rd, _ = prepared_run(job)
        t0 = time.monotonic()
        try:  # ~0.1 s a shard; a shard whose tasks do not end costs 10 s or more
            r = subprocess.run(
                [sys.executable, "-c", _DRIVER, str(rd.root), str(RUNS)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        except subprocess.TimeoutExpired:
            stuck = [
                k
                for k in range(RUNS)
                if rd.log_file(k).exists() and "did not end" in rd.log_file(k).read_text()
            ]
            pytest.fail(
                f"{RUNS} one-prompt shards did not end within 300 s; shards whose tasks did not end when "
                f"cancelled: {stuck[:10]}"
            )
        took = time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert r.returncode == 0, (
        f"exit {r.returncode} (6: the exit guard ended a stuck worker)\n{r.stderr[-3000:]}"
    )
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["result"] for x in runs] == ["done"] * RUNS
    assert [x for x in runs if x["threads_left"]] == [], "a shard's threads outlived it"
    for k in range(RUNS):
        assert read_done(rd.done_file(k)).records == 1
        log = rd.log_file(k).read_text()
        for unaccounted in ("still running at the end", "did not end", "has not ended"):
            assert unaccounted not in log, f"shard {k}: {unaccounted!r} in its log:\n{log}"
    print(f"{RUNS} one-prompt shards in {took:.1f} s ({took / RUNS * 1000:.0f} ms each)")


def test_the_exit_guard_ends_the_process_when_the_work_is_over_and_a_task_does_not_end():
    import asyncio

    exits, steps = [], []

    async def main():
        loop = asyncio.get_running_loop()
        guard = ExitGuard(7, loop, exit=exits.append)
        guard.before_exit += [
            lambda: steps.append("flushed"),
            lambda: steps.append("engine killed"),
        ]

        async def deaf():  # a task that swallows every cancel
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    pass

        task = asyncio.ensure_future(deaf(), loop=loop)
        guard.arm(5.0, "its prompts were all answered")
        guard.arm(0.3, "SIGTERM asked it to stop")  # an earlier deadline brings it forward
        guard.arm(60.0, "later")  # a later one never pushes it back
        task.cancel()
        t0 = time.monotonic()
        while not exits and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        return time.monotonic() - t0, task

    waited, _ = _run_until_guard(main)
    assert exits == [EXIT_STUCK] and steps == ["flushed", "engine killed"]
    assert 0.25 <= waited < 2.0


def _run_until_guard(main):
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        for t in asyncio.all_tasks(loop):
            t.cancel()
        loop.close()


def test_a_disarmed_guard_never_fires():
    import asyncio

    exits = []
    loop = asyncio.new_event_loop()
    try:
        guard = ExitGuard(0, loop, exit=exits.append)
        guard.arm(0.2, "its prompts were all answered")
        guard.disarm()
        time.sleep(0.4)
        guard.arm(0.1, "again")  # disarmed for good
        time.sleep(0.3)
    finally:
        loop.close()
    assert exits == [] and not guard.fired


@pytest.mark.slow
def test_a_worker_whose_task_swallows_its_cancel_ends_with_exit_6_and_says_what_did_not_finish(
    tmp_path, kimi
):
    """End to end: a background task of the worker that ignores its cancel (what Python 3.11's wait_for did) keeps
    the shard's final gather from returning; the exit guard ends the process within its bound, the record is
    flushed, and the log names the task."""
    proc, url = start_standalone(str(kimi), "--context-length", "32768")
    try:
        job = make_job(
            tmp_path,
            kimi,
            n=1,
            engine={"kind": "external", "url": url, "shutdown_timeout_s": 0, "exit_grace_s": 2},
            sampling={"max_new_tokens": 16},
        )
        rd, _ = prepared_run(job)
        deaf = textwrap.dedent("""
            import asyncio, sys
            from toolkit.worker import run as worker, session
            async def deaf_watch_load(batch, http):
                while True:
                    try:
                        await asyncio.sleep(0.05)
                    except asyncio.CancelledError:
                        pass
            session.watch_load = deaf_watch_load
            worker.run_shard(sys.argv[1], 0)
        """)
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-c", deaf, str(rd.root)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        took = time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert r.returncode == EXIT_STUCK, r.stderr[-2000:]
    assert took < 60
    log = RunDir(rd.root).log_file(0).read_text()
    assert "the worker has not ended" in log and "after its prompts were all answered" in log
    assert "deaf_watch_load" in log, log[-2000:]
    from toolkit.formats.frames import read_shard

    recs = list(read_shard(rd.shard_file(0)))
    assert [x.status for x in recs] == ["ok"], "the record answered before the hang was flushed"
    assert (
        read_done(rd.done_file(0)) is None
    )  # not complete: the next run finds the record and finishes at once
    assert run_shard_again(rd).end == "done"


def run_shard_again(rd) -> str:
    from toolkit.worker.run import run_shard

    return run_shard(rd.root, 0)
