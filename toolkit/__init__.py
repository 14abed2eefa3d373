"""toolkit: turn a reasoning model served by SGLang into a training dataset, through raw token ids,
on Slurm.

Reader API: `read_run(run_dir)` iterates a run's `Record`s, the newest of each id (see
toolkit.formats.records); `read_rows(run_dir)` the same with their text, as rows of the jsonl
export; `to_dataset(run_dir)` gives a Hugging Face `datasets.Dataset` of those rows, and
`to_dataset(run_dir, view="tokens")` of the tokens export's training rows; `read_shard(path)`
iterates every record of one file as written. `dir(toolkit)` lists these (`__all__`): the module's
other names are private.
"""

import logging as _logging
from collections.abc import Iterator as _Iterator
from pathlib import Path as _Path
from typing import Any as _Any

from toolkit.formats.frames import read_shard
from toolkit.formats.records import Record, unpack_ids

__all__ = ["Record", "read_rows", "read_run", "read_shard", "to_dataset", "unpack_ids"]


def __dir__() -> list[str]:
    """The API (`__all__`), not the submodules and imports a module's namespace also holds."""
    return sorted(__all__)


class _NoTorchAdvice(_logging.Filter):
    """Drops transformers' import-time "PyTorch was not found" advisory: the toolkit only ever loads
    tokenizers, which need no torch (the login node never has it). Every other transformers message
    passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def _quiet_transformers() -> None:
    logger = _logging.getLogger("transformers")  # the logger transformers/__init__ warns through
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())


_quiet_transformers()


def read_run(run_dir: str | _Path) -> _Iterator[Record]:
    """The newest record of each planned id of a run, in planned order: from the merged dataset when
    it is the run as it is, else from the shard files, a record written again or a partial output
    continued counting once (its newest attempt). See toolkit.dataset.reader."""
    from toolkit.dataset.reader import read_run as newest

    return newest(run_dir)


def read_rows(run_dir: str | _Path, *, ok_only: bool = False) -> _Iterator[_Any]:
    """`read_run`'s records as rows of the jsonl export (`JsonlRecord`): sample, turn, the reasoning
    and the answer (`content`) as text, and the prompt line's other fields (`meta`)."""
    from toolkit.dataset.reader import read_rows as rows

    return rows(run_dir, ok_only=ok_only)


def to_dataset(
    run_dir: str | _Path,
    *,
    ok_only: bool = True,
    cache_dir: str | _Path | None = None,
    view: str = "records",
    trainer: str | None = None,
) -> _Any:
    """A run as a Hugging Face `datasets.Dataset` (needs `pip install datasets`).
    `view="records"` (default): `read_rows`, every ok record (truncated ones too; `finish_reason`
    says which) unless `ok_only=False` (every record). `view="tokens"`: the training rows of a
    merged run, the tokens export's own (id, dataset, sample, turn, segments, `input_ids` as uint32,
    `loss_mask` for `trainer`: specforge, the default, or speculators), the records that are not
    training data left out as the export leaves them out. `cache_dir`: where `datasets` keeps its
    Arrow files."""
    from toolkit.dataset.reader import to_dataset as dataset

    return dataset(run_dir, ok_only=ok_only, cache_dir=cache_dir, view=view, trainer=trainer)
