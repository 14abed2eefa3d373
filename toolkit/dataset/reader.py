"""A run's records for Python code (`toolkit.read_run`, `read_rows`, `to_dataset`): the newest
record of each planned id, in planned order, whether the run is merged or not; and the training
rows of a merged run (`to_dataset(view="tokens")`), which are the tokens export's own.

When the merged dataset is the run as it is (`export.stale_merge` finds nothing newer), it is read;
else every shard file is read through the merge's own newest-wins scan (`formats.newest`): a record
written again (a retry, a task that ran twice) supersedes the earlier ones, and a partial output
kept at a stop is superseded by the record that continued it. A record whose newest attempt is a
partial output never continued comes as it is, with status "partial". Nothing in the run directory
is written.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from toolkit.dataset.export import JsonlRecord, export_run, rows_schema, stale_merge
from toolkit.dataset.export.jsonl import _jsonl_rows
from toolkit.dataset.export.parquet import tokens_schema
from toolkit.dataset.export.text import _Meta, _Text, _Tokens
from toolkit.dataset.merge_manifest import MERGED, MergeError, load_manifest
from toolkit.dataset.trainers import TRAINERS
from toolkit.errors import ToolkitError
from toolkit.formats.frames import CorruptShard, read_header, read_shard
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.prompts import PromptIndex
from toolkit.formats.records import OK, Record
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.job.schema import JobSpec

__all__ = ["read_rows", "read_run", "to_dataset"]

log = logging.getLogger(__name__)

ROWS_BATCH = 256  # records decoded to text in one tokenizer call
# what `to_dataset` gives: the jsonl export's rows of the records, or the tokens export's rows
VIEWS = ("records", "tokens")


def _merge_is_current(rd: RunDir, plan: RunPlan) -> bool:
    """Whether merged/records.zst holds the run as it is: intact header, the size its manifest says,
    nothing written to a shard since."""
    path = rd.merged_file
    if not path.exists():
        return False
    try:
        manifest = load_manifest(rd)
        if path.stat().st_size != manifest.bytes or read_header(path) != (plan.fingerprint, MERGED):
            return False
    except (MergeError, CorruptShard):
        return False
    return stale_merge(rd, plan, manifest) is None


def _newest(rd: RunDir, plan: RunPlan, refs: PromptIndex) -> Iterator[Record]:
    if _merge_is_current(rd, plan):
        yield from read_shard(rd.merged_file)
        return
    for s in plan.shards:
        path = rd.shard_file(s.index)
        if not path.exists():
            continue
        try:
            head = read_header(path)
        except CorruptShard as e:
            log.warning(
                "%s: damaged header (%s at byte %d); its records are left out",
                path,
                e.why,
                e.offset,
            )
            continue
        if head is not None and head != (plan.fingerprint, s.index):
            log.warning(
                "%s is a file of run %s shard %s, not of this run's shard %d; left out",
                path,
                *head,
                s.index,
            )
            continue
        sc = scan_shard(path, s.first, refs.shard(s.index))
        yield from (rec for rec in newest_records(path, sc) if rec is not None)


def read_run(run_dir: str | os.PathLike) -> Iterator[Record]:
    """The newest record of each planned id of a run, in planned order (see the module's
    docstring)."""
    run = Run.open(run_dir, JobSpec)  # read-only: reading a run writes nothing into it
    yield from _newest(run.rd, run.plan, run.prompts())


def read_rows(run_dir: str | os.PathLike, *, ok_only: bool = False) -> Iterator[JsonlRecord]:
    """`read_run`'s records as rows of the `jsonl` export: sample, turn, the reasoning and the
    answer (`content`) decoded with the run's tokenizer, and the prompt line's other fields
    (`meta`). `ok_only`: ok records only."""
    run = Run.open(run_dir, JobSpec)
    rd, plan, refs = run.rd, run.plan, run.prompts()
    tokens = _Tokens(plan)
    text, meta = _Text(plan, tokens), _Meta(plan)
    batch: list[Record] = []

    def rows() -> Iterator[JsonlRecord]:
        planned = [refs.at(r.index) for r in batch]
        yield from _jsonl_rows(batch, planned, text.parts(batch), meta)
        batch.clear()

    for rec in _newest(rd, plan, refs):
        if ok_only and rec.status != OK:
            continue
        batch.append(rec)
        if len(batch) >= ROWS_BATCH:
            yield from rows()
    yield from rows()


def _row_dicts(run_dir: str, ok_only: bool, state: tuple) -> Iterator[dict[str, Any]]:
    encode = msgspec.json.Encoder().encode
    for row in read_rows(run_dir, ok_only=ok_only):
        d = msgspec.structs.asdict(row)
        # as the parquet export has it
        d["meta"] = None if row.meta is None else encode(row.meta).decode()
        yield d


def _state(run_dir: str | os.PathLike) -> tuple:
    """What the rows are read from, by size and time: `datasets` caches a dataset made from a
    generator under a hash of its arguments, so a run that changed must give other arguments."""
    run = Run.open(run_dir, JobSpec)
    rd, plan = run.rd, run.plan
    files = [rd.merged_file, rd.manifest_file, *(rd.shard_file(s.index) for s in plan.shards)]
    files += [d.path for d in plan.datasets]
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return (plan.fingerprint, tuple(out))


def _token_dicts(run_dir: str, trainer: str, state: tuple, tmp: str | None) -> Iterator[dict]:
    """The rows of the tokens export of a run, as it writes them: the export itself (its selection
    of the records that are training data, its rows and checks) into a temporary folder inside
    `tmp` (None: the system's), read back line by line; the folder removed after."""
    decode = msgspec.json.Decoder().decode
    if tmp is not None:
        os.makedirs(tmp, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="toolkit-tokens-", dir=tmp) as folder:
        s = export_run(run_dir, "tokens", Path(folder) / "tokens.jsonl", trainer=trainer)
        for w in s.warnings:
            log.warning("%s", w)
        log.info("tokens view of %s: %s", run_dir, s.line())
        with open(s.output, "rb") as f:
            yield from (decode(line) for line in f)


def to_dataset(
    run_dir: str | os.PathLike,
    *,
    ok_only: bool = True,
    cache_dir: str | os.PathLike | None = None,
    view: str = "records",
    trainer: str | None = None,
):
    """A run as a Hugging Face `datasets.Dataset` (the optional `datasets` package: `pip install
    datasets`). `view="records"` (default): `read_rows`, every ok record (a truncated or looping
    output too: `finish_reason` says which), or every record unless `ok_only`, with the parquet
    export's column types (`rows_schema`: token ids as uint32, `meta` as JSON text).
    `view="tokens"`: the training rows, the `tokens` export's own (`export_run`: the same records
    left out, the same `input_ids` and `loss_mask` for `trainer`, default specforge), columns
    `tokens_schema`; a merged run only, as the export. `cache_dir`: where `datasets` keeps its Arrow
    files (default: its own cache, `HF_DATASETS_CACHE` or ~/.cache/huggingface), and the tokens
    view its temporary export."""
    if view not in VIEWS:
        raise ValueError(f"view={view!r}: choose one of {', '.join(map(repr, VIEWS))}")
    if view == "records" and trainer is not None:
        raise ValueError("trainer= is the tokens view's (its loss mask): give view='tokens'")
    if view == "tokens" and not ok_only:
        raise ValueError(
            "the tokens view holds training rows, ok records only: drop ok_only=False "
            "(view='records' gives every record)"
        )
    if trainer is not None and trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r}: choose one of {', '.join(map(repr, TRAINERS))}")
    try:
        import datasets
        import pyarrow as pa
        from datasets.exceptions import DatasetGenerationError
    except ImportError:
        raise ImportError(
            "to_dataset needs the `datasets` package: pip install datasets "
            "(or read the records with toolkit.read_rows)"
        ) from None
    cache = None if cache_dir is None else str(cache_dir)
    if view == "tokens":
        rows, schema = _token_dicts, tokens_schema(pa)
        kwargs = {
            "run_dir": str(run_dir),
            "trainer": trainer or "specforge",
            "state": _state(run_dir),
            "tmp": cache,
        }
    else:
        rows, schema = _row_dicts, rows_schema(pa)
        kwargs = {"run_dir": str(run_dir), "ok_only": ok_only, "state": _state(run_dir)}
    try:
        return datasets.Dataset.from_generator(
            rows,
            gen_kwargs=kwargs,
            features=datasets.Features.from_arrow_schema(schema),
            cache_dir=cache,
        )
    except DatasetGenerationError as e:
        if isinstance(e.__cause__, ToolkitError):  # the export's own refusal, as it says it
            raise e.__cause__ from None
        raise
