"""toolkit: turn a reasoning model served by SGLang into a training dataset, through raw token ids, on Slurm.

Reader API: `read_run(run_dir)` and `read_shard(path)` iterate `Record`s (see toolkit.formats.records).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from toolkit.formats.frames import read_shard
from toolkit.formats.records import Record, unpack_ids

__all__ = ["Record", "read_run", "read_shard", "unpack_ids"]


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' import-time "PyTorch was not found" advisory: the toolkit only ever loads tokenizers,
    which need no torch (the login node never has it). Every other transformers message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def _quiet_transformers() -> None:
    logger = logging.getLogger("transformers")  # the logger transformers/__init__ warns through
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())


_quiet_transformers()


def read_run(run_dir: str | Path) -> Iterator[Record]:
    """Every record of a run: the merged dataset if it exists, else each shard file in shard order.

    Shard files may hold a record twice (a task that ran twice); the merged dataset never does.
    """
    from toolkit.job.plan import load_run

    rd, plan = load_run(run_dir)
    merged = rd.merged_file
    if merged.exists():
        yield from read_shard(merged)
        return
    for s in plan.shards:
        path = rd.shard_file(s.index)
        if path.exists():
            yield from read_shard(path)
