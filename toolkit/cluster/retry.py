"""`toolkit retry RUN`: generate failed records again, in the same run directory.

Without `--ids`, the shards whose done manifest counts transient failures (timeouts, 5xx past the
retries, aborts, SGLang's NaN stop: records.TRANSIENT), and the unfinished ones (a shard file
changed since its done manifest was written among them: its intact records are kept), are run again:
the worker regenerates a shard's transient failures on every run; the failures that may pass given
up after [client] max_tries tries (records.is_given_up) get a retry request, as with `--ids`, which
starts their count afresh. With `--ids FILE` (one id per line, e.g. `merged/failed_ids.txt`), those
ids are generated again whatever their status: each of their shards gets a retry request
(`shards/NNNNN.retry`, which the worker reads and removes once the shard completes) and loses its
done manifest. The new records are appended; merge keeps the newest record of each id. The shards
run here, one after the other, then the run is merged and audited (like `toolkit run`); `--slurm`
submits them instead (like `toolkit resubmit`).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path

from toolkit.errors import BadInputError
from toolkit.formats.manifests import write_retry
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.prompts import PromptIndex
from toolkit.formats.records import is_given_up
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import REPAIRED, asked_again
from toolkit.job.schema import JobSpec

__all__ = ["read_ids", "request_retry"]


def read_ids(path: str | os.PathLike) -> list[str]:
    """Ids of a file, one per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise BadInputError(f"{path}: cannot read the ids to retry ({e.strerror})") from None
    return [s for line in lines if (s := line.strip()) and not s.startswith("#")]


def _shard_of_ids(rd: RunDir, plan: RunPlan, ids: list[str]) -> dict[int, list[str]]:
    wanted = set(ids)
    firsts = [s.first for s in plan.shards]
    by_shard: dict[int, list[str]] = {}
    for pos, ref in enumerate(PromptIndex(rd, plan).refs()):
        if ref.id in wanted:
            wanted.discard(ref.id)
            by_shard.setdefault(bisect_right(firsts, pos) - 1, []).append(ref.id)
    if wanted:
        raise BadInputError(
            f"{len(wanted)} ids are not planned in {rd.shown} (e.g. {sorted(wanted)[0]!r})"
        )
    return by_shard


def given_up_ids(rd: RunDir, plan: RunPlan, k: int) -> list[str]:
    """Ids of shard `k` whose newest record (formats.newest) is a failure that may pass, given up
    for the run after [client] max_tries tries (records.is_given_up)."""
    sp, path = plan.shards[k], rd.shard_file(k)
    sc = scan_shard(path if path.exists() else None, sp.first, sp.count)
    return [r.id for r in newest_records(path, sc) if r is not None and is_given_up(r)]


def request_retry(
    run_dir: str | os.PathLike, ids: list[str] | None = None
) -> tuple[RunDir, list[int]]:
    """Ask for records to be generated again, each with a fresh count of tries; return the shards to
    run. `ids` None: every failure that may pass (those given up after [client] max_tries tries
    included)."""
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    if ids is None:
        ids = []
        for s in plan.shards:
            m = run.shard_state(s.index).done
            if m is not None and m.given_up:
                ids += given_up_ids(rd, plan, s.index)
        if not ids:
            return rd, _unfinished(rd, plan)
    for k, shard_ids in sorted(_shard_of_ids(rd, plan, ids).items()):
        write_retry(rd.retry_file(k), asked_again(rd, k, shard_ids))
        rd.done_file(k).unlink(missing_ok=True)
    return rd, _unfinished(rd, plan)


def _unfinished(rd: RunDir, plan: RunPlan) -> list[int]:
    """Shards to run: not finished (formats.shardstate), a done manifest of another run or whose
    file changed since it was written taken as not finished (and removed)."""
    run = Run(rd, plan)
    return [s.index for s in plan.shards if not run.shard_state(s.index, REPAIRED).finished]
