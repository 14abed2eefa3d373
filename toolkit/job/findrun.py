"""Which run directory a job's run is in, and why a job cannot go into one.

Several runs in one output_dir: `--new-run` puts a new run beside output_dir, as
`<output_dir>.<time>`. `find_run` says where a job's run is: the newest run of the same fingerprint
among output_dir and those beside it (resumed, with or without --new-run: the same job is never
generated twice), else output_dir when it holds no run, else a new `<output_dir>.<time>` with
--new-run; without it, a job whose output_dir holds another job's run is refused, saying how the
two jobs differ (`differences`). The same job with other prompt files (`may_grow`) goes into its
run, which grow.py plans again.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import msgspec

from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import ENGINE_PART, REPLAN, PlanError, RunPlan
from toolkit.formats.text import file_stamp
from toolkit.job.schema import JobSpec
from toolkit.job.spec import load_spec

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
