"""How each kind of prompt source is read (job/sources says which kind a path is): `Source`, a
dataset's prompts as JSON lines and each one again from its place; JSON lines plain or compressed
(`TextSource`), a parquet file (`ParquetSource`, pyarrow), a `datasets` folder or a hub dataset in
the local cache (the `datasets` package), their rows encoded as the JSON objects of their columns.
A library a kind needs is imported when a source of that kind is opened."""

from __future__ import annotations

import gzip
import importlib
import io
import re
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zstandard

from toolkit.errors import BadInputError

HUB_PREFIX = "hf://datasets/"
_HUB_ID = re.compile(r"([\w.-]+/[\w.-]+)(?::([\w.-]+))?")
ROWS_PER_CHUNK = 2048  # rows of a table a render slice holds
_READ = 1 << 20
_KEPT = 1024  # lines of a compressed file kept after a read (turns re-read their conversation)
_KEPT_BYTES = 1 << 16  # ... each at most this long


# how a compressed stream that cannot be read all through fails
_BROKEN = (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError)


class SourceError(BadInputError):
    """A dataset's path that cannot be read as prompts: the message names it and what it is."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")


def is_hub(path: str) -> bool:
    return path.startswith(HUB_PREFIX)


def hub_id(path: str) -> tuple[str, str]:
    m = _HUB_ID.fullmatch(path[len(HUB_PREFIX) :])
    if m is None:
        raise SourceError(
            path,
            "a hub dataset is named hf://datasets/ORG/NAME, or "
            "hf://datasets/ORG/NAME:SPLIT for a split other than train",
        )
    return m.group(1), m.group(2) or "train"


def need(module: str, package: str, what: str, path: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SourceError(
            path,
            f"reading {what} needs the {package} package, not installed in this Python: "
            f"pip install {package}",
        ) from None


class Source:
    """One dataset's prompts as JSON lines, and each one again from its place."""

    rows = False  # places are row indexes (offset = row, length 1), not bytes
    kind = "JSONL"

    def __init__(self, path: str):
        self.path = path

    def lines(self) -> Iterator[bytes]:
        """Every line (or row, as a JSON line), in order, each ending in a newline."""
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[tuple[int, int, int, bytes | None]]:
        """(offset, size, first line, the lines or None) of consecutive slices of whole lines
        (about `size` bytes; a compressed file's lines are given, as they cannot be read from the
        middle) or of ROWS_PER_CHUNK rows; None: `span` reads them where they are."""
        raise NotImplementedError

    def span(self, offset: int, size: int) -> bytes:
        """The lines of a chunk, read where they are."""
        raise NotImplementedError

    def read(self, offset: int, length: int) -> bytes:
        """The line (or row) at a place."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class TextSource(Source):
    """JSON lines, plain or compressed."""

    def __init__(self, path: str, kind: str):
        super().__init__(path)
        self.codec = kind
        self.kind = {
            "jsonl": "JSONL",
            "gzip": "gzip-compressed JSONL",
            "zstd": "zstd-compressed JSONL",
        }[kind]
        self._f: Any = None
        self._pos = 0
        self._kept: OrderedDict[tuple[int, int], bytes] = OrderedDict()

    def _open(self) -> Any:
        if self.codec == "gzip":
            return gzip.open(self.path, "rb")
        if self.codec == "zstd":
            raw = open(self.path, "rb")
            return io.BufferedReader(
                zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), _READ
            )
        return open(self.path, "rb")

    def _damaged(self, e: Exception) -> SourceError:
        return SourceError(
            self.path,
            f"the {self.kind} is damaged ({type(e).__name__}: {e}); "
            "compress it again from the original file",
        )

    def lines(self) -> Iterator[bytes]:
        with self._open() as f:
            try:
                yield from f
            except _BROKEN as e:
                raise self._damaged(e) from None

    def chunks(self, size: int) -> Iterator[tuple[int, int, int, bytes | None]]:
        keep = self.codec != "jsonl"
        with self._open() as f:
            offset, line, carry = 0, 1, b""
            while True:
                block = f.read(size)
                if not block:
                    if carry:
                        yield offset, len(carry), line, carry if keep else None
                    return
                buf = carry + block
                cut = buf.rfind(b"\n") + 1
                if cut == 0:  # one line longer than a slice: read on
                    carry = buf
                    continue
                yield offset, cut, line, buf[:cut] if keep else None
                line += buf.count(b"\n", 0, cut)
                offset += cut
                carry = buf[cut:]

    def span(self, offset: int, size: int) -> bytes:
        return self.read(offset, size)

    def read(self, offset: int, length: int) -> bytes:
        if self.codec == "jsonl":
            if self._f is None:
                self._f = open(self.path, "rb")
            self._f.seek(offset)
            return self._f.read(length)
        kept = self._kept.get((offset, length))
        if kept is not None:
            return kept
        if self._f is None or offset < self._pos:
            self.close()
            self._f, self._pos = self._open(), 0
        try:
            while self._pos < offset:
                skipped = len(self._f.read(min(_READ, offset - self._pos)))
                if not skipped:
                    break
                self._pos += skipped
            data = self._f.read(length)
        except _BROKEN as e:
            raise self._damaged(e) from None
        self._pos += len(data)
        if length <= _KEPT_BYTES:
            self._kept[(offset, length)] = data
            if len(self._kept) > _KEPT:
                self._kept.popitem(last=False)
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _row_line(row: dict[str, Any]) -> bytes:
    return msgspec.json.encode(_no_nulls(row)) + b"\n"


def _no_nulls(value: Any) -> Any:
    """A row without the nulls a table gives fields a row does not have (a struct's other fields,
    a column another row fills)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _row_chunks(rows: int) -> Iterator[tuple[int, int, int, bytes | None]]:
    for start in range(0, rows, ROWS_PER_CHUNK):
        yield start, min(ROWS_PER_CHUNK, rows - start), start + 1, None


class ParquetSource(Source):
    rows = True
    kind = "parquet file"

    def __init__(self, path: str):
        super().__init__(path)
        pq = need("pyarrow.parquet", "pyarrow", "a parquet file", path)
        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid and friends
            raise SourceError(path, f"not a readable parquet file ({e})") from None
        meta = self.file.metadata
        self.starts = [0]
        for i in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(i).num_rows)
        self._group: tuple[int, list[dict[str, Any]]] | None = None

    def lines(self) -> Iterator[bytes]:
        for batch in self.file.iter_batches(batch_size=ROWS_PER_CHUNK):
            for row in batch.to_pylist():
                yield _row_line(row)

    def chunks(self, size: int) -> Iterator[tuple[int, int, int, bytes | None]]:
        return _row_chunks(self.starts[-1])

    def span(self, offset: int, size: int) -> bytes:
        return b"".join(self.read(k, 1) + b"\n" for k in range(offset, offset + size))

    def read(self, offset: int, length: int) -> bytes:
        g = next(i for i in range(len(self.starts) - 1) if offset < self.starts[i + 1])
        if self._group is None or self._group[0] != g:
            self._group = (g, self.file.read_row_group(g).to_pylist())
        return _row_line(self._group[1][offset - self.starts[g]]).rstrip(b"\n")


class _Rows(Source):
    """A `datasets.Dataset`: its rows, memory-mapped."""

    rows = True

    def __init__(self, path: str, ds: Any, kind: str):
        super().__init__(path)
        self.ds, self.kind = ds, kind

    def _batches(self) -> Iterator[list[dict[str, Any]]]:
        for batch in self.ds.iter(batch_size=ROWS_PER_CHUNK):
            keys = list(batch)
            yield [dict(zip(keys, values)) for values in zip(*batch.values())]

    def lines(self) -> Iterator[bytes]:
        for rows in self._batches():
            for row in rows:
                yield _row_line(row)

    def chunks(self, size: int) -> Iterator[tuple[int, int, int, bytes | None]]:
        return _row_chunks(len(self.ds))

    def span(self, offset: int, size: int) -> bytes:
        batch = self.ds[offset : offset + size]
        keys = list(batch)
        return b"".join(_row_line(dict(zip(keys, values))) for values in zip(*batch.values()))

    def read(self, offset: int, length: int) -> bytes:
        return _row_line(self.ds[offset]).rstrip(b"\n")


def load_from_disk(path: str) -> Source:
    datasets = need("datasets", "datasets", "a datasets folder", path)
    if (Path(path) / "dataset_dict.json").is_file():
        splits = sorted(q.name for q in Path(path).iterdir() if q.is_dir())
        raise SourceError(
            path,
            f"a DatasetDict of splits {', '.join(splits)}: name one of their "
            f"folders ({Path(path) / (splits[0] if splits else 'train')})",
        )
    if not (Path(path) / "dataset_info.json").is_file():
        raise SourceError(
            path,
            "a folder, but not one a datasets.Dataset was saved to "
            "(save_to_disk): name a prompt file or such a folder",
        )
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - the library's own errors, said as they are
        raise SourceError(
            path, f"cannot load the datasets folder ({type(e).__name__}: {e})"
        ) from None
    return _Rows(path, ds, "datasets folder")


def snapshot(path: str, name: str) -> str:
    hub = need("huggingface_hub", "datasets", "a hub dataset", path)
    try:
        return hub.snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and other ways of not being cached
        raise SourceError(
            path,
            f"dataset {name} is not in the local hub cache ({hub.constants.HF_HUB_CACHE}"
            f"; it is read offline): download it first (hf download {name} --repo-type dataset), "
            "on a file system the GPU nodes see",
        ) from None


def load_hub(path: str) -> Source:
    name, split = hub_id(path)
    datasets = need("datasets", "datasets", "a hub dataset", path)
    folder = snapshot(path, name)
    try:
        ds = datasets.load_dataset(folder, split=split)
    except ValueError as e:  # an unknown split
        raise SourceError(path, f"{e} (name the split as hf://datasets/{name}:SPLIT)") from None
    except Exception as e:  # noqa: BLE001 - the library's own errors, said as they are
        raise SourceError(path, f"cannot load dataset {name} ({type(e).__name__}: {e})") from None
    return _Rows(path, ds, f"hub dataset (split {split})")
