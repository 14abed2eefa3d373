"""The start that `run`, `check` and `submit` share: the pre-flight of a job (spec, every prompt
line, tokenizer, every prompt rendered, reasoning, lengths), then its run directory pinned (not with
`dry_run`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan
from toolkit.job import check_cache
from toolkit.job.check import preflight, require_engine_here
from toolkit.job.findings import Preflight
from toolkit.job.findrun import find_run
from toolkit.job.grow import grow_run, grown_plan
from toolkit.job.plan import create_run
from toolkit.job.schema import JobSpec

__all__ = ["PreparedRun", "prepare_run"]


@dataclass(frozen=True)
class PreparedRun:
    """A job that passed the pre-flight, and its run directory (created unless prepared with
    `dry_run`)."""

    preflight: Preflight
    run_dir: RunDir
    created: bool  # False with dry_run: `run_dir` is where the run would be, nothing was
    # written
    validated: Any = None  # what the caller's `validate` returned
    # the plan the run holds (or would hold, with dry_run); None: the job's own
    run_plan: RunPlan | None = None

    @property
    def plan(self) -> RunPlan:
        """The run's plan: the job's own for a new run, else the run's as pinned (grown by the job's
        new prompts)."""
        return self.run_plan or self.preflight.plan

    @property
    def spec(self) -> JobSpec:
        return self.preflight.spec


def prepare_run(
    job: str | os.PathLike,
    *,
    new_run: bool = False,
    dry_run: bool = False,
    check_tokenizer: bool = True,
    validate: Callable[[RunPlan, RunDir], Any] | None = None,
    print_warnings: bool = True,
    as_submitted: bool = False,
    local: bool = False,
    allow_changed: bool = False,
    keep_learned: bool = True,
) -> PreparedRun:
    """The pre-flight of `job`, then `validate(plan, run_dir)` (e.g. the resources against the
    cluster; `run_dir` is where the run is or would go: plan.find_run), then its run directory
    created or resumed (the newest run of this job in output_dir; a new one beside it with `new_run`
    when output_dir holds another job's run). Every refusal comes before anything is written.

    With `dry_run` no run is written (only what the pre-flight learned, see below), and another
    job's run in output_dir is a warning (creating the run refuses it), unless `as_submitted`
    (submit's dry run refuses what submit refuses). With `local` (the shards run here), an engine
    this Python cannot start is refused. A run of this job whose prompt files changed takes the
    job's new prompts (job.grow; with `allow_changed`, prompts whose content changed are generated
    again). Raises the pre-flight's errors (ToolkitError, exit 2) and whatever `validate` raises.

    What the pre-flight learned rendering the prompts is kept in the run directory once nothing
    refuses the job (check_cache); with `dry_run` too (unless not `keep_learned`: a dry run of
    submit writes nothing), in output_dir (made if need be) or the run of this job found beside it,
    never in another job's run."""
    pf = preflight(
        job, check_tokenizer=check_tokenizer, warn_other_run=dry_run and not as_submitted
    )
    if local:  # run here: the engine must start here
        require_engine_here(pf.spec)
    if print_warnings:
        pf.print_warnings()
    run, ours = None, True
    try:
        root, exists = find_run(pf.plan, new_run=new_run)
        run = Run.open(root, JobSpec, finish=True).plan if exists else None
        grows = run is not None and not run.same_job(pf.plan)
        grown = (
            grown_plan(RunDir(root), run, pf.plan, pf.refs, allow_changed=allow_changed)
            if grows
            else None
        )
        target = pf.plan if run is None else grown[0] if grown else run
    except PlanError:
        if not dry_run or as_submitted:
            raise
        # `check`: warned already
        root, target, grows, grown = Path(pf.spec.output_dir), pf.plan, False, None
        ours = False
    validated = validate(target, RunDir(root)) if validate is not None else None
    if dry_run:
        if not (root == Path(pf.spec.output_dir) or RunDir.is_run(root)):
            # a new run beside output_dir (--new-run) is not made by a dry run, not even for this
            ours = False
        # where the run is or goes, never in another job's
        if pf.learned is not None and ours and keep_learned:
            check_cache.save(RunDir(root).check_file, pf.learned)
        return PreparedRun(pf, RunDir(root), created=False, validated=validated, run_plan=target)
    if grows:  # the job's new prompts, into its run
        grow_run(RunDir(root), run, pf.plan, pf.refs, allow_changed=allow_changed, computed=grown)
    rd = create_run(pf.plan, pf.refs, new_run=new_run)
    if pf.learned is not None:
        check_cache.save(rd.check_file, pf.learned)
    return PreparedRun(
        pf,
        rd,
        created=True,
        validated=validated,
        run_plan=Run.open(rd.root, JobSpec, finish=True).plan,
    )
