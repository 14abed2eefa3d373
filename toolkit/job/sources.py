"""Where a dataset's prompts are read from, each kind with its own library, streamed.

A dataset's `path` is one of:
- a JSONL file, plain (`.jsonl`, any other name), gzip-compressed (`.gz`) or zstd-compressed
  (`.zst`, `.zstd`): a prompt per line; a UTF-8 byte order mark at its start is ignored;
- a parquet file (`.parquet`; pyarrow): a prompt per row, its columns the fields of a line;
- a folder a `datasets.Dataset` was saved to (`save_to_disk`; the `datasets` package): a prompt
  per row. A `DatasetDict`'s folder holds one folder per split: name that one;
- `hf://datasets/ORG/NAME` or `hf://datasets/ORG/NAME:SPLIT` (split `train` unless given): a
  dataset in the local Hugging Face hub cache, read offline (never downloaded here).

Every kind is given to `inputs` as JSON lines (a row is encoded as the JSON object of its columns,
the nulls parquet and arrow give absent struct fields left out), so a prompt has the same id from
its content whatever holds it. Each prompt has a place: for JSONL its line number and the byte
offset and length of the line in the (decompressed) text; for rows its row number (the first row is
1) and its row index as the offset, length 1. `Source.read` gives a prompt back from its place: a
seek for a plain file, reading forward through a compressed one (reopened to go back), a row of a
row group for parquet, a row of the memory-mapped table for `datasets` (the readers of each kind
are in job/readers; this module tells a path's kind and opens it).

A file that is none of these is refused for what it is (gzip data named `.jsonl`, a parquet file
named `.jsonl`, a zip archive, UTF-16 or binary data, a JSON array or pretty-printed JSON), once,
before any line is read.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from toolkit.formats.files import sha256_file
from toolkit.job.readers import (
    ParquetSource,
    Source,
    SourceError,
    TextSource,
    hub_id,
    is_hub,
    load_from_disk,
    load_hub,
    snapshot,
)

__all__ = [
    "open_source",
    "source_exists",
    "source_sha256",
]

BOM = b"\xef\xbb\xbf"

# what a file's first bytes say it is
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PAR1", "parquet"),
    (b"ARROW1", "arrow"),
    (b"PK\x03\x04", "zip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bz2"),
    (b"\xff\xfe", "utf16"),
    (b"\xfe\xff", "utf16"),
)
_NAMED = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".parquet": "parquet"}
_WHAT = {
    "gzip": "gzip-compressed",
    "zstd": "zstd-compressed",
    "parquet": "a parquet file",
    "arrow": "an Arrow file (a `datasets` folder's data: name the folder)",
    "zip": "a zip archive (unzip it and name the file inside)",
    "xz": "xz-compressed (decompress it, or compress it with gzip or zstd: .jsonl.gz, .jsonl.zst)",
    "bz2": "bzip2-compressed (decompress it, or compress it with gzip or zstd: .jsonl.gz, "
    ".jsonl.zst)",
    "utf16": "UTF-16 text, not UTF-8 (re-encode it as UTF-8)",
}
_SUFFIX = {"gzip": ".jsonl.gz", "zstd": ".jsonl.zst", "parquet": ".parquet"}


def _kind(path: str) -> str:
    """The kind of a local path: "folder", or a file's kind, checked against its first bytes."""
    p = Path(path)
    if p.is_dir():
        return "folder"
    name = p.name.lower()
    named = next((k for s, k in _NAMED.items() if name.endswith(s)), "jsonl")
    with open(p, "rb") as f:
        head = f.read(4096)
    found = next((k for magic, k in _MAGIC if head.startswith(magic)), None)
    if found == named:
        return named
    if found is None and named != "jsonl":
        raise SourceError(
            path,
            f"named {Path(name).suffix} but not {_WHAT[named].split(' (')[0]}: "
            "name it for what it holds (.jsonl for JSON lines)",
        )
    if found in _SUFFIX:
        named_as = Path(name).suffix or "without a suffix"
        raise SourceError(
            path,
            f"{_WHAT[found]} but named {named_as}: name it with "
            f"{_SUFFIX[found]} to read it as such",
        )
    if found is not None:
        raise SourceError(path, f"{_WHAT[found]}, not JSON lines")
    if b"\x00" in head:
        raise SourceError(
            path,
            "not UTF-8 text (binary data): a prompt file is JSON lines "
            "(.jsonl, .jsonl.gz, .jsonl.zst), parquet, or a datasets folder",
        )
    lines = head.removeprefix(BOM).lstrip().split(b"\n", 2)
    first = lines[0].strip()
    if first.startswith(b"["):
        raise SourceError(
            path,
            "a JSON array, not JSON lines (one object per line): convert it, "
            f"e.g. jq -c '.[]' {p.name} > {p.stem}.jsonl",
        )
    if first == b"{" and len(lines) > 1 and re.match(rb'\s+"', lines[1]):  # {, then  "key": ...
        raise SourceError(
            path,
            "pretty-printed JSON, not JSON lines (one object per line): "
            f"write each object on one line, e.g. jq -c . {p.name}",
        )
    return "jsonl"


def source_exists(path: str) -> bool:
    """Whether a dataset's path is there to read (a hub dataset: judged when it is read)."""
    return is_hub(path) or Path(path).exists()


def source_sha256(path: str) -> str:
    """What a source holds, hashed: a file's bytes; a folder's files (names and bytes); a hub
    dataset's cached snapshot and split. FileNotFoundError when it is gone."""
    if is_hub(path):
        name, split = hub_id(path)
        return _folder_sha256(Path(snapshot(path, name)), extra=split)
    p = Path(path)
    if p.is_dir():
        return _folder_sha256(p)
    return sha256_file(p)


def _folder_sha256(folder: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for f in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


def open_source(path: str) -> Source:
    """The reader of a dataset's path. FileNotFoundError when it is not there; SourceError when it
    is not a kind of prompt source (or its library is missing)."""
    if is_hub(path):
        return load_hub(path)
    kind = _kind(path)
    if kind == "folder":
        return load_from_disk(path)
    if kind == "parquet":
        return ParquetSource(path)
    return TextSource(path, kind)
