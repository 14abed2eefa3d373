"""The pre-flight's render, reasoning and length stages: every prompt rendered through the chat
template (on every core: render_pool; what was learned kept by check_cache), its reasoning mode
judged against [model] expect_reasoning, its length plus max_new_tokens against the model's context
length (`context_length`, as SGLang reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan
from toolkit.job import chat, check_cache, render_pool, render_slice
from toolkit.job.findings import Preflight, PreflightError, plural
from toolkit.job.findrun import find_run
from toolkit.job.render_slice import SCHEDULER_MARGIN, Outcome, Places
from toolkit.job.schema import JobSpec
from toolkit.job.specerrors import SpecError

# tokenizer_config model_max_length of a tokenizer without a limit (transformers' 1e30 sentinel)
UNBOUNDED = 10**9


def check_prompts(pf: Preflight, job: Any, exact: bool = False) -> None:
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
    bounded, anchored = (None, False) if exact else render_slice.bound_kind(tok, m)
    setting = render_slice.Setting(
        m,
        pf.info,
        pf.context,
        bounded,
        anchored,
        skip_bad=spec.inputs.on_bad_line == "skip",
        skip_long=spec.inputs.on_too_long == "skip",
    )
    work = [
        render_slice.Slice(i, d.path, d.name, d.regenerate, mnts[i], *piece)
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
    spec = pf.spec
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
            f"the chat template fails on {failed.count:,} prompt{plural(failed.count)}: "
            + "; ".join(failed.first)
            + _more(failed)
            + "; fix these prompts' messages/tools or the [model] chat template"
        )
    _judge_reasoning(pf, refused, model_opens, problems)
    _judge_lengths(pf, too_long, clamped, truncate, problems)
    if problems:
        raise PreflightError([f"{job}: {p}" for p in problems])


def _judge_reasoning(
    pf: Preflight,
    refused: dict[str, Places],
    model_opens: dict[str, Places],
    problems: list[str],
) -> None:
    """Prompts whose reasoning mode goes against [model] expect_reasoning (problems), or that the
    model may open reasoning for, or whose mode cannot be told (warnings)."""
    m, modes = pf.spec.model, pf.modes
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


def _judge_lengths(
    pf: Preflight,
    too_long: dict[str, Places],
    clamped: dict[str, Places],
    truncate: bool,
    problems: list[str],
) -> None:
    """Prompts that do not fit the context length with their max_new_tokens (a problem, or a
    warning when SGLang truncates), or that leave the scheduler too little room (a warning)."""
    spec, ctx, source = pf.spec, pf.context, pf.context_source
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
    return f"{total:,} prompt{plural(total)} ({'; '.join(parts)})"


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
