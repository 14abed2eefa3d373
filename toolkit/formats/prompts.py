"""prompts.msgpack: one `PromptRef` per planned record (where its prompt lives), written and read
in one place.

The file is one msgpack document: an array with one item per shard, in the plan's order, each the
array of that shard's refs in chunks of at most `CHUNK` refs, every chunk a msgpack `bin` holding
the array of its refs (`refs_bytes`, layout `BY_SHARD`). run.json records where each shard's item
starts (`ShardPlan.refs_at`), the layout (`RunPlan.prompts_layout`), and the file's size and sha256
(`RunPlan.prompts_bytes`, `prompts_sha256`: `prompts_problem` checks them). Every header a reader
reads itself is of one fixed size (5 bytes: a shard's array32, a chunk's bin32), and a chunk's refs
are decoded by msgspec in one call (`_chunk_refs`, the one decoder of refs): a worker reads its
shard a chunk at a time from where run.json says it starts, keeping one chunk (`ShardRefs`: its
memory does not grow with the shard).

A run planned by an older toolkit holds one array of every ref instead, each shard's refs back to
back (layout `FLAT`; `refs_at` then says where a shard's first ref starts, or is 0 when not
recorded): it is read the same way, a shard as one chunk given the array header its bytes lack.

`PromptIndex` looks refs up by position in the whole plan (planning again, merge, audit, export,
`toolkit retry`): msgspec splits the file into its chunks in one C pass, a shard is decoded whole
when it is asked for, and a position looked up alone decodes one ref (its shard split into raw refs
once, some 0.1 µs a ref).
"""

from __future__ import annotations

import hashlib
import os
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path

import msgspec

from toolkit.formats.files import sha256_file
from toolkit.formats.rundir import PLAN_FILE, RunDir
from toolkit.formats.runplan import REPLAN, PlanError, RunPlan, ShardPlan, damaged_run_file

__all__ = [
    "BY_SHARD",
    "CHUNK",
    "FLAT",
    "PromptIndex",
    "PromptRef",
    "ShardRefs",
    "prompts_problem",
    "refs_bytes",
    "refs_intact",
]

# RunPlan.prompts_layout: how prompts.msgpack is laid out
FLAT = 1  # one array of every ref, each shard's back to back (planned by an older toolkit)
BY_SHARD = 2  # an array of each shard's array of refs


class PromptRef(msgspec.Struct, array_like=True, omit_defaults=True):
    # the record's id: the prompt's id, plus "#<sample>" when the dataset has n > 1 samples
    id: str
    dataset: int  # index into RunPlan.datasets
    line: int
    offset: int
    length: int
    sample: int = 0  # sample index of the prompt (0 .. n-1)
    turn: int = 0  # regenerated datasets: the user turn this record answers (0 .. turns-1)
    # the prompt's content digest (inputs.content_digest; "": planned by an older toolkit)
    digest: str = ""


def _array_header(n: int) -> bytes:
    """The msgpack header of an array of `n` items."""
    if n < 16:
        return bytes([0x90 | n])
    return (b"\xdc" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdd" + n.to_bytes(4, "big"))


CHUNK = 1024  # refs in a chunk of a shard (the last one of a shard may hold fewer)
ARRAY32, BIN32 = 0xDD, 0xC6  # the headers a reader reads itself: a type byte, a 4-byte size


def _shard_item(refs: list[PromptRef]) -> bytes:
    """A shard's item of prompts.msgpack: the array of its chunks, each a bin of an array of
    refs."""
    chunks = [msgspec.msgpack.encode(refs[i : i + CHUNK]) for i in range(0, len(refs), CHUNK)]
    parts = [bytes([ARRAY32]) + len(chunks).to_bytes(4, "big")]
    for c in chunks:
        parts += [bytes([BIN32]) + len(c).to_bytes(4, "big"), c]
    return b"".join(parts)


def refs_bytes(plan: RunPlan, refs: list[PromptRef]) -> bytes:
    """prompts.msgpack for `plan` (`BY_SHARD`): sets each shard's `refs_at`, where its item starts,
    and the plan's `prompts_layout`, `prompts_bytes` and `prompts_sha256`, what `prompts_problem`
    checks."""
    parts = [_array_header(len(plan.shards))]
    at = len(parts[0])
    for sp in plan.shards:
        part = _shard_item(refs[sp.first : sp.first + sp.count])
        sp.refs_at = at
        parts.append(part)
        at += len(part)
    data = b"".join(parts)
    plan.prompts_layout = BY_SHARD
    plan.prompts_bytes, plan.prompts_sha256 = len(data), hashlib.sha256(data).hexdigest()
    return data


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path} is missing: {REPLAN}") from None
    except OSError as e:
        raise damaged_run_file(path, e) from None


# the decoders of the file's parts, made once (a decoder per call costs a ref's decoding again)
REF = msgspec.msgpack.Decoder(PromptRef)
REFS = msgspec.msgpack.Decoder(list[PromptRef])  # a chunk
RAW = msgspec.msgpack.Decoder(list[msgspec.Raw])  # an array's items, not decoded
CHUNKS = msgspec.msgpack.Decoder(list[list[bytes]])  # the file: each shard's chunks


def _decoded(data: bytes, decoder: msgspec.msgpack.Decoder, path: Path):
    """`data` decoded by `decoder`; a damaged file's PlanError when it cannot be."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:
        raise damaged_run_file(path, e) from None


def _chunk_refs(chunk: bytes, path: Path) -> list[PromptRef]:
    """The refs of one chunk (a msgpack array of refs), decoded in one call."""
    return _decoded(chunk, REFS, path)


def _counted(items: list, sp: ShardPlan, path: Path) -> list:
    """`items` (a shard's refs), when they are as many as the plan says; PlanError when not."""
    if len(items) != sp.count:
        raise PlanError(
            f"{path} holds {len(items)} prompts of shard {sp.index} but {PLAN_FILE} plans "
            f"{sp.count}: it is damaged; {REPLAN}"
        )
    return items


def _file_chunks(data: bytes, plan: RunPlan, path: Path) -> list[list[bytes]]:
    """Each shard's chunks in `data` (the whole file), in the plan's order: msgspec, in one C pass
    (a shard planned by an older toolkit is one chunk)."""
    if plan.prompts_layout == BY_SHARD:
        shards = _decoded(data, CHUNKS, path)
        if len(shards) != len(plan.shards):
            raise PlanError(
                f"{path} holds the prompts of {len(shards)} shards but {PLAN_FILE} plans "
                f"{len(plan.shards)}: it is damaged; {REPLAN}"
            )
        return shards
    items = _decoded(data, RAW, path)
    if len(items) != plan.total:
        raise PlanError(
            f"{path} holds {len(items)} prompts but {PLAN_FILE} plans {plan.total}: it is "
            f"damaged; {REPLAN}"
        )
    at, out = len(data) - sum(len(r) for r in items), []  # items follow the array's header
    for sp in plan.shards:
        size = sum(len(r) for r in items[sp.first : sp.first + sp.count])
        out.append([_array_header(sp.count) + data[at : at + size]])
        at += size
    return out


def _header(f, kind: int, path: Path) -> int:
    """The size a 5-byte header of `kind` read from `f` gives (items of an array, bytes of a
    bin)."""
    head = f.read(5)
    if len(head) != 5 or head[0] != kind:
        raise damaged_run_file(path, ValueError(f"no shard's refs at byte {f.tell() - len(head)}"))
    return int.from_bytes(head[1:], "big")


def _streamed_chunks(path: Path, plan: RunPlan, k: int) -> Iterator[bytes]:
    """Shard `k`'s chunks read from the file one at a time, from where run.json says they start."""
    sp = plan.shards[k]
    if not sp.refs_at:  # planned by an older toolkit, which did not record it
        yield from _file_chunks(_read(path), plan, path)[k]
        return
    try:
        with open(path, "rb") as f:
            if plan.prompts_layout == BY_SHARD:
                f.seek(sp.refs_at)
                for _ in range(_header(f, ARRAY32, path)):
                    yield f.read(_header(f, BIN32, path))
                return
            last = k + 1 == len(plan.shards)  # FLAT: up to the next shard's first ref
            end = os.fstat(f.fileno()).st_size if last else plan.shards[k + 1].refs_at
            f.seek(sp.refs_at)
            yield _array_header(sp.count) + f.read(end - sp.refs_at)
    except FileNotFoundError:
        raise PlanError(f"{path} is missing: {REPLAN}") from None
    except OSError as e:
        raise damaged_run_file(path, e) from None


class ShardRefs:
    """The planned refs of one shard, in planned order, read a chunk at a time (what a worker reads:
    one chunk decoded at a time, however large its shard), and by position in the shard (the chains
    of regenerated conversations: the shard's chunks kept as bytes, some 50 bytes a ref, and the
    chunk looked into last decoded). Its length is the plan's, known without the file."""

    def __init__(self, rd: RunDir, plan: RunPlan, k: int, data: bytes | None = None):
        self.path, self.plan, self.k, self._data = rd.prompts_file, plan, k, data
        self.first, self.count = plan.shards[k].first, plan.shards[k].count
        self._chunks: list[bytes] | None = None  # kept for look-ups by position
        self._starts: list[int] = []  # the position in the shard of each chunk's first ref
        self._at, self._refs = -1, []  # the chunk decoded last, and its refs

    def __len__(self) -> int:
        return self.count

    def _read_chunks(self) -> Iterator[bytes]:
        if self._chunks is not None:
            return iter(self._chunks)
        if self._data is not None:  # prompts.msgpack as a pending change makes it
            return iter(_file_chunks(self._data, self.plan, self.path)[self.k])
        return _streamed_chunks(self.path, self.plan, self.k)

    def __iter__(self) -> Iterator[PromptRef]:
        n = 0
        for chunk in self._read_chunks():
            refs = _chunk_refs(chunk, self.path)
            n += len(refs)
            yield from refs
        _counted(range(n), self.plan.shards[self.k], self.path)

    def _keep(self) -> None:
        """Keep the shard's chunks, and where each starts, for look-ups by position."""
        chunks = list(self._read_chunks())
        at = 0
        for c in chunks:
            self._starts.append(at)
            at += len(_decoded(c, RAW, self.path))
        _counted(range(at), self.plan.shards[self.k], self.path)
        self._chunks = chunks

    def __getitem__(self, i: int) -> PromptRef:
        if self._chunks is None:
            self._keep()
        j = bisect_right(self._starts, i) - 1
        if j != self._at:
            self._at, self._refs = j, _chunk_refs(self._chunks[j], self.path)
        return self._refs[i - self._starts[j]]


class PromptIndex:
    """Every planned prompt ref by position, decoded one shard at a time: a run may plan millions of
    prompts.

    What planning again, merge, audit, export and `toolkit retry` look a record's planned prompt up
    in. PlanError when prompts.msgpack is missing or does not hold the plan's prompts.
    """

    def __init__(self, rd: RunDir, plan: RunPlan, data: bytes | None = None):
        self.path = rd.prompts_file
        self._chunks = _file_chunks(_read(self.path) if data is None else data, plan, self.path)
        self.shards, self.total = plan.shards, plan.total
        self._firsts = [s.first for s in plan.shards]
        self._k = self._asked = -1  # the shard kept decoded; the shard `at` looked into last
        self._refs: list[PromptRef] = []
        self._raw: dict[int, list[msgspec.Raw]] = {}  # shards looked into by position, split

    def __len__(self) -> int:
        return self.total

    def refs(self, first: int = 0, count: int | None = None) -> list[PromptRef]:
        """The refs of positions first .. first+count-1 (all from `first` without a count),
        decoded."""
        end = self.total if count is None else min(first + count, self.total)
        out: list[PromptRef] = []
        for k in range(max(self.shard_of(first), 0), len(self.shards)):
            s = self.shards[k]
            if s.first >= end:
                break
            out += self.shard(k)[max(first - s.first, 0) : end - s.first]
        return out

    def shard_of(self, pos: int) -> int:
        """The index (in the plan's shard list) of the shard that owns planned position `pos`."""
        return bisect_right(self._firsts, pos) - 1

    def shard(self, k: int) -> list[PromptRef]:
        """The refs of shard `k`, in planned order (the last shard asked for is kept decoded)."""
        if k != self._k:
            refs = [r for c in self._chunks[k] for r in _chunk_refs(c, self.path)]
            self._refs = _counted(refs, self.shards[k], self.path)
            self._k = k
        return self._refs

    def at(self, pos: int) -> PromptRef | None:
        """The ref of planned position `pos`; None outside the plan."""
        if not 0 <= pos < self.total:
            return None
        k = self.shard_of(pos)
        if k == self._k or k == self._asked:  # a second look into a shard: decode it whole, once
            return self.shard(k)[pos - self.shards[k].first]
        self._asked = k
        if k not in self._raw:
            raw = [r for c in self._chunks[k] for r in _decoded(c, RAW, self.path)]
            self._raw[k] = _counted(raw, self.shards[k], self.path)
        try:  # the one ref, not its shard: positions asked at random decode one ref each
            return _decoded(self._raw[k][pos - self.shards[k].first], REF, self.path)
        except IndexError as e:
            raise damaged_run_file(self.path, e) from None


def refs_intact(rd: RunDir, plan: RunPlan) -> bool:
    """Whether prompts.msgpack holds the plan's refs, every one readable (and, when the plan
    recorded them, the very bytes it was written with)."""
    return prompts_problem(rd, plan, cheap=False) is None


def prompts_problem(rd: RunDir, plan: RunPlan, *, cheap: bool = True) -> str | None:
    """What is wrong with prompts.msgpack (None: it is what the plan wrote): missing, another size,
    another sha256 than run.json records, or refs that cannot be read. `cheap` (what `status`
    affords on every refresh): its size always, its content only when it was written after
    run.json (a change in place moves its mtime)."""
    path = rd.prompts_file
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror})"
    if plan.prompts_bytes and st.st_size != plan.prompts_bytes:
        return (
            f"{path.name} has {st.st_size:,} bytes, {rd.plan_file.name} says {plan.prompts_bytes:,}"
        )
    if cheap:
        try:
            if st.st_mtime <= rd.plan_file.stat().st_mtime:
                return None
        except OSError:
            pass
    try:
        if plan.prompts_sha256:
            if sha256_file(path) != plan.prompts_sha256:
                return f"{path.name} differs from the sha256 {rd.plan_file.name} records"
            return None
        PromptIndex(rd, plan).refs()
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror})"
    except PlanError as e:
        return str(e).replace("; " + REPLAN, "").replace(str(path), path.name)
    return None
