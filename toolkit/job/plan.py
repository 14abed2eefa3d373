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

Several runs in one output_dir: `--new-run` puts a new run beside output_dir, as
`<output_dir>.<time>`. `find_run` says where a job's run is: the newest run of the same fingerprint
among output_dir and those beside it (resumed, with or without --new-run: the same job is never
generated twice), else output_dir when it holds no run, else a new `<output_dir>.<time>` with
--new-run; without it, a job whose output_dir holds another job's run is refused.

The run directory's layout is in `formats.rundir`; what run.json holds in `formats.runplan`, what
prompts.msgpack holds and its one reader in `formats.prompts`, and a run opened in `formats.run`:
planning uses them for every read and write of those files.

Shard k owns a contiguous range of planned positions; planned positions are dealt round-robin from
the input order, so every shard gets a similar mix of datasets and prompt lengths.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
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
    REPLAN,
    STUB,
    DatasetPlan,
    PlanError,
    RunPlan,
    ShardPlan,
    SkippedLine,
    fingerprint_of,
    plan_bytes,
)
from toolkit.formats.text import file_stamp, utc_now
from toolkit.job.inputs import InputError, Prompt, duplicate_id, scan_dataset, source_errors
from toolkit.job.sources import source_sha256
from toolkit.job.spec import JobSpec, load_spec
from toolkit.job.turns import turn_id, user_turns

log = logging.getLogger(__name__)

__all__ = [
    "sample_id",
    "plan_job",
    "create_run",
    "find_run",
    "run_of_job",
    "update_settings",
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
    exclude = exclude or {}
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
            if not turns:
                bad.append(
                    InputError(
                        d.path,
                        p.line,
                        "messages",
                        "has no user message, so no turn to regenerate "
                        "([[datasets]] regenerate = true); fix or remove the line, then run again",
                    )
                )
                continue
            prev = seen.setdefault(p.id, (d.name, p.line))
            if prev != (d.name, p.line):
                bad.append(duplicate_id(d.path, p.line, p.id, paths[prev[0]], prev[1]))
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
    s = spec.sharding.shards
    if s > len(prompts):
        raise PlanError(
            f"{s} shards for {len(prompts)} prompts: lower [sharding] shards to at most "
            f"{len(prompts)}"
        )
    index = {d.name: i for i, d in enumerate(spec.datasets)}
    samples = [d.samples for d in datasets]
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
    n = len(refs)
    # e.g. a prompt id "a#1" beside a prompt "a" with n = 2 samples
    if len({r.id for r in refs}) != n:
        seen: set[str] = set()
        dup = next(r for r in refs if r.id in seen or seen.add(r.id))
        raise PlanError(
            f"record id {dup.id!r} is planned twice: a prompt id collides with a sample (#k) or "
            "turn (/tk) id of another prompt; rename the prompt ids of dataset "
            f"{datasets[dup.dataset].name!r}"
        )
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
        "shards": _digest([s, [r.id for r in refs]]),
    }
    if spec.engine.kind == STUB:  # synthetic records: never a model's run (a model's has no part)
        parts[ENGINE_PART] = STUB
    fingerprint = fingerprint_of(parts)
    plan = RunPlan(
        format=PLAN_FORMAT,
        name=spec.name,
        fingerprint=fingerprint,
        parts=parts,
        created=utc_now(),
        total=n,
        spec=spec,
        datasets=datasets,
        shards=shards,
    )
    return plan, refs


# the suffix --new-run gives a run beside output_dir
_STAMPED = re.compile(r"\.\d{8}-\d{6}(?:-\d+)?")


def runs_in(output_dir: str | os.PathLike) -> list[tuple[Path, RunPlan | None]]:
    """The run directories of an output_dir, oldest first: output_dir itself and the
    `<output_dir>.<time>` runs --new-run made beside it, each with its plan (None: unreadable)."""
    root = Path(output_dir)
    found = []
    beside = sorted(root.parent.glob(f"{glob.escape(root.name)}.*")) if root.parent.is_dir() else []
    for path in [root, *beside]:
        if (path == root or _STAMPED.fullmatch(path.name[len(root.name) :])) and RunDir.is_run(
            path
        ):
            try:
                found.append((path, Run.open(path, JobSpec).plan))
            except PlanError:
                found.append((path, None))
    return sorted(found, key=lambda x: (x[1].created if x[1] else "", x[0] != root, x[0].name))


def run_of_job(job: str | os.PathLike) -> Path:
    """The run directory a job file stands for where a command wants a run: the newest run of that
    job (by name) in its output_dir (and the runs --new-run made beside it). PlanError when it has
    none yet."""
    spec = load_spec(job, check_paths=False)
    runs = runs_in(spec.output_dir)
    mine = [path for path, p in runs if p is not None and p.name == spec.name]
    if not mine:
        others = f" (it holds {len(runs)} run(s) of other jobs)" if runs else ""
        raise PlanError(
            f"{job}: job {spec.name!r} has no run in its output_dir {spec.output_dir} yet{others}; "
            f"`toolkit run {job}` or `toolkit submit {job}` makes one"
        )
    return mine[-1]


def find_run(plan: RunPlan, *, new_run: bool = False) -> tuple[Path, bool]:
    """(where the run of `plan` is or goes, whether it exists already): see the module's docstring.
    PlanError when output_dir holds another job's run and no new run is asked for."""
    root = Path(plan.spec.output_dir)
    runs = runs_in(root)
    same = [path for path, p in runs if p is not None and p.same_job(plan)]
    if same:
        return same[-1], True
    kin = [path for path, p in runs if p is not None and may_grow(p, plan)]
    # the same job with other prompt files: planned again into its run (grow.py)
    if kin and not new_run:
        return kin[-1], True
    if not RunDir.is_run(root):
        return root, False
    if _replannable(root, plan):
        return root, False
    if new_run:
        path, n = root.with_name(f"{root.name}.{file_stamp()}"), 1
        while path.exists():
            n += 1
            path = root.with_name(f"{root.name}.{file_stamp()}-{n}")
        return path, False
    try:
        old = Run.open(root, JobSpec).plan
    except PlanError as e:
        why = str(e).split(f"; {REPLAN}")[0]
        raise PlanError(
            f"{root} holds a run directory that cannot be read ({why}), and its shard files are "
            "not of "
            f"this job ({plan.fingerprint}): planning it there again would not recover it; point "
            "`output_dir` elsewhere, or pass --new-run to start a new run directory beside it"
        ) from None
    others = (
        f" (and {len(runs) - 1} other run(s) beside it, none of this job)" if len(runs) > 1 else ""
    )
    if old.synthetic != plan.synthetic:
        raise PlanError(_maker_refusal(root, old, plan) + others)
    raise PlanError(
        f"output_dir {root} holds another run, {old.fingerprint} of job {old.name!r}{others}, but "
        f"this job gives {plan.fingerprint} (differs in: {differences(old, plan)}). Its records "
        "would not match: restore the job as it was, point `output_dir` elsewhere, or pass "
        "--new-run to start a new run directory beside it."
    )


def _maker_refusal(root: Path, old: RunPlan, plan: RunPlan) -> str:
    """Why a job cannot go into a run whose records another kind of engine made (the stub, or a
    model), and the command that starts its own run."""
    kind = plan.spec.engine.kind
    if old.synthetic:
        why = (
            "its records are the stub's synthetic text, and a model's run never takes or "
            "continues them"
        )
    else:
        why = "the stub's synthetic records never go into a model's run"
    other = _differences(old, plan)[1:]  # the first says the engine
    also = f"; the job also differs in: {', '.join(other)}" if other else ""
    return (
        f"output_dir {root} holds run {old.fingerprint} of job {old.name!r}, generated by "
        f'{old.made_by}, but this job\'s [engine] kind = "{kind}" is '
        f"{'the stub' if plan.synthetic else 'a model'}: {why}{also}. Pass --new-run to start "
        "this job's own run in a new run directory beside it, or point `output_dir` elsewhere"
    )


# What a job may change and still be planned again into its run (grow.py): its prompt files (and
# datasets, whose sampling is compared one by one), hence its shard map.
GROWABLE_PARTS = ("inputs", "shards", "sampling")


def may_grow(run: RunPlan, plan: RunPlan) -> bool:
    """Whether `plan` is the job `run` holds with other prompt files only: same name, model,
    tokenizer, template, shard count, sampling, and the same settings for each dataset the run has
    (a dataset may be added). Whether the prompts it had are all still there, unchanged, is
    grow.py's to say."""
    old, new = run.spec, plan.spec
    theirs = {d.name: d for d in new.datasets}
    return (
        run.name == plan.name
        and run.synthetic == plan.synthetic
        and old.sharding.shards == new.sharding.shards
        and old.sampling == new.sampling
        and all(
            d.name in theirs
            and (d.sampling, d.regenerate) == (theirs[d.name].sampling, theirs[d.name].regenerate)
            for d in old.datasets
        )
        and all(
            run.parts.get(k) == v
            for k, v in plan.parts.items()
            if k not in GROWABLE_PARTS and k != ENGINE_PART
        )
    )


def _keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two tables, `key: old -> new`."""
    return [
        f"{prefix}{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def differences(run: RunPlan, plan: RunPlan) -> str:
    """What differs between a run's plan and a job's, part by part, down to the keys and files:
    `sampling (max_new_tokens: 64 -> 65); inputs (data/math.jsonl: sha256 3f1a.. -> 9c2e..)`."""
    return ", ".join(_differences(run, plan)) or "format"


def _differences(run: RunPlan, plan: RunPlan) -> list[str]:
    """`differences`, one item a part; the engine's first (the stub's run or a model's)."""
    said = []
    if run.synthetic != plan.synthetic:
        said.append(
            f"{ENGINE_PART} ([engine] kind: {run.spec.engine.kind!r} -> {plan.spec.engine.kind!r})"
        )
    differ = (k for k in plan.parts if k != ENGINE_PART and run.parts.get(k) != plan.parts[k])
    for part in sorted(differ):
        detail: list[str] = []
        old, new = run.spec, plan.spec
        if part == "sampling":
            detail = _keys(old.sampling, new.sampling)
            ds_old = {d.name: d.sampling for d in old.datasets}
            for d in new.datasets:
                detail += _keys(ds_old.get(d.name, {}), d.sampling, f"[[datasets]] {d.name!r} ")
        elif part in ("model", "tokenizer", "template"):
            detail = _keys(msgspec.to_builtins(old.model), msgspec.to_builtins(new.model))
            if not detail:
                detail = [f"the files of {old.model.tokenizer_path or old.model.path}"]
        elif part == "inputs":
            was = {d.name: d for d in run.datasets}
            now = {d.name: d for d in plan.datasets}
            detail = [f"dataset {n!r} removed" for n in was if n not in now]
            detail += [f"dataset {n!r} added" for n in now if n not in was]
            detail += [
                f"{d.path}: sha256 {was[n].sha256[:12]} -> {d.sha256[:12]}"
                for n, d in now.items()
                if n in was and was[n].sha256 != d.sha256
            ]
        elif part == "shards" and old.sharding.shards != new.sharding.shards:
            detail = [f"[sharding] shards: {old.sharding.shards} -> {new.sharding.shards}"]
        said.append(part + (f" ({'; '.join(detail)})" if detail else ""))
    return said


def _replannable(root: Path, plan: RunPlan) -> bool:
    """Whether `root` holds a run whose run.json cannot be read but whose shard files (headers) and
    done manifests all carry `plan`'s fingerprint: the run of this very job, which planning it again
    recovers."""
    from toolkit.formats.frames import CorruptShard, read_header

    rd = RunDir(root)
    try:
        Run.open(root, JobSpec)
        return False
    except PlanError:
        pass
    try:
        for path in rd.shards_dir.glob("*.zst"):
            head = read_header(path)
            if head is not None and head[0] != plan.fingerprint:
                return False
        for path in rd.shards_dir.glob("*.done"):
            if plan.fingerprint not in path.read_text(errors="replace"):
                return False
    except (OSError, CorruptShard):
        return False
    return True


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


# Tables of a job that say how to run it, not what it makes: a run takes new values from the job
# when it is planned again (`toolkit run`, `toolkit submit` on the same job), and the change is
# logged. Everything in the fingerprint (model, template, sampling, inputs, shards) stays pinned.
SETTINGS_TABLES = ("engine", "client", "slurm", "audit", "estimate")
SETTINGS_KEYS = {"sharding": ("flush_records", "flush_seconds")}
# [engine] keys whose change may change how outputs are made (not only how the engine is run):
# warned about.
ENGINE_OUTPUT_KEYS = ("kind", "tp_size", "dp_size", "extra_args", "command", "url", "stub")


def settings_changes(old: JobSpec, new: JobSpec) -> list[tuple[str, Any, Any]]:
    """(table.key, old value, new value) of every run setting that differs between two specs."""
    changes = []
    keys = [(t, None) for t in SETTINGS_TABLES] + [
        (t, k) for t, ks in SETTINGS_KEYS.items() for k in ks
    ]
    for table, only in keys:
        a, b = msgspec.to_builtins(getattr(old, table)), msgspec.to_builtins(getattr(new, table))
        for key in sorted(set(a) | set(b)):
            if (only is None or key == only) and a.get(key) != b.get(key):
                changes.append((f"{table}.{key}", a.get(key), b.get(key)))
    return changes


def update_settings(rd: RunDir, old: RunPlan, spec: JobSpec) -> list[tuple[str, Any, Any]]:
    """Take the job's run settings into an existing run (same fingerprint), log each change, rewrite
    run.json."""
    changes = settings_changes(old.spec, spec)
    if not changes:
        return changes
    for table in SETTINGS_TABLES:
        setattr(old.spec, table, getattr(spec, table))
    for table, ks in SETTINGS_KEYS.items():
        for k in ks:
            setattr(getattr(old.spec, table), k, getattr(getattr(spec, table), k))
    atomic_write(rd.plan_file, plan_bytes(old))
    for key, a, b in changes:
        log.info("run %s: setting %s changed from %r to %r", rd.shown, key, a, b)
        if key.split(".")[0] == "engine" and key.split(".")[1] in ENGINE_OUTPUT_KEYS:
            log.warning(
                "run %s: %s changed: records written before and after were made by differently "
                "configured engines",
                rd.shown,
                key,
            )
    return changes
