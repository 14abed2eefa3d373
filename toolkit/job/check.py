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
               tells in advance), or runs of this job (the newest is resumed: plan.find_run)

Problems are collected across all stages that can run and raised as one `PreflightError`; what is
worth knowing but does not stop the run comes back as warnings. Rendered ids are not kept: the
worker renders again on its node.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import BadInputError
from toolkit.formats.files import shown_path
from toolkit.formats.prompts import PromptRef
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan
from toolkit.job import chat, check_cache, render_pool
from toolkit.job.grow import grown_plan
from toolkit.job.plan import find_run, plan_job
from toolkit.job.render_pool import SCHEDULER_MARGIN, SHOWN, Outcome, Places
from toolkit.job.spec import JobSpec, key_source_warnings, load_spec
from toolkit.job.specerrors import SpecError

__all__ = ["PreflightError", "Preflight", "preflight", "context_length", "SHOWN"]

# tokenizer_config model_max_length of a tokenizer without a limit (transformers' 1e30 sentinel)
UNBOUNDED = 10**9

MODE_WORDS = {
    chat.OPENED: "opened by the template",
    chat.CLOSED: "closed by the template",
    chat.MODEL_OPENS: "left for the model to open",
    chat.UNKNOWN: "unknown (the template never mentions the think tokens)",
}


class PreflightError(BadInputError):
    """A job that must not start: one or more problems, each naming what to change."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems:\n" + "\n".join(f"- {p}" for p in problems)
        )


@dataclass
class Preflight:
    spec: JobSpec
    plan: RunPlan
    refs: list[PromptRef]
    info: chat.TokenInfo | None = None
    modes: dict[str, int] = field(default_factory=dict)  # reasoning mode -> prompts
    context: int | None = None
    context_source: str = ""
    # (prompt + max_new_tokens, dataset) of the tightest prompt
    longest: tuple[int, str] | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what the render stage learned (prepare_run keeps it)
    learned: check_cache.CheckCache | None = None
    # on_too_long = "skip": (dataset, line) -> why
    too_long: dict[tuple[str, int], str] = field(default_factory=dict)

    def summary(self) -> list[str]:
        """What `check` prints after its ok line."""
        lines = []
        if self.modes:
            lines.append(
                "reasoning: "
                + ", ".join(f"{n:,} {MODE_WORDS[m]}" for m, n in self.modes.items() if n)
                + f" (expect_reasoning = {str(self.spec.model.expect_reasoning).lower()})"
            )
        if self.context is not None and self.longest is not None:
            total, ds = self.longest
            lines.append(
                f"lengths: every prompt + max_new_tokens fits the context length {self.context:,} "
                f"({self.context_source}); the longest prompt + its max_new_tokens at most "
                f"{total:,} tokens (dataset {ds!r}; prompts far from the limit are bounded by "
                "their UTF-8 length)"
            )
        return lines + self.notes

    def print_warnings(self, file=None) -> None:
        for w in self.warnings:
            print(f"toolkit: warning: {w}", file=file or sys.stderr)


def sglang_missing(spec: JobSpec) -> str | None:
    """Why SGLang cannot be started here, when the toolkit launches it (`PYTHON -m
    sglang.launch_server`, PYTHON as engines.sglang.engine_python chooses it in this environment)
    and that Python has no `sglang`; None when it can (or the engine launches otherwise)."""
    from toolkit.engines.base import EngineError
    from toolkit.engines.sglang import engine_python, has_sglang

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
        _check_prompts(pf, job, exact)
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
            f"skipped {d.skipped_lines:,} line{_s(d.skipped_lines)} of dataset {d.name!r}, "
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
            f"its {g.prompts:,} new prompt{_s(g.prompts)} ({g.records:,} records) in {added} new "
            f"shard{_s(added)} and generate only those"
        )
    else:
        pf.notes.append(
            f"run directory: {shown_path(root)} holds this run already (its prompt files changed, "
            "not its prompts); `toolkit run`/`submit` resume it"
        )


# --------------------------------------------------------------------------------------------------
# render, reasoning, lengths
# --------------------------------------------------------------------------------------------------
def _check_prompts(pf: Preflight, job: Any, exact: bool = False) -> None:
    spec, m = pf.spec, pf.spec.model
    ctx, source, truncate = context_length(spec, job)
    pf.context, pf.context_source = ctx, source
    if ctx is None:
        pf.warnings.append(
            f"{source}: prompt lengths are not checked against it; set --context-length in "
            "[engine] extra_args to have them checked"
        )
    key = check_cache.render_key(pf.plan, ctx, source, truncate, exact)
    cached = check_cache.load(RunDir(_run_root(pf.plan)).check_file, key)
    mnts = [spec.sampling_for(d.name)["max_new_tokens"] for d in spec.datasets]
    keys = [check_cache.dataset_key(dp, mnt) for dp, mnt in zip(pf.plan.datasets, mnts)]
    outcomes: list[Outcome | None] = [cached.outcomes.get(k) if cached else None for k in keys]
    todo = [i for i, o in enumerate(outcomes) if o is None]
    if cached is not None:
        # the same tokenizer, template and model files: the same ids, checked before
        pf.info = cached.info
    if todo:
        tok = chat.load_tokenizer(m)
        if pf.info is None:
            pf.info = chat.token_info(tok, m)
            chat.check_model_vocab(tok, pf.info, m)
        _measure_datasets(pf, tok, todo, outcomes, mnts, exact)
        pf.learned = check_cache.CheckCache(
            check_cache.FORMAT, pf.plan.fingerprint, key, pf.info, dict(zip(keys, outcomes))
        )
    _judge(pf, job, [o for o in outcomes if o is not None], truncate)


def _run_root(plan: RunPlan) -> Path:
    """Where the run of `plan` is or would go (output_dir when another job's run is there)."""
    try:
        return find_run(plan)[0]
    except PlanError:
        return Path(plan.spec.output_dir)


def _measure_datasets(
    pf: Preflight,
    tok: Any,
    todo: list[int],
    outcomes: list[Outcome | None],
    mnts: list[int],
    exact: bool,
) -> None:
    """Render and measure every prompt of the datasets `todo` (positions in the job), on all
    cores."""
    spec, m = pf.spec, pf.spec.model
    bounded, anchored = (None, False) if exact else render_pool.bound_kind(tok, m)
    setting = render_pool.Setting(
        m,
        pf.info,
        pf.context,
        bounded,
        anchored,
        skip_bad=spec.inputs.on_bad_line == "skip",
        skip_long=spec.inputs.on_too_long == "skip",
    )
    work = [
        render_pool.Slice(i, d.path, d.name, d.regenerate, mnts[i], *piece)
        for i in todo
        for d in [spec.datasets[i]]
        for piece in render_pool.slices(d.path)
    ]
    total = sum(
        pf.plan.datasets[i].conversations
        if spec.datasets[i].regenerate
        else pf.plan.datasets[i].prompts
        for i in todo
    )
    for i in todo:
        outcomes[i] = Outcome(modes={mode: 0 for mode in chat.MODES})
    for s, outcome in zip(work, render_pool.measure(tok, setting, work, total=total)):
        outcomes[s.dataset].merge(outcome)


def _judge(pf: Preflight, job: Any, outcomes: list[Outcome], truncate: bool) -> None:
    """The problems and warnings of the measured datasets (in the job's order)."""
    spec, m, ctx, source = pf.spec, pf.spec.model, pf.context, pf.context_source
    failed = Places()
    modes = {mode: 0 for mode in chat.MODES}
    # dataset -> prompts whose reasoning mode goes against expect_reasoning
    refused: dict[str, Places] = {}
    # expect_reasoning = false: prompts the model may open reasoning for
    model_opens: dict[str, Places] = {}
    too_long: dict[str, Places] = {}  # refused by SGLang (or truncated, with --allow-auto-truncate)
    # accepted, but the scheduler lowers max_new_tokens by a token or two
    clamped: dict[str, Places] = {}
    tightest = None
    for d, o in zip(spec.datasets, outcomes):
        failed.merge(o.failed)
        for mode, n in o.modes.items():
            modes[mode] += n
        for table, places in (
            (refused, o.refused),
            (model_opens, o.model_opens),
            (too_long, o.too_long),
            (clamped, o.clamped),
        ):
            if places.count:
                table[d.name] = places
        if o.longest and (tightest is None or o.longest > tightest[0]):
            tightest = (o.longest, d.name)
        # [inputs] on_too_long = "skip": the plan leaves them out (preflight)
        for line, why in o.skipped_long:
            pf.too_long[(d.name, line)] = why
    pf.modes, pf.longest = modes, tightest
    problems: list[str] = []
    if failed.count:
        problems.append(
            f"the chat template fails on {failed.count:,} prompt{_s(failed.count)}: "
            + "; ".join(failed.first)
            + _more(failed)
            + "; fix these prompts' messages/tools or the [model] chat template"
        )
    info = pf.info
    hint_on, hint_off = chat.thinking_hint(info, True), chat.thinking_hint(info, False)
    if refused and m.expect_reasoning:
        problems.append(
            f"the chat template closes reasoning (the prompt ends with {m.think_end!r}) in "
            f"{_counted(refused)}: the model would answer without reasoning, but [model] "
            f"expect_reasoning = true: {hint_on}, or set expect_reasoning = false for data without "
            "reasoning"
        )
    if refused and not m.expect_reasoning:
        problems.append(
            f"the chat template opens reasoning (the prompt ends with {m.think_start!r}) in "
            f"{_counted(refused)}, but [model] expect_reasoning = false: {hint_off}, or set "
            "expect_reasoning = true for reasoning data"
        )
    if model_opens:
        pf.warnings.append(
            f"{_counted(model_opens)} end at the assistant turn of a template that knows the think "
            "tokens: the model may open reasoning itself although expect_reasoning = false (the "
            f"audit checks the outputs). To switch thinking off: {hint_off}"
        )
    if m.expect_reasoning and modes[chat.UNKNOWN]:
        pf.warnings.append(
            f"the chat template never mentions the think tokens {m.think_start!r} / "
            f"{m.think_end!r}: cannot tell whether its {modes[chat.UNKNOWN]:,} prompts leave the "
            "model reasoning; check [model] think_start / think_end and chat_template (the audit "
            "checks the outputs)"
        )
    if too_long and truncate:
        pf.warnings.append(
            f"{_counted(too_long)} do not fit the context length {ctx:,} ({source}) with their "
            "dataset's max_new_tokens; with --allow-auto-truncate SGLang cuts the prompt or "
            "lowers max_new_tokens: those records would not hold what the model saw, or get "
            "shorter outputs"
        )
    elif too_long:
        problems.append(
            f"{_counted(too_long, mnt_of=spec)} do not fit the context length {ctx:,} ({source}) "
            "with their dataset's "
            "max_new_tokens: SGLang refuses a prompt whose length plus max_new_tokens exceeds it "
            "(or that reaches "
            f"context length - {SCHEDULER_MARGIN}). Raise the context length (--context-length in "
            "[engine] extra_args, "
            "if the model supports it), lower max_new_tokens for that dataset ([[datasets]] "
            "sampling), drop the lines, or "
            'skip them, each reported ([inputs] on_too_long = "skip")'
        )
    if clamped:
        pf.warnings.append(
            f"{_counted(clamped)} leave less than max_new_tokens room in the context length "
            f"{ctx:,}: SGLang's scheduler lowers their max_new_tokens by a token or two"
        )
    if problems:
        raise PreflightError([f"{job}: {p}" for p in problems])


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _more(places: Places) -> str:
    return (
        f" (and {places.count - len(places.first):,} more)"
        if places.count > len(places.first)
        else ""
    )


def _counted(by_dataset: dict[str, Places], *, mnt_of: JobSpec | None = None) -> str:
    """'14 prompts (math: 12, e.g. a.jsonl:3, a.jsonl:9 ...; chat: 2, e.g. ...)'."""
    total = sum(p.count for p in by_dataset.values())
    parts = []
    for name, places in by_dataset.items():
        mnt = (
            f" with max_new_tokens {mnt_of.sampling_for(name)['max_new_tokens']:,}"
            if mnt_of is not None
            else ""
        )
        parts.append(
            f"{name}: {places.count:,}{mnt}, e.g. {', '.join(places.first)}{_more(places)}"
        )
    return f"{total:,} prompt{_s(total)} ({'; '.join(parts)})"


# --------------------------------------------------------------------------------------------------
# context length
# --------------------------------------------------------------------------------------------------
def context_length(spec: JobSpec, job: Any = "job") -> tuple[int | None, str, bool]:
    """(context length, where it comes from, whether SGLang auto-truncates): --context-length in the
    engine's extra args, else the stub's [engine.stub] context_length, else the model folder's
    config.json (max_position_embeddings, at the top or in text_config; model_max_length only as a
    last resort). None (with the reason as the source) when it cannot be found."""
    e = spec.engine
    args = list(e.extra_args)
    if e.kind == "stub":
        # the stub's argv puts both after its own --context-length
        args = list(e.stub.extra_args) + args
    truncate = e.kind == "sglang" and "--allow-auto-truncate" in args
    if e.kind != "external":  # an external server was started elsewhere: its flags are not ours
        value = _flag_value(args, "--context-length")
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                raise SpecError(
                    f"{job}: [engine] extra_args: --context-length {value!r} is not an integer"
                ) from None
            return n, "--context-length in [engine] extra_args", truncate
        if e.kind == "stub":
            return e.stub.context_length, "[engine.stub] context_length", truncate
    return _config_context_length(spec) + (truncate,)


def _flag_value(args: list[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(args):  # the last one wins, as argparse does
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _config_context_length(spec: JobSpec) -> tuple[int | None, str]:
    m = spec.model
    config = Path(m.path) / "config.json"
    data = _read_json(config)
    if data is not None:
        for table, where in ((data, ""), (data.get("text_config"), "text_config.")):
            if isinstance(table, dict) and _positive(table.get("max_position_embeddings")):
                return int(
                    table["max_position_embeddings"]
                ), f"{config} {where}max_position_embeddings"
    for path in (config, Path(m.tokenizer_path or m.path) / "tokenizer_config.json"):
        value = (_read_json(path) or {}).get("model_max_length")
        if _positive(value) and value < UNBOUNDED:
            return int(value), f"{path} model_max_length"
    if data is None:
        return (
            None,
            "cannot find the model's context length: no --context-length in [engine] extra_args "
            f"and no {config}",
        )
    return None, (
        "cannot find the model's context length: no --context-length in [engine] extra_args and "
        f"no max_position_embeddings in {config}"
    )


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
