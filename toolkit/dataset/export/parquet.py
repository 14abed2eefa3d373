"""The `parquet` export: the jsonl export's columns with their types (`rows_schema`), in row
groups of PARQUET_ROWS records; the file's metadata names the engine that made the records. The
Arrow schema of the tokens view (`tokens_schema`, for `to_dataset`) is here too: both start with the
same key columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from toolkit.dataset.export.selection import ExportError, _Account, _Defects, _kept
from toolkit.dataset.export.text import _Meta, _Text, _Tokens, stop_columns
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import Record
from toolkit.formats.runplan import RunPlan

PARQUET_ROWS = 1024  # records per Parquet row group


def _key_columns(pa: Any) -> list[tuple[str, Any]]:
    """The columns that name a row, first in every view: its id, dataset, sample, turn and
    segments."""
    return [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("sample", pa.int32()),
        ("turn", pa.int32()),
        ("segments", pa.int32()),
    ]


def rows_schema(pa: Any) -> Any:
    """The Arrow schema of the jsonl export's rows, as the parquet export and `to_dataset` store
    them: token ids as uint32 lists, counts as int32/int64, `meta` as JSON text. `pa`: pyarrow."""
    ids_type = pa.list_(pa.uint32())
    return pa.schema(
        [
            *_key_columns(pa),
            ("status", pa.string()),
            ("error", pa.string()),
            ("prompt_ids", ids_type),
            ("output_ids", ids_type),
            ("reasoning_end", pa.int32()),
            ("reasoning", pa.string()),
            ("content", pa.string()),
            ("finish_reason", pa.string()),
            ("matched_stop", pa.int64()),
            ("matched_stop_str", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("meta", pa.string()),  # the jsonl export's object, as JSON
        ]
    )


def tokens_schema(pa: Any) -> Any:
    """The Arrow schema of the tokens export's rows as `to_dataset(view="tokens")` stores them:
    `input_ids` as uint32 lists, `loss_mask` as uint8 lists (0 or 1). `pa`: pyarrow."""
    return pa.schema(
        [
            *_key_columns(pa),
            ("input_ids", pa.list_(pa.uint32())),
            ("loss_mask", pa.list_(pa.uint8())),
        ]
    )


def _export_parquet(
    path: Path, plan: RunPlan, out_path: Path, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError(
            "the parquet export needs pyarrow: `pip install pyarrow` (or the toolkit's [parquet] "
            "extra)"
        ) from None
    # what made the records, as the run pinned it: "stub" is synthetic text, not a model's
    engine = plan.engine_class.encode()
    schema = rows_schema(pa).with_metadata({b"toolkit.engine": engine})

    def id_lists(packed: list[bytes]) -> pa.Array:
        lengths = np.fromiter((len(p) >> 2 for p in packed), np.int32, len(packed))
        offsets = np.zeros(len(packed) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.frombuffer(b"".join(packed), "<u4")
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.uint32()))

    text, n, meta = _Text(plan, tokens), 0, _Meta(plan)
    as_json = msgspec.json.Encoder().encode
    pending: list[Record] = []
    pending_refs: list[PromptRef] = []
    pending_text: list[tuple[str, str]] = []

    def flush(writer) -> None:
        if not pending:
            return
        cols = [
            pa.array([r.id for r in pending], pa.string()),
            pa.array([r.dataset for r in pending], pa.string()),
            pa.array([ref.sample for ref in pending_refs], pa.int32()),
            pa.array([ref.turn for ref in pending_refs], pa.int32()),
            pa.array([r.segments for r in pending], pa.int32()),
            pa.array([r.status for r in pending], pa.string()),
            pa.array([r.error for r in pending], pa.string()),
            id_lists([r.prompt_ids for r in pending]),
            id_lists([r.output_ids for r in pending]),
            pa.array([r.reasoning_end for r in pending], pa.int32()),
            pa.array([t[0] for t in pending_text], pa.string()),
            pa.array([t[1] for t in pending_text], pa.string()),
            pa.array([r.finish for r in pending], pa.string()),
            pa.array([stop_columns(r.matched_stop)[0] for r in pending], pa.int64()),
            pa.array([stop_columns(r.matched_stop)[1] for r in pending], pa.string()),
            pa.array([r.prompt_tokens for r in pending], pa.int64()),
            pa.array([r.completion_tokens for r in pending], pa.int64()),
            pa.array(
                [
                    None if (m := meta.of(ref)) is None else as_json(m).decode()
                    for ref in pending_refs
                ],
                pa.string(),
            ),
        ]
        writer.write_table(pa.Table.from_arrays(cols, schema=schema))
        pending.clear()
        pending_refs.clear()
        pending_text.clear()

    with pq.ParquetWriter(str(out_path), schema, compression="zstd") as writer:
        for recs, refs in _kept(path, acc, defects):
            pending.extend(recs)
            pending_refs.extend(refs)
            pending_text.extend(text.parts(recs))
            n += len(recs)
            if len(pending) >= PARQUET_ROWS:
                flush(writer)
        flush(writer)
    return n
