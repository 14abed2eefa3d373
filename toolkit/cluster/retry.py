"""`toolkit retry RUN`: generate failed records again, in the same run directory.

Without `--ids`, the shards whose done manifest counts transient failures (timeouts, 5xx past the retries,
aborts, SGLang's NaN stop: records.TRANSIENT), and the unfinished ones (a shard file changed since its done
manifest was written among them: its intact records are kept), are run again: the worker regenerates a
shard's transient failures on every run. With `--ids FILE` (one id per line, e.g. `merged/failed_ids.txt`), those
ids are generated again whatever their status: each of their shards gets a retry request (`shards/NNNNN.retry`,
which the worker reads and removes once the shard completes) and loses its done manifest. The new records are
appended; merge keeps the newest record of each id. The shards run here, one after the other, then the run is
merged and audited (like `toolkit run`); `--slurm` submits them instead (like `toolkit resubmit`).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path

from toolkit.errors import BadInputError
from toolkit.formats.manifests import RetryRequest, needs_work, read_done, read_retry, trusted_done, write_retry
from toolkit.formats.rundir import RunDir
from toolkit.job.plan import RunPlan, load_refs, load_run

__all__ = ["RetryError", "read_ids", "request_retry"]


class RetryError(BadInputError):
    """A retry that cannot be asked as given (unknown ids, unreadable file)."""


def read_ids(path: str | os.PathLike) -> list[str]:
    """Ids of a file, one per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise RetryError(f"{path}: cannot read the ids to retry ({e.strerror})") from None
    return [s for line in lines if (s := line.strip()) and not s.startswith("#")]


def _shard_of_ids(rd: RunDir, plan: RunPlan, ids: list[str]) -> dict[int, list[str]]:
    wanted = set(ids)
    firsts = [s.first for s in plan.shards]
    by_shard: dict[int, list[str]] = {}
    for pos, ref in enumerate(load_refs(rd)):
        if ref.id in wanted:
            wanted.discard(ref.id)
            by_shard.setdefault(bisect_right(firsts, pos) - 1, []).append(ref.id)
    if wanted:
        raise RetryError(f"{len(wanted)} ids are not planned in {rd.shown} (e.g. {sorted(wanted)[0]!r})")
    return by_shard


def request_retry(run_dir: str | os.PathLike, ids: list[str] | None = None) -> tuple[RunDir, list[int]]:
    """Ask for records to be generated again; return the shards to run. `ids` None: every transient failure."""
    rd, plan = load_run(run_dir)
    if ids is None:  # (a shard file changed since its done manifest was written is not finished: trusted_done)
        return rd, [s.index for s in plan.shards
                    if needs_work(trusted_done(rd.done_file(s.index), rd.shard_file(s.index), plan.fingerprint))]
    for k, shard_ids in sorted(_shard_of_ids(rd, plan, ids).items()):
        path = rd.shard_file(k)
        old = read_retry(rd.retry_file(k))
        keep = [i for i in old.ids if i not in set(shard_ids)] if old else []
        write_retry(rd.retry_file(k), RetryRequest(before=path.stat().st_size if path.exists() else 0, ids=keep + shard_ids))
        rd.done_file(k).unlink(missing_ok=True)
    return rd, [s.index for s in plan.shards if needs_work(read_done(rd.done_file(s.index)))]
