"""Planning a run: the run directory, the shard map and the fingerprint, all fixed before any GPU
work.

`plan_job` reads and validates every prompt line, assigns prompts to shards deterministically and
computes a fingerprint of everything that changes the output (model, tokenizer, template, sampling,
input files, shard map, and whether the stub engine makes the records: `RunPlan.synthetic`; a run
of the stub and a run of a model never share a run directory). `create_run` pins that plan into a
run directory; a job whose fingerprint differs is refused there (unless a new run is asked for),
except the same job with other prompt files (`may_grow`), which `grow` plans into the run: what is
planned never moves, new prompts get new shards. Run settings that do not change the output
([engine] but its kind's stub-or-model, [client], [slurm], [audit], flush intervals) are taken from
the job when it is planned again.

Where the run goes (output_dir, or a run beside it) is `findrun`'s to say; which settings a run
takes from the job when it is planned again, `runsettings`'.

The run directory's layout is in `formats.rundir`; what run.json holds in `formats.runplan`, what
prompts.msgpack holds and its one reader in `formats.prompts`, and a run opened in `formats.run`:
planning uses them for every read and write of those files.

Shard k owns a contiguous range of planned positions; planned positions are dealt round-robin from
the input order, so every shard gets a similar mix of datasets and prompt lengths.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any

import msgspec

from toolkit.errors import FailedError
from toolkit.formats import pending
from toolkit.formats.files import FULL, atomic_write, io_problem, sha256_file
from toolkit.formats.prompts import PromptRef, refs_bytes, refs_intact
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import (
    ENGINE_PART,
    PLAN_FORMAT,
    STUB,
    DatasetPlan,
    PlanError,
    RunPlan,
    ShardPlan,
    SkippedLine,
    fingerprint_of,
    plan_bytes,
)
from toolkit.formats.text import utc_now
from toolkit.job.findrun import find_run
from toolkit.job.inputs import duplicate_id, scan_dataset, source_errors
from toolkit.job.promptline import InputError, Prompt
from toolkit.job.runsettings import update_settings
from toolkit.job.schema import DatasetSpec, JobSpec
from toolkit.job.sources import source_sha256
from toolkit.job.turns import turn_id, user_turns

log = logging.getLogger(__name__)

__all__ = [
    "sample_id",
    "plan_job",
    "create_run",
]

# skipped lines kept in run.json per dataset, with their reason; the rest are counted
SKIPPED_KEPT = 20


def _note_skipped(dp: DatasetPlan, line: int, reason: str) -> None:
    if len(dp.skipped) < SKIPPED_KEPT:
        dp.skipped.append(SkippedLine(line, reason))


def sample_id(prompt_id: str, sample: int, samples: int) -> str:
    """The stable record id of sample `sample` of a prompt: its id when there is one sample, else
    `id#k`."""
    return prompt_id if samples == 1 else f"{prompt_id}#{sample}"


_TOKENIZER_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt", ".py", ".py.txt")


def _hash_folder_meta(folder: str) -> str:
    """Hash the small files of a model/tokenizer folder (tokenizer, template, configs), never the
    weights."""
    p = Path(folder)
    h = hashlib.sha256()
    if not p.is_dir():
        h.update(folder.encode())  # a hub id: its name is all we can pin without downloading
        return h.hexdigest()
    for f in sorted(p.iterdir()):
        if f.is_file() and f.name.endswith(_TOKENIZER_SUFFIXES) and f.stat().st_size < (64 << 20):
            h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


def _digest(obj: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()


def _sha256(path: str, dataset: str) -> str:
    """What a dataset's source holds, hashed (inputs.source_errors)."""
    with source_errors(path, dataset):
        return source_sha256(path)


def plan_job(
    spec: JobSpec, exclude: dict[tuple[str, int], str] | None = None
) -> tuple[RunPlan, list[PromptRef]]:
    """Validate every prompt line and make the shard plan and fingerprint (no run directory yet).

    A line that cannot be used is an InputError (every one of every file at once), or, with [inputs]
    on_bad_line = "skip", left out and counted in its DatasetPlan. `exclude` leaves out more lines,
    (dataset, line) -> why (the pre-flight's prompts too long for the context, with [inputs]
    on_too_long = "skip")."""
    prompts, n_turns, datasets = _read_prompts(spec, exclude or {})
    refs, shards = _deal(spec.sharding.shards, prompts, n_turns, datasets)
    parts = _parts(spec, datasets, refs)
    plan = RunPlan(
        format=PLAN_FORMAT,
        name=spec.name,
        fingerprint=fingerprint_of(parts),
        parts=parts,
        created=utc_now(),
        total=len(refs),
        spec=spec,
        datasets=datasets,
        shards=shards,
    )
    return plan, refs


def _read_prompts(
    spec: JobSpec, exclude: dict[tuple[str, int], str]
) -> tuple[list[Prompt], list[int], list[DatasetPlan]]:
    """Every usable prompt of every dataset, in input order (where each lives, not its messages:
    memory stays small), its records per sample (1, or its user turns when regenerated), and each
    dataset's plan. The bad lines and duplicate ids of every file are one InputError, said
    together, unless [inputs] on_bad_line = "skip" leaves them out."""
    skip_bad = spec.inputs.on_bad_line == "skip"
    prompts: list[Prompt] = []
    datasets: list[DatasetPlan] = []
    # every bad line and duplicate id of every file, reported together
    errors: list[InputError] = []
    # records per sample of each prompt: 1, or its user turns when regenerated
    n_turns: list[int] = []
    paths = {d.name: d.path for d in spec.datasets}
    seen: dict[str, tuple[str, int]] = {}  # id -> (dataset, line) of its first use
    for d in spec.datasets:
        before = len(prompts)
        dp = DatasetPlan(
            d.name, d.path, _sha256(d.path, d.name), 0, spec.samples_for(d.name), d.regenerate
        )
        bad: list[InputError] = []
        for p in scan_dataset(d.path, d.name, bad):
            turns = user_turns(p.messages) if d.regenerate else 1
            problem = _unusable(d, p, turns, seen, paths)
            if problem is not None:
                bad.append(problem)
                continue
            why = exclude.get((d.name, p.line))
            if why is not None:
                dp.too_long += 1
                _note_skipped(dp, p.line, why)
                continue
            # only where each prompt lives is kept: memory stays small
            p.messages, p.tools = [], None
            prompts.append(p)
            n_turns.append(turns)
        if skip_bad:
            dp.bad_lines = len(bad)
            for e in sorted(bad, key=lambda e: e.line or 0):
                _note_skipped(dp, e.line or 0, e.reason)
        else:
            errors += bad
        count = len(prompts) - before
        if not count and not bad or not count and skip_bad:
            raise InputError(
                d.path,
                None,
                None,
                f"dataset {d.name!r} has no prompts left: all {dp.skipped_lines:,} "
                "of its lines are skipped; fix them, or remove the dataset from the job",
            )
        dp.prompts, dp.conversations = sum(n_turns[before:]), count if d.regenerate else 0
        datasets.append(dp)
    if errors:
        order = {d.path: i for i, d in enumerate(spec.datasets)}
        errors.sort(key=lambda e: (order.get(e.path, len(order)), e.line or 0))
        raise InputError.many(errors)
    return prompts, n_turns, datasets


def _unusable(
    d: DatasetSpec,
    p: Prompt,
    turns: int,
    seen: dict[str, tuple[str, int]],
    paths: dict[str, str],
) -> InputError | None:
    """Why a prompt line cannot be planned (no user turn to regenerate, an id another line took
    first), else None; its id is taken when it can."""
    if not turns:
        return InputError(
            d.path,
            p.line,
            "messages",
            "has no user message, so no turn to regenerate "
            "([[datasets]] regenerate = true); fix or remove the line, then run again",
        )
    prev = seen.setdefault(p.id, (d.name, p.line))
    if prev != (d.name, p.line):
        return duplicate_id(d.path, p.line, p.id, paths[prev[0]], prev[1])
    return None


def _deal(
    s: int, prompts: list[Prompt], n_turns: list[int], datasets: list[DatasetPlan]
) -> tuple[list[PromptRef], list[ShardPlan]]:
    """The shard layout: prompts dealt round-robin to `s` shards, each shard a contiguous range of
    planned records (every sample and turn of a prompt). PlanError when two records would share an
    id."""
    if s > len(prompts):
        raise PlanError(
            f"{s} shards for {len(prompts)} prompts: lower [sharding] shards to at most "
            f"{len(prompts)}"
        )
    samples = [d.samples for d in datasets]
    index = {d.name: i for i, d in enumerate(datasets)}
    refs: list[PromptRef] = []
    shards: list[ShardPlan] = []
    for k in range(s):
        first = len(refs)
        # The samples of a prompt stay together, in one shard: they share the server's prefix cache.
        for i in range(k, len(prompts), s):
            p, turns = prompts[i], n_turns[i]
            ds = index[p.dataset]
            refs.extend(
                PromptRef(
                    turn_id(sample_id(p.id, j, samples[ds]), t, datasets[ds].regenerate),
                    ds,
                    p.line,
                    p.offset,
                    p.length,
                    j,
                    t,
                    p.digest,
                )
                for j in range(samples[ds])
                for t in range(turns)
            )
        shards.append(ShardPlan(k, first, len(refs) - first))
    # e.g. a prompt id "a#1" beside a prompt "a" with n = 2 samples
    if len({r.id for r in refs}) != len(refs):
        seen: set[str] = set()
        dup = next(r for r in refs if r.id in seen or seen.add(r.id))
        raise PlanError(
            f"record id {dup.id!r} is planned twice: a prompt id collides with a sample (#k) or "
            "turn (/tk) id of another prompt; rename the prompt ids of dataset "
            f"{datasets[dup.dataset].name!r}"
        )
    return refs, shards


def _parts(spec: JobSpec, datasets: list[DatasetPlan], refs: list[PromptRef]) -> dict[str, str]:
    """The fingerprint's parts: a digest of each thing that changes the output (model, tokenizer,
    template, sampling, input files, shard map) and, for the stub, the engine that makes the
    records."""
    m = spec.model
    parts = {
        "model": _digest([m.path, _hash_folder_meta(m.path)]),
        "tokenizer": _digest([m.tokenizer_path, _hash_folder_meta(m.tokenizer_path or m.path)]),
        "template": _digest(
            [
                sha256_file(m.chat_template) if m.chat_template else None,
                m.chat_template_kwargs,
                m.think_start,
                m.think_end,
                m.tool_call_start,
            ]
        ),
        "sampling": _digest([spec.sampling, {d.name: d.sampling for d in spec.datasets}]),
        "inputs": _digest([[d.name, d.sha256] for d in datasets]),
        "shards": _digest([spec.sharding.shards, [r.id for r in refs]]),
    }
    if spec.engine.kind == STUB:  # synthetic records: never a model's run (a model's has no part)
        parts[ENGINE_PART] = STUB
    return parts


def create_run(plan: RunPlan, refs: list[PromptRef], *, new_run: bool = False) -> RunDir:
    """Pin `plan` into its run directory (`find_run`): resume the newest run of the same fingerprint
    in output_dir, else create one. A file system that refuses the folder, or is full, is a
    PlanError in one line, and a run directory it could not finish is removed."""
    root, exists = find_run(plan, new_run=new_run)
    rd = RunDir(root)
    if exists:
        old = Run.open(root, JobSpec, finish=True).plan
        if not old.same_job(plan):  # job.prepare grows the run first (grow.grow_run)
            raise PlanError(
                f"{root} holds this job's run {old.fingerprint} with other prompt files: the job's "
                "new prompts must be taken into it first (grow.grow_run)"
            )
        if root != Path(plan.spec.output_dir):
            log.info(
                "resuming run %s: the newest run of this job in output_dir %s",
                rd.shown,
                plan.spec.output_dir,
            )
        try:
            # the same refs, planned again
            if old.fingerprint == plan.fingerprint and not refs_intact(rd, old):
                log.warning(
                    "%s is damaged: written again from the job's prompt files (the same plan)",
                    rd.prompts_file,
                )
                # in the layout this toolkit writes, with run.json recording it: one change
                prompts = refs_bytes(old, refs)
                change = pending.PendingChange(
                    "prompts.msgpack written again", plan_bytes(old), prompts
                )
                pending.apply(rd, change)
            update_settings(rd, old, plan.spec)
        except OSError as e:
            raise FailedError(io_problem(e, rd.plan_file, "run it again")) from None
        return rd
    plan.spec.output_dir = str(root)
    fresh = not root.exists()
    if rd.plan_file.exists():  # unreadable, in a folder of this job's shard files (_replannable)
        log.warning(
            "%s cannot be read, and every shard file in %s is of this job (%s): the job is "
            "planned into it again; what they hold is kept",
            rd.plan_file,
            root,
            plan.fingerprint,
        )
    try:
        rd.make_dirs()
        atomic_write(rd.prompts_file, refs_bytes(plan, refs))
        atomic_write(rd.plan_file, plan_bytes(plan))
    except OSError as e:
        _unmake(rd, fresh)
        if e.errno in FULL:
            raise FailedError(f"output_dir {root}: {io_problem(e, root, 'run it again')}") from None
        where = e.filename or root
        raise PlanError(
            f"output_dir {root}: cannot create the run directory ({where}: {e.strerror}); point "
            "output_dir at a folder this user can write"
        ) from None
    return rd


def _unmake(rd: RunDir, fresh: bool) -> None:
    """Remove what a run directory that could not be created holds: all of it when this planning
    made its folder, else only what it adds (a folder that held no run may hold other things)."""
    if fresh:
        shutil.rmtree(rd.root, ignore_errors=True)
        return
    rd.prompts_file.unlink(missing_ok=True)
    for sub in rd.writable_dirs()[1:]:
        try:
            sub.rmdir()
        except OSError:
            pass
