"""What a run directory holds about its plan, read and written in one place: run.json (`RunPlan`:
the resolved job, the fingerprint, the shard plan) and prompts.msgpack (one `PromptRef` per planned
record: where its prompt lives), and `Run`, a run directory opened.

`Run.open` opens a run read-only unless asked to finish a change a crash interrupted
(formats.pending): the commands that plan or run a run finish it (`Run.open(path, JobSpec,
finish=True)`); those that
only read (status, logs, export, `toolkit.read_run`) write nothing and read the run as the change
makes it.

prompts.msgpack is a msgpack array of every planned ref, each shard's refs back to back
(`refs_bytes`), each shard's first byte recorded in run.json (`ShardPlan.refs_at`), and the file's
size and sha256 (`RunPlan.prompts_bytes`, `prompts_sha256`: `prompts_problem` checks them). One
reader,
`PromptIndex`, looks refs up by position: msgspec splits the array into its raw items in one C pass
(some 0.1 µs a ref; decoding every ref to a Python object costs four times that), and refs are
decoded a shard at a time. A worker reads its shard with `ShardRefs`, which streams the refs a chunk
at a time and keeps none (its memory does not grow with the shard); `RefSlice` keeps a range of raw
refs, a few bytes each, for positional look-ups.

The run.json schema holds the job as planned (`RunPlan.spec`), whose type is the job layer's:
`RunPlan` is generic over it, and the opener names it (`Run.open(path, JobSpec)`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

from toolkit.errors import BadInputError
from toolkit.formats import pending
from toolkit.formats.files import atomic_write, sha256_file
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardstate import MANIFEST, Checks, ShardStatus, shard_state

log = logging.getLogger(__name__)

__all__ = [
    "PLAN_FORMAT",
    "ENGINE_PART",
    "STUB",
    "DatasetPlan",
    "Growth",
    "PlanError",
    "PromptIndex",
    "PromptRef",
    "RefSlice",
    "Run",
    "RunPlan",
    "ShardPlan",
    "ShardRefs",
    "SkippedLine",
    "damaged_run_file",
    "fingerprint_of",
    "plan_bytes",
    "prompts_problem",
    "refs_bytes",
]

# 2: ids of lines without one derived from their content, and refs carry content digests
PLAN_FORMAT = 2

S = TypeVar("S")  # the job spec's type (job.spec.JobSpec)

# The fingerprint part that says a run's records are the stub engine's (synthetic, not a model's):
# `parts["engine"] = "stub"`, only in a run of the stub. A run of a model has no such part, so
# its fingerprint is what it was before the part existed.
ENGINE_PART, STUB = "engine", "stub"


def fingerprint_of(parts: dict[str, str]) -> str:
    """The fingerprint of a plan's parts (the digest of each thing that changes the output)."""
    return hashlib.sha256(msgspec.json.encode(parts, order="deterministic")).hexdigest()[:16]


class PlanError(BadInputError):
    """A plan that cannot be made, or a run directory that cannot be read or does not match."""


class SkippedLine(msgspec.Struct):
    """A prompt line left out of the run, and why (what its error would have said)."""

    line: int
    reason: str


class DatasetPlan(msgspec.Struct):
    name: str
    path: str
    sha256: str
    prompts: int
    samples: int = 1  # outputs planned per prompt ([sampling] n)
    regenerate: bool = False  # one record per user turn of each conversation (job.turns)
    conversations: int = 0  # regenerate: conversations of the file (prompts counts their turns)
    bad_lines: int = 0  # lines left out: [inputs] on_bad_line = "skip"
    too_long: int = 0  # prompts left out: [inputs] on_too_long = "skip"
    skipped: list[SkippedLine] = []  # the first lines left out (job.plan.SKIPPED_KEPT), with why

    @property
    def skipped_lines(self) -> int:
        return self.bad_lines + self.too_long

    @property
    def planned(self) -> int:
        """Planned records of the dataset: one per (prompt, sample)."""
        return self.prompts * self.samples


class ShardPlan(msgspec.Struct):
    index: int
    first: int  # first planned position
    count: int
    # byte offset of its first ref in prompts.msgpack (0: not recorded, by an older toolkit)
    refs_at: int = 0


class PromptRef(msgspec.Struct, array_like=True, omit_defaults=True):
    id: str  # the record's id: the prompt's id, plus "#<sample>" when the dataset has n > 1
    # samples
    dataset: int  # index into RunPlan.datasets
    line: int
    offset: int
    length: int
    sample: int = 0  # sample index of the prompt (0 .. n-1)
    turn: int = 0  # regenerated datasets: the user turn this record answers (0 .. turns-1)
    # the prompt's content digest (inputs.content_digest; "": planned by an older toolkit)
    digest: str = ""


class Growth(msgspec.Struct):
    """One time a run took the prompts its job's files gained (job.grow)."""

    at: str
    prompts: int  # prompts added (records: samples and turns of each)
    records: int
    shards: list[int]  # the shards added for them
    datasets: list[str] = []  # datasets the job gained


class RunPlan(msgspec.Struct, Generic[S]):
    format: int
    name: str
    fingerprint: str
    parts: dict[str, str]
    created: str
    total: int
    spec: S
    datasets: list[DatasetPlan]
    shards: list[ShardPlan]
    # The job planned again into this run with other inputs (job.grow): each time, the fingerprint
    # that job gives on its own (resumed here from then on) and what was added. `fingerprint` stays
    # the run's: its files carry it.
    aliases: list[str] = []
    grown: list[Growth] = []
    # prompts.msgpack as refs_bytes wrote it (0 and "": planned by an older toolkit)
    prompts_bytes: int = 0
    prompts_sha256: str = ""

    @property
    def noun(self) -> str:
        """What one planned record is, in words: a prompt, or with [sampling] n > 1 anywhere, an
        output (one sample of a prompt)."""
        return "prompt" if all(d.samples == 1 for d in self.datasets) else "output"

    def counted(self) -> str:
        """The plan's size in words: `44 prompts`, or with samples `60 outputs (30 prompts × 2
        samples)`."""
        if self.noun == "prompt":
            return f"{self.total} prompt{'s' * (self.total != 1)}"
        prompts = sum(d.prompts for d in self.datasets)
        samples = sorted({d.samples for d in self.datasets if d.prompts})
        each = (
            f"× {samples[0]} samples"
            if len(samples) == 1
            else f"with {samples[0]} to {samples[-1]} samples each"
        )
        return f"{self.total} outputs ({prompts} prompt{'s' * (prompts != 1)} {each})"

    @property
    def synthetic(self) -> bool:
        """Whether the run's records are the stub engine's: synthetic text, not a model's. Pinned
        by the fingerprint (`ENGINE_PART`); a run planned before that part existed says it by its
        [engine] kind as last planned."""
        if ENGINE_PART in self.parts:
            return self.parts[ENGINE_PART] == STUB
        engine = getattr(self.spec, "engine", None)
        return getattr(engine, "kind", None) == STUB

    @property
    def engine_class(self) -> str:
        """What made the records, in one word for manifests, summaries and file metadata: "stub"
        (synthetic text) or "model" (`made_by` says it in words)."""
        return STUB if self.synthetic else "model"

    @property
    def made_by(self) -> str:
        """What generated the run's records, in words."""
        if self.synthetic:
            return "the stub engine (synthetic records, not a model's)"
        return "a model (engine kind sglang or external)"

    def same_job(self, other: RunPlan) -> bool:
        """Whether `other` (a job as planned now) is the job this run holds, as planned or as grown
        since, with records of the same maker: a run of the stub and a run of a model never are."""
        if self.synthetic != other.synthetic:
            return False
        mine = {self.fingerprint, *self.aliases}
        if other.fingerprint in mine:
            return True
        # a run of the stub planned before the engine was part of the fingerprint
        legacy = {k: v for k, v in other.parts.items() if k != ENGINE_PART}
        return ENGINE_PART not in self.parts and fingerprint_of(legacy) in mine


REPLAN = (
    "plan the job again into this folder to recover it: `toolkit run JOB` (or `toolkit submit "
    "JOB`) with the job file that made the run writes it again, keeps every shard file of that "
    "job and generates nothing already done"
)


def damaged_run_file(path: Path, e: Exception) -> PlanError:
    """The one-line error of a run.json or prompts.msgpack that cannot be read, with the command
    that recovers."""
    if isinstance(e, OSError):
        why = e.strerror or str(e)
    else:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return PlanError(f"{path} is damaged ({why}); {REPLAN}")


def plan_bytes(plan: RunPlan) -> bytes:
    """run.json: the plan as indented JSON."""
    return msgspec.json.format(msgspec.json.encode(plan), indent=2)


def _array_header(n: int) -> bytes:
    """The msgpack header of an array of `n` items."""
    if n < 16:
        return bytes([0x90 | n])
    return (b"\xdc" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdd" + n.to_bytes(4, "big"))


def refs_bytes(plan: RunPlan, refs: list[PromptRef]) -> bytes:
    """prompts.msgpack: the msgpack array of every planned ref (what msgspec encodes for `refs`),
    each shard's refs back to back; sets each shard's `refs_at`, where its first ref starts, for
    `ShardRefs`, and the plan's `prompts_bytes` and `prompts_sha256`, what `prompts_problem`
    checks."""
    parts = [_array_header(len(refs))]
    at = len(parts[0])
    for sp in plan.shards:
        items = msgspec.msgpack.encode(refs[sp.first : sp.first + sp.count])[
            len(_array_header(sp.count)) :
        ]
        sp.refs_at = at
        parts.append(items)
        at += len(items)
    data = b"".join(parts)
    plan.prompts_bytes, plan.prompts_sha256 = len(data), hashlib.sha256(data).hexdigest()
    return data


class Run(Generic[S]):
    """A run directory opened: its paths (`rd`), its plan (run.json) and its prompt index."""

    def __init__(self, rd: RunDir, plan: RunPlan[S], prompts: bytes | None = None):
        self.rd, self.plan = rd, plan
        self._prompts = prompts  # prompts.msgpack as a pending change makes it (None: the file's)

    @classmethod
    def open(cls, run_dir: str | os.PathLike, spec: type[S], *, finish: bool = False) -> Run[S]:
        """Open the run in `run_dir`, whose job spec is of type `spec`. PlanError when it is no run
        directory or its run.json cannot be read.

        A change a crash interrupted (formats.pending) is finished first with `finish` (the commands
        that plan or run a run); without it nothing is written, and the run is read as the change
        makes it."""
        rd = RunDir(run_dir)
        if rd.root.is_file():
            hint = (
                (
                    f"; it looks like a job spec: `toolkit run {run_dir}` or `toolkit submit "
                    f"{run_dir}` plan and run it, and print the run directory to give here"
                )
                if rd.root.suffix == ".toml"
                else ""
            )
            raise PlanError(f"{run_dir}: is a file, not a run directory{hint}")
        change = _pending(rd, finish)
        data = change.plan if change is not None else None
        try:
            if data is None:
                data = rd.plan_file.read_bytes()
            plan = msgspec.json.decode(data, type=RunPlan[spec])
        except FileNotFoundError:
            raise PlanError(
                f"{rd.root}: not a run directory (no run.json); plan one with `toolkit submit` or "
                "`toolkit run`"
            ) from None
        # garbage, empty, truncated, not a plan, a folder
        except (msgspec.DecodeError, OSError) as e:
            raise damaged_run_file(rd.plan_file, e) from None
        return cls(rd, plan, change.prompts if change is not None else None)

    def prompts(self) -> PromptIndex:
        """The planned prompt refs by position (PlanError when prompts.msgpack does not hold the
        plan's)."""
        return PromptIndex(self.rd, self.plan, self._prompts)

    def shard_state(
        self, k: int, checks: Checks = MANIFEST, *, group: str | None = None, recheck: bool = False
    ) -> ShardStatus:
        """The state of shard `k` (formats.shardstate) with `checks`: a done manifest of another run
        is never taken for this run's."""
        return shard_state(self.rd, k, self.plan.fingerprint, checks, group=group, recheck=recheck)

    def write_plan(self) -> None:
        """Write run.json from `plan` (atomically)."""
        atomic_write(self.rd.plan_file, plan_bytes(self.plan))


def _pending(rd: RunDir, finish: bool) -> pending.PendingChange | None:
    """The change a crash interrupted, when it is to be read rather than finished; finishes it with
    `finish`."""
    try:
        if finish:
            pending.finish(rd)
            return None
        change = pending.read(rd)
    except OSError as e:
        raise PlanError(
            f"{rd.root}: a change to the run was interrupted and cannot be finished here "
            f"({e.strerror or e}): run the command again as a user who can write the run directory"
        ) from None
    except msgspec.DecodeError as e:
        raise PlanError(
            f"{rd.pending_file} is damaged ({e}): a change to the run (its growth) was "
            "interrupted and cannot be finished; plan the job into a new run (`--new-run`)"
        ) from None
    if change is not None:
        log.warning(
            "run %s: a change to the run was interrupted (%s): read as it will be once finished, "
            "which the next command that runs or plans the run does",
            rd.shown,
            change.what,
        )
    return change


def _raw_items(data: bytes, path: Path) -> list[msgspec.Raw]:
    """prompts.msgpack's bytes as one raw msgpack item per planned prompt (msgspec, in one C
    pass)."""
    try:
        return msgspec.msgpack.decode(data, type=list[msgspec.Raw])
    except msgspec.DecodeError as e:
        raise damaged_run_file(path, e) from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path} is missing: {REPLAN}") from None
    except OSError as e:
        raise damaged_run_file(path, e) from None


_decode_ref = msgspec.msgpack.Decoder(PromptRef).decode


def _decoded(raw: list[msgspec.Raw], path: Path) -> list[PromptRef]:
    try:
        return [_decode_ref(r) for r in raw]
    except msgspec.DecodeError as e:
        raise damaged_run_file(path, e) from None


class PromptIndex:
    """Every planned prompt ref by position, decoded one shard at a time: a run may plan millions of
    prompts.

    What planning again, merge, audit, export and `toolkit retry` look a record's planned prompt up
    in. PlanError when prompts.msgpack is missing or does not hold the plan's prompts.
    """

    def __init__(self, rd: RunDir, plan: RunPlan, data: bytes | None = None):
        self.path = rd.prompts_file
        self._raw = _raw_items(_read(self.path) if data is None else data, self.path)
        if len(self._raw) != plan.total:
            raise PlanError(
                f"{self.path} holds {len(self._raw)} prompts but {rd.plan_file.name} plans "
                f"{plan.total}: it is damaged; {REPLAN}"
            )
        self.shards = plan.shards
        self._firsts = [s.first for s in plan.shards]
        self._k = self._asked = -1  # the shard kept decoded; the shard `at` looked into last
        self._refs: list[PromptRef] = []

    def __len__(self) -> int:
        return len(self._raw)

    def refs(self, first: int = 0, count: int | None = None) -> list[PromptRef]:
        """The refs of positions first .. first+count-1 (all from `first` without a count),
        decoded."""
        return _decoded(
            self._raw[first : len(self._raw) if count is None else first + count], self.path
        )

    def shard_of(self, pos: int) -> int:
        """The index (in the plan's shard list) of the shard that owns planned position `pos`."""
        return bisect_right(self._firsts, pos) - 1

    def shard(self, k: int) -> list[PromptRef]:
        """The refs of shard `k`, in planned order (the last shard asked for is kept decoded)."""
        if k != self._k:
            s = self.shards[k]
            self._refs = self.refs(s.first, s.count)
            self._k = k
        return self._refs

    def at(self, pos: int) -> PromptRef | None:
        """The ref of planned position `pos`; None outside the plan."""
        if not 0 <= pos < len(self._raw):
            return None
        k = self.shard_of(pos)
        if k == self._k or k == self._asked:  # a second look into a shard: decode it whole, once
            return self.shard(k)[pos - self.shards[k].first]
        self._asked = k
        try:  # the one ref, not its shard: positions asked at random decode one ref each
            return _decode_ref(self._raw[pos])
        except msgspec.DecodeError as e:
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


_FIXED = {
    0xC0: 0,
    0xC2: 0,
    0xC3: 0,
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xCA: 4,
    0xCB: 8,
}  # msgpack types of a fixed size after their type byte: nil, bools, ints, floats


def _item_end(buf: bytes, i: int) -> int:
    """Where the msgpack object starting at buf[i] ends (what a PromptRef holds: arrays, strings,
    numbers). IndexError when `buf` ends first."""
    b = buf[i]
    if b < 0x80 or b >= 0xE0:
        return i + 1
    if 0xA0 <= b <= 0xBF:
        end = i + 1 + (b & 0x1F)
    elif 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        if b <= 0x9F:
            n, i = b & 0x0F, i + 1
        else:
            size = 2 if b == 0xDC else 4
            n, i = int.from_bytes(buf[i + 1 : i + 1 + size], "big"), i + 1 + size
        for _ in range(n):
            i = _item_end(buf, i)
        return i
    elif b in (0xD9, 0xDA, 0xDB):
        size = {0xD9: 1, 0xDA: 2, 0xDB: 4}[b]
        end = i + 1 + size + int.from_bytes(buf[i + 1 : i + 1 + size], "big")
    elif b in _FIXED:
        end = i + 1 + _FIXED[b]
    else:
        raise ValueError(f"msgpack type 0x{b:02x} is not one a prompt ref holds")
    if end > len(buf):
        raise IndexError("the buffer ends inside the object")
    return end


class ShardRefs:
    """The planned refs of one shard, read from prompts.msgpack in planned order a chunk at a time:
    a worker keeps nothing per prompt, however large its shard. Splitting the whole array in C
    (`PromptIndex`) is faster but holds every raw ref; this walks the msgpack items in Python (some
    2 µs a ref) in flat memory."""

    CHUNK = 1 << 18

    def __init__(self, rd: RunDir, sp: ShardPlan):
        self.path, self.first, self.count, self.at = rd.prompts_file, sp.first, sp.count, sp.refs_at

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[PromptRef]:
        with open(self.path, "rb") as f:
            if self.at:
                f.seek(self.at)
                buf, i, skip = f.read(self.CHUNK), 0, 0
            # planned by an older toolkit: from the array's header on, past the refs of the shards
            # before
            else:
                buf = f.read(self.CHUNK)
                i, skip = ({0xDC: 3, 0xDD: 5}.get(buf[0], 1) if buf else 0), self.first
            for n in range(skip + self.count):
                while True:
                    try:
                        end = _item_end(buf, i)
                        break
                    except ValueError as e:  # not a prompt ref's bytes
                        raise damaged_run_file(self.path, e) from None
                    except IndexError:
                        more = f.read(self.CHUNK)
                        if not more:
                            raise PlanError(
                                f"{self.path} ends before the refs of positions {self.first}.."
                                f"{self.first + self.count - 1}: it is damaged; {REPLAN}"
                            ) from None
                        buf, i = buf[i:] + more, 0
                if n >= skip:
                    try:
                        ref = _decode_ref(buf[i:end])
                    except msgspec.DecodeError as e:
                        raise damaged_run_file(self.path, e) from None
                    yield ref
                i = end


class RefSlice:
    """The planned refs of positions first .. first+count-1 by position, kept as their msgpack bytes
    (some 60 bytes a prompt, not a Python object each) and decoded one at a time: for the chains of
    regenerated conversations, which look turns up by position (a shard's prompts in order are read
    by `ShardRefs`, keeping nothing)."""

    def __init__(self, rd: RunDir, first: int, count: int):
        self.path = rd.prompts_file
        data = _read(self.path)
        raw = _raw_items(data, self.path)
        sizes = [len(r) for r in raw]
        del raw
        # items follow the array header, back to back
        start = len(data) - sum(sizes) + sum(sizes[:first])
        self.first = first
        self._ends = array("Q")
        end = 0
        for n in sizes[first : first + count]:
            end += n
            self._ends.append(end)
        self._data = data[start : start + end]

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> PromptRef:
        begin = self._ends[i - 1] if i else 0
        try:
            return _decode_ref(self._data[begin : self._ends[i]])
        except msgspec.DecodeError as e:
            raise damaged_run_file(self.path, e) from None
