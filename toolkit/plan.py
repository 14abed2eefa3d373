"""Planning a run: the run directory, the shard map and the fingerprint, all fixed before any GPU work.

`plan_job` reads and validates every prompt line, assigns prompts to shards deterministically and computes
a fingerprint of everything that changes the output (model, tokenizer, template, sampling, input files,
shard map). `create_run` pins that plan into a run directory; a run directory never changes its plan, and
a job whose fingerprint differs is refused there (unless a new run is asked for).

Run directory layout (`RunDir` names every path):

    RUN/run.json              resolved spec, fingerprint, shard plan
    RUN/prompts.msgpack       where each planned prompt lives (dataset, line, byte offset), in planned order
    RUN/shards/NNNNN.zst      append-only record frames;  shards/NNNNN.done  completion manifest
    RUN/shards/NNNNN.retry    ids `toolkit retry` asked to generate again (removed when the shard completes)
    RUN/progress/NNNNN.json   live progress of a shard
    RUN/logs/NNNNN.log        worker log;  logs/NNNNN.server.log  the engine's own output
    RUN/slurm/                submitit's folder;  RUN/merged/  merged dataset, audit report

Shard k owns a contiguous range of planned positions; planned positions are dealt round-robin from the
input order, so every shard gets a similar mix of datasets and prompt lengths.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from .files import atomic_write, shown_path
from .inputs import InputError, Prompt, check_unique_ids, scan_dataset
from .spec import JobSpec

__all__ = ["PlanError", "RunDir", "RunPlan", "PromptRef", "ShardPlan", "plan_job", "create_run", "load_run"]

PLAN_FORMAT = 1


class PlanError(Exception):
    """A plan that cannot be made or a run directory that does not match."""


class DatasetPlan(msgspec.Struct):
    name: str
    path: str
    sha256: str
    prompts: int


class ShardPlan(msgspec.Struct):
    index: int
    first: int  # first planned position
    count: int


class PromptRef(msgspec.Struct, array_like=True):
    id: str
    dataset: int  # index into RunPlan.datasets
    line: int
    offset: int
    length: int


class RunPlan(msgspec.Struct):
    format: int
    name: str
    fingerprint: str
    parts: dict[str, str]
    created: str
    total: int
    spec: JobSpec
    datasets: list[DatasetPlan]
    shards: list[ShardPlan]


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    plan_file = property(lambda self: self.root / "run.json")
    prompts_file = property(lambda self: self.root / "prompts.msgpack")
    shards_dir = property(lambda self: self.root / "shards")
    progress_dir = property(lambda self: self.root / "progress")
    logs_dir = property(lambda self: self.root / "logs")
    slurm_dir = property(lambda self: self.root / "slurm")
    merged_dir = property(lambda self: self.root / "merged")
    jobs_file = property(lambda self: self.root / "slurm" / "jobs.json")

    @property
    def shown(self) -> str:
        """The run directory as a user would type it: relative to the current directory when inside it."""
        return shown_path(self.root)

    def shard_file(self, i: int) -> Path:
        return self.shards_dir / f"{i:05d}.zst"

    def done_file(self, i: int) -> Path:
        return self.shards_dir / f"{i:05d}.done"

    def retry_file(self, i: int) -> Path:
        return self.shards_dir / f"{i:05d}.retry"

    def progress_file(self, i: int) -> Path:
        return self.progress_dir / f"{i:05d}.json"

    def log_file(self, i: int) -> Path:
        return self.logs_dir / f"{i:05d}.log"

    def server_log_file(self, i: int) -> Path:
        return self.logs_dir / f"{i:05d}.server.log"

    def make_dirs(self) -> None:
        for d in (self.root, self.shards_dir, self.progress_dir, self.logs_dir, self.slurm_dir):
            d.mkdir(parents=True, exist_ok=True)


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


_TOKENIZER_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt", ".py", ".py.txt")


def _hash_folder_meta(folder: str) -> str:
    """Hash the small files of a model/tokenizer folder (tokenizer, template, configs), never the weights."""
    p = Path(folder)
    h = hashlib.sha256()
    if not p.is_dir():
        h.update(folder.encode())  # a hub id: its name is all we can pin without downloading
        return h.hexdigest()
    for f in sorted(p.iterdir()):
        if f.is_file() and f.name.endswith(_TOKENIZER_SUFFIXES) and f.stat().st_size < (64 << 20):
            h.update(f.name.encode() + b"\0" + _sha256_file(f).encode())
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()


def plan_job(spec: JobSpec) -> tuple[RunPlan, list[PromptRef]]:
    """Validate every prompt line and make the shard plan and fingerprint (no run directory yet)."""
    prompts: list[Prompt] = []
    datasets: list[DatasetPlan] = []
    for d in spec.datasets:
        before = len(prompts)
        prompts.extend(scan_dataset(d.path, d.name))
        datasets.append(DatasetPlan(d.name, d.path, _sha256_file(d.path), len(prompts) - before))
    check_unique_ids(prompts, {d.name: d.path for d in spec.datasets})
    n, s = len(prompts), spec.sharding.shards
    if s > n:
        raise PlanError(f"{s} shards for {n} prompts: lower [sharding] shards to at most {n}")
    index = {d.name: i for i, d in enumerate(spec.datasets)}
    refs: list[PromptRef] = []
    shards: list[ShardPlan] = []
    for k in range(s):
        first = len(refs)
        refs.extend(PromptRef(p.id, index[p.dataset], p.line, p.offset, p.length) for p in prompts[k::s])
        shards.append(ShardPlan(k, first, len(refs) - first))
    m = spec.model
    parts = {
        "model": _digest([m.path, _hash_folder_meta(m.path)]),
        "tokenizer": _digest([m.tokenizer_path, _hash_folder_meta(m.tokenizer_path or m.path)]),
        "template": _digest(
            [_sha256_file(m.chat_template) if m.chat_template else None, m.chat_template_kwargs, m.think_start, m.think_end, m.tool_call_start]
        ),
        "sampling": _digest([spec.sampling, {d.name: d.sampling for d in spec.datasets}]),
        "inputs": _digest([[d.name, d.sha256] for d in datasets]),
        "shards": _digest([s, [r.id for r in refs]]),
    }
    fingerprint = _digest(parts)[:16]
    plan = RunPlan(
        format=PLAN_FORMAT,
        name=spec.name,
        fingerprint=fingerprint,
        parts=parts,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        total=n,
        spec=spec,
        datasets=datasets,
        shards=shards,
    )
    return plan, refs


def load_run(run_dir: str | os.PathLike) -> tuple[RunDir, RunPlan]:
    rd = RunDir(run_dir)
    try:
        plan = msgspec.json.decode(rd.plan_file.read_bytes(), type=RunPlan)
    except FileNotFoundError:
        raise PlanError(f"{rd.root}: not a run directory (no run.json); plan one with `toolkit submit` or `toolkit run`") from None
    except msgspec.ValidationError as e:
        raise PlanError(f"{rd.plan_file}: unreadable run plan ({e})") from None
    return rd, plan


def load_refs(rd: RunDir, first: int = 0, count: int | None = None) -> list[PromptRef]:
    """The planned prompt refs (all, or positions first .. first+count-1: only those are decoded)."""
    raw = msgspec.msgpack.decode(rd.prompts_file.read_bytes(), type=list[msgspec.Raw])
    end = len(raw) if count is None else first + count
    decode = msgspec.msgpack.Decoder(PromptRef).decode
    return [decode(r) for r in raw[first:end]]


class RefSlice:
    """The planned refs of positions first .. first+count-1, kept as their msgpack bytes (a few bytes per prompt,
    not a Python object each) and decoded one at a time: a worker's memory does not grow with its shard's size."""

    _decode = msgspec.msgpack.Decoder(PromptRef).decode

    def __init__(self, rd: RunDir, first: int, count: int):
        from array import array

        data = rd.prompts_file.read_bytes()
        raw = msgspec.msgpack.decode(data, type=list[msgspec.Raw])
        sizes = [len(r) for r in raw]
        del raw
        start = len(data) - sum(sizes) + sum(sizes[:first])  # items follow the array header, back to back
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
        return self._decode(self._data[begin : self._ends[i]])


def create_run(plan: RunPlan, refs: list[PromptRef], *, new_run: bool = False) -> RunDir:
    """Pin `plan` into its run directory; reuse the directory if it holds the same fingerprint."""
    root = Path(plan.spec.output_dir)
    if new_run and (root / "run.json").exists():
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = root.with_name(f"{root.name}.{stamp}")
        plan.spec.output_dir = str(root)
    rd = RunDir(root)
    if rd.plan_file.exists():
        _, old = load_run(root)
        if old.fingerprint != plan.fingerprint:
            differs = sorted(k for k in plan.parts if old.parts.get(k) != plan.parts[k])
            raise PlanError(
                f"{root} holds run {old.fingerprint} but this job gives {plan.fingerprint} "
                f"(differs in: {', '.join(differs) or 'format'}). Its records would not match: restore the job as it "
                f"was, point `output_dir` elsewhere, or pass --new-run to start a new run directory beside it."
            )
        return rd
    rd.make_dirs()
    atomic_write(rd.prompts_file, msgspec.msgpack.encode(refs))
    atomic_write(rd.plan_file, msgspec.json.format(msgspec.json.encode(plan), indent=2))
    return rd


def check_plan_inputs(plan: RunPlan) -> None:
    """Refuse to generate from an input file that changed since planning (its records would not match)."""
    for d in plan.datasets:
        try:
            now = _sha256_file(d.path)
        except FileNotFoundError:
            raise InputError(d.path, None, None, f"prompt file of dataset {d.name!r} is gone since the run was planned") from None
        if now != d.sha256:
            raise InputError(
                d.path, None, None,
                f"changed since the run was planned (sha256 {d.sha256[:12]} -> {now[:12]}); restore it or plan a new run",
            )
