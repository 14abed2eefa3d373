"""What run.json holds (`RunPlan`): the resolved job, the fingerprint, the shard plan, and how it
grew; `PlanError`, the error of a plan that cannot be made or a run that cannot be read.

The schema holds the job as planned (`RunPlan.spec`), whose type is the job layer's: `RunPlan` is
generic over it, and the opener names it (`formats.run.Run.open(path, JobSpec)`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

from toolkit.errors import BadInputError

__all__ = [
    "PLAN_FORMAT",
    "ENGINE_PART",
    "REPLAN",
    "STUB",
    "DatasetPlan",
    "Growth",
    "PlanError",
    "RunPlan",
    "ShardPlan",
    "SkippedLine",
    "damaged_run_file",
    "fingerprint_of",
    "plan_bytes",
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
    # byte offset of its refs in prompts.msgpack (formats.prompts; 0: not recorded, by an older
    # toolkit)
    refs_at: int = 0


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
    prompts_layout: int = 1  # how prompts.msgpack is laid out (formats.prompts.FLAT, BY_SHARD)

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
