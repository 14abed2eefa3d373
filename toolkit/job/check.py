"""Pre-flight: everything `toolkit check`, `run` and `submit` (with or without --dry-run) verify
before any engine starts, in one function so that no command misses a check.

    spec       the TOML, every key and path (spec.load_spec); the engine's extra args; the stub's
               arguments, as the stub itself parses them (engines.stub.stub_args_problem)
    inputs     every line of every prompt file, every id unique (plan.plan_job: all bad lines at
               once)
    tokenizer  loaded as the model loads it; think, tool-call and eos ids (chat.token_info)
    render     EVERY prompt through the chat template, on every core (render_pool), failures named
               by file:line and id; what it learned is kept in the run directory (check_cache), so
               that the same inputs, tokenizer and template are not rendered again by the next
               check, run or submit
    reasoning  where each rendered prompt leaves the model (chat.reasoning_mode), against [model]
               expect_reasoning
    lengths    each prompt plus its dataset's max_new_tokens against the model's context length, as
               SGLang checks
    run dir    output_dir a folder this user can create and write (not under a file, not on a
               read-only file system, not where no file can be made: /proc, /sys; tried with a
               hidden folder, removed); holding another job's run (run and submit refuse it; check
               tells in advance), or runs of this job (the newest is resumed: findrun.find_run)

Problems are collected across all stages that can run and raised as one `PreflightError`; what is
worth knowing but does not stop the run comes back as warnings. Rendered ids are not kept: the
worker renders again on its node. The render, reasoning and length stages are job/promptcheck's;
what the pre-flight found, and its error, job/findings'.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from toolkit.formats.files import shown_path
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan
from toolkit.job.findings import Preflight, PreflightError, plural
from toolkit.job.findrun import find_run
from toolkit.job.grow import grown_plan
from toolkit.job.plan import plan_job
from toolkit.job.promptcheck import check_prompts
from toolkit.job.render_slice import SHOWN
from toolkit.job.schema import JobSpec
from toolkit.job.spec import load_spec
from toolkit.job.specchecks import key_source_warnings
from toolkit.job.specerrors import SpecError

__all__ = ["preflight"]


def sglang_missing(spec: JobSpec) -> str | None:
    """Why SGLang cannot be started here, when the toolkit launches it (`PYTHON -m
    sglang.launch_server`, PYTHON as engines.sglang_python.engine_python chooses it in this
    environment) and that Python has no `sglang`; None when it can (or the engine launches
    otherwise)."""
    from toolkit.engines.base import EngineError
    from toolkit.engines.sglang_python import engine_python, has_sglang

    e = spec.engine
    if e.kind != "sglang" or e.command:
        return None
    env = {**os.environ, **e.env}
    try:
        python, why = engine_python(e.python, env)
    except EngineError as err:
        return str(err)
    if python == sys.executable and importlib.util.find_spec("sglang") is not None:
        return None
    if python != sys.executable and has_sglang(python, env):
        return None
    return (
        f'[engine] kind = "sglang": {python} ({why}) cannot start SGLang (no module named '
        "'sglang'); build the nodes' environment with `bash scripts/node-env.sh VENV` (SGLang and "
        "the toolkit) and start tasks in it (--setup 'source VENV/bin/activate')"
    )


def require_engine_here(spec: JobSpec) -> None:
    """Before a local run: refuse an engine this Python cannot start (nothing is planned or
    written)."""
    why = sglang_missing(spec)
    if why:
        raise PreflightError([why + ", or run the job where SGLang is installed"])


def preflight(
    job: str | os.PathLike,
    *,
    check_tokenizer: bool = True,
    warn_other_run: bool = True,
    exact: bool = False,
) -> Preflight:
    """Load, plan and verify `job` completely; raise SpecError / InputError / PlanError / ChatError
    (a stage that cannot go on) or PreflightError (every problem of the render, reasoning and length
    checks).

    Every prompt is rendered. Encoding the text is most of the cost, so a prompt whose UTF-8 length
    already fits the context with room to spare is not encoded whole: only its tail is, for its last
    tokens (`exact` encodes every prompt whole; the answers are the same)."""
    spec = load_spec(job)  # also judges [engine] extra_args as SGLang's parser would
    check_output_dir(spec.output_dir, job)
    plan, refs = plan_job(spec)
    pf = Preflight(spec, plan, refs)
    _check_stub_args(spec, job)
    missing = sglang_missing(spec)
    if missing:  # a login node that only submits needs none: the GPU nodes' Python must have it
        pf.warnings.append(
            f"{missing}. A login node that only submits needs none; the Slurm tasks start SGLang "
            "with [engine] python when the job names one, else with the first python3 on their "
            "PATH (after [slurm] setup, e.g. 'source ~/venvs/sglang/bin/activate') that has "
            "sglang, else with this same Python: one of those needs it"
        )
    if check_tokenizer:
        check_prompts(pf, job, exact)
        if pf.too_long:  # [inputs] on_too_long = "skip": planned again without them
            pf.plan, pf.refs = plan_job(spec, exclude=pf.too_long)
    pf.warnings += skipped_warnings(pf.plan) + key_source_warnings(spec.engine)
    if warn_other_run:
        _check_run_dir(pf)
    return pf


def _check_stub_args(spec: JobSpec, job: Any) -> None:
    """The stub engine's arguments, refused here as the stub would refuse them when it starts."""
    from toolkit.engines.stub import stub_args_problem

    why = stub_args_problem(spec) if spec.engine.kind == "stub" else None
    if why:
        raise SpecError(f"{job}: {why}")


def skipped_warnings(plan: RunPlan) -> list[str]:
    """What the plan left out ([inputs] on_bad_line / on_too_long = "skip"), per prompt file:
    counted, the first lines named with why."""
    out = []
    for d in plan.datasets:
        if not d.skipped_lines:
            continue
        kinds = [
            f'{n:,} {what} ([inputs] {key} = "skip")'
            for n, what, key in (
                (d.bad_lines, "bad", "on_bad_line"),
                (d.too_long, "too long", "on_too_long"),
            )
            if n
        ]
        shown = "; ".join(f"{d.path}:{s.line}: {s.reason}" for s in d.skipped[:SHOWN])
        more = f" (and {d.skipped_lines - SHOWN:,} more)" if d.skipped_lines > SHOWN else ""
        out.append(
            f"skipped {d.skipped_lines:,} line{plural(d.skipped_lines)} of dataset {d.name!r}, "
            f"{' and '.join(kinds)}: {shown}{more}"
        )
    return out


# --------------------------------------------------------------------------------------------------
# run directory
# --------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, job: Any) -> None:
    """PlanError when the run directory could not be made there: a file in the way, a folder this
    user cannot write (permissions, a read-only file system), or a place that cannot hold files at
    all (/proc, /sys: where even root's write access says nothing). What is checked is tried: a
    hidden folder with a file in it is made in the nearest existing part of the path, then removed;
    nothing is left."""
    root = Path(output_dir)
    p = root
    while not (p.exists() or p.is_symlink()) and p.parent != p:
        p = p.parent  # the nearest part of the path that exists: the run directory is made below it
    problem = None
    if not p.is_dir():
        problem = f"{p} is a file, not a folder"
    elif not os.access(p, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
        problem = (
            f"{p} is on a read-only file system"
            if read_only
            else f"{p} is not writable by this user"
        )
    elif p == root and RunDir.is_run(root):
        unwritable = [
            d
            for d in RunDir(root).writable_dirs()
            if d.exists() and not os.access(d, os.W_OK | os.X_OK)
        ]
        if unwritable:
            problem = f"{unwritable[0]} is not writable by this user"
    if problem is None:
        problem = _cannot_hold_files(p)
    if problem:
        raise PlanError(
            f"{job}: output_dir {root}: {problem}, so the run directory cannot be written there; "
            "point output_dir at a folder this user can write"
        )


def _cannot_hold_files(folder: Path) -> str | None:
    """Why `folder` cannot hold a run's files, found by making a hidden folder and a file in it
    (then removed); None when it can."""
    import shutil
    import tempfile

    try:
        probe = Path(tempfile.mkdtemp(prefix=".toolkit-check-", dir=folder))
    except OSError as e:
        return f"a folder cannot be made in {folder} ({e.strerror or e})"
    try:
        with open(probe / "probe", "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"a file cannot be written in {folder} ({e.strerror or e})"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def _check_run_dir(pf: Preflight) -> None:
    try:
        root, exists = find_run(pf.plan)
    except PlanError as e:
        pf.warnings.append(f"{e} (`toolkit run` and `submit` will refuse it)")
        return
    if not exists:
        return
    run = Run.open(root, JobSpec, finish=True).plan
    if run.same_job(pf.plan):
        pf.notes.append(
            f"run directory: {shown_path(root)} holds this run already; `toolkit run`/`submit` "
            "resume it"
        )
        return
    try:
        grown, _, diff = grown_plan(RunDir(root), run, pf.plan, pf.refs)
    except PlanError as e:
        pf.warnings.append(f"{e} (`toolkit run` and `submit` will refuse it)")
        return
    added = len(grown.shards) - len(run.shards)
    if diff.legacy:
        pf.notes.append(
            f"run directory: {shown_path(root)} holds this run, planned with ids from line numbers "
            "(kept); `toolkit run`/`submit` resume it"
        )
    elif added:
        g = grown.grown[-1]
        pf.notes.append(
            f"run directory: {shown_path(root)} holds this job's run; `toolkit run`/`submit` add "
            f"its {g.prompts:,} new prompt{plural(g.prompts)} ({g.records:,} records) in {added} "
            f"new shard{plural(added)} and generate only those"
        )
    else:
        pf.notes.append(
            f"run directory: {shown_path(root)} holds this run already (its prompt files changed, "
            "not its prompts); `toolkit run`/`submit` resume it"
        )
