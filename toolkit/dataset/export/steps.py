"""`export_run`: one export's steps in order. The arguments and the selection are checked, then
the merged dataset (`merged`) and the output (`commit`); the summary is begun with its warnings (a
run of the stub engine says so in the summary, the Parquet file's metadata and the SpecForge
registration file; a failed or missing audit is said); the format's side files are set up (a
`tokens` export gets the trainer's config that keeps every row whole,
`trainer_config.write_config`; `conversations` the round trip and the SpecForge registration);
the rows are written to temporary files that are renamed once complete.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec

from toolkit.dataset.export.commit import output_format, output_path, side_file, written
from toolkit.dataset.export.conversations import _Checks, _export_conversations
from toolkit.dataset.export.jsonl import _export_jsonl
from toolkit.dataset.export.merged import _damaged, audit_state, check_merged
from toolkit.dataset.export.parquet import _export_parquet
from toolkit.dataset.export.selection import (
    CUT_CHAT_ROWS,
    EXPORT_REASONS,
    FORMATS,
    MODES,
    STUB_EXPORT,
    TRAINING_FORMATS,
    ExportError,
    ExportSummary,
    Selection,
    _Account,
    _Defects,
    kept_reasons,
)
from toolkit.dataset.export.text import _Tokens
from toolkit.dataset.export.tokens import _export_tokens
from toolkit.dataset.merge_manifest import MergeManifest, load_manifest
from toolkit.dataset.trainer_config import config_name, write_config
from toolkit.dataset.trainers import (
    TRAINERS,
    Registration,
    builtin_problems,
    registration,
    writes_default_system,
)
from toolkit.errors import FailedError
from toolkit.formats.run import Run
from toolkit.job.inputs import check_plan_inputs
from toolkit.job.promptline import InputError
from toolkit.job.schema import JobSpec

log = logging.getLogger(__name__)


_TEXT_WRITERS = {"jsonl": _export_jsonl, "tokens": _export_tokens}


@dataclass
class _Export:
    """One export as its arguments and its checks set it up, read by the steps that write it."""

    run: Run
    fmt: str
    select: Selection
    include: frozenset[str]
    include_failed: bool
    out_path: Path
    tokens: _Tokens
    found: _Defects
    summary: ExportSummary
    finals: list[Path]  # output, skipped, summary, then the format's own side files
    trainer: str
    check_sample: int | None
    reg: Registration | None = None  # conversations: the SpecForge registration


def export_run(
    run_dir: str | os.PathLike,
    fmt: str | None = None,
    output: str | os.PathLike | None = None,
    *,
    include_failed: bool = False,
    force: bool = False,
    select: Selection | None = None,
    trainer: str = "specforge",
    supervise_think_start: bool | None = None,
    check_sample: int | None = None,
) -> ExportSummary:
    """Write the merged records of a run that `select` selects to `output` in `fmt` (None: as the
    output's extension says, `output_format`; a mismatch is refused); return the
    account of every selected planned record (`ExportSummary`), also written beside the output as
    `<name>_summary.json`, with the records left out and why in `<name>_skipped.jsonl`.

    Records that are not training data (`quality.SKIP_REASONS`) are left out of `tokens` and
    `conversations` unless `select.include` names their reason, except outputs cut by
    max_new_tokens, which `tokens` keeps; `jsonl` and `parquet` hold every ok record unless
    `select.include` is given; `select.exclude` leaves out the records of its reasons
    (`kept_reasons`). Without `output`, the file is `default_output(run_dir,
    fmt, trainer)` (its folder is created); an `output` that is a folder (or ends with a slash) gets
    that name inside it. `tokens` follows `trainer`'s loss-mask rule (`trainers.TRAINERS`) unless
    `supervise_think_start` says otherwise. `conversations` also writes, beside the output, the
    round trip of each row through the chat template as SpecForge renders it
    (`<name>_roundtrip.jsonl`; counted in the summary) and the SpecForge registration of the model's
    template (`<name>_specforge_template.py`); `tokens` writes the trainer's config with the length
    that keeps every row whole (`<name>_specforge.yaml`, `<name>_prepare_data.sh`). A failed or
    missing audit is said in `summary.warnings`. The files appear under their names only when
    complete (written to temporary names, then renamed). Ok records that fail the audit's record
    checks refuse the export (FailedError, nothing written) unless `force`, which warns about them.
    `check_sample` N: the conversations round trip checks about N rows, one every planned/N rows
    (None: every row).
    """
    fmt = _check_format(fmt, output, trainer)
    select = select or Selection()
    _check_selection(fmt, select, check_sample)
    run = Run.open(run_dir, JobSpec)  # read-only: only the export's own files are written
    manifest = load_manifest(run.rd)  # a merged dataset must exist
    short = check_merged(run, manifest)
    out_path = _check_output(run, run_dir, fmt, output, trainer)
    _check_datasets(run, select)
    ex = _begin(run, fmt, select, out_path, include_failed, trainer, check_sample)
    _warn(ex, manifest, short)
    if fmt == "tokens":
        _begin_tokens(ex, supervise_think_start)
    if fmt == "conversations":
        _begin_conversations(ex)
    with written(ex.finals, out_path, partial(_damaged, run.rd)) as tmps:
        _write_rows(ex, tmps)
        _check_defects(ex, force)
        tmps[2].write_bytes(msgspec.json.format(msgspec.json.encode(ex.summary)) + b"\n")
    return ex.summary


def _check_format(fmt: str | None, output: str | os.PathLike | None, trainer: str) -> str:
    """The format the export writes (`output_format`); an unknown format or trainer refused."""
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    fmt = output_format(output, fmt)
    if trainer not in TRAINERS:
        raise ExportError(f"unknown trainer {trainer!r}; choose one of {', '.join(TRAINERS)}")
    return fmt


def _check_selection(fmt: str, select: Selection, check_sample: int | None) -> None:
    """Refuse a selection that names what is not there (a reasoning mode, a reason), a reason both
    included and excluded, a length under 1, or a check sample that is under 1 or not of a
    conversations export."""
    if check_sample is not None and (check_sample < 1 or fmt != "conversations"):
        raise ExportError(
            f"--check-sample {check_sample}: give a number of rows, 1 or more, to a "
            "conversations export (the only one with a round trip)"
        )
    if select.max_length is not None and select.max_length < 1:
        raise ExportError(f"--max-length {select.max_length}: give a number of tokens, 1 or more")
    if select.mode is not None and select.mode not in MODES:
        raise ExportError(
            f"unknown reasoning mode {select.mode!r}; choose one of {', '.join(MODES)}"
        )
    for verb, given in (("include", select.include), ("exclude", select.exclude)):
        unknown = sorted((given or frozenset()) - set(EXPORT_REASONS))
        if unknown:
            raise ExportError(
                f"unknown reason {', '.join(unknown)} to {verb}; choose among "
                f"{', '.join(EXPORT_REASONS)}"
            )
    both = sorted((select.include or frozenset()) & (select.exclude or frozenset()))
    if both:
        raise ExportError(
            f"reason {', '.join(both)} both included and excluded: give it to one of --include "
            "and --exclude"
        )


def _check_output(
    run: Run,
    run_dir: str | os.PathLike,
    fmt: str,
    output: str | os.PathLike | None,
    trainer: str,
) -> Path:
    """The file the export writes (its default folder made), refused when it is a folder or its
    folder is missing; a conversations export also refuses prompt files changed since the plan."""
    out_path = output_path(run_dir, fmt, output, trainer)
    if output is None or (
        os.fspath(output).endswith(("/", os.sep)) and out_path.parent.parent.is_dir()
    ):
        out_path.parent.mkdir(exist_ok=True)
    # pairs records with their source messages: the files must be those planned
    if fmt == "conversations":
        try:
            check_plan_inputs(run.plan)
        except InputError as e:
            raise ExportError(
                f"{e}; the conversations export would pair records with other messages than they "
                "were generated from"
            ) from None
    if out_path.is_dir():
        raise ExportError(f"cannot write {out_path}: it is a folder; give another file name")
    if out_path.parent and not out_path.parent.is_dir():
        raise ExportError(
            f"cannot write {out_path}: folder {out_path.parent} does not exist; create it first"
        )
    return out_path


def _check_datasets(run: Run, select: Selection) -> None:
    """Refuse a selection of datasets the run does not have."""
    known = {d.name for d in run.plan.datasets}
    if select.datasets is not None and not select.datasets <= known:
        raise ExportError(
            f"no dataset {', '.join(sorted(select.datasets - known))} in run {run.rd.root}; its "
            f"datasets: {', '.join(d.name for d in run.plan.datasets)}"
        )


def _begin(
    run: Run,
    fmt: str,
    select: Selection,
    out_path: Path,
    include_failed: bool,
    trainer: str,
    check_sample: int | None,
) -> _Export:
    """The export set up: the run's tokenizer loaded, the summary begun, its three files named."""
    tokens = _Tokens(run.plan)
    skipped_path = side_file(out_path, "skipped", ".jsonl")
    return _Export(
        run=run,
        fmt=fmt,
        select=select,
        include=kept_reasons(fmt, select),
        include_failed=include_failed,
        out_path=out_path,
        tokens=tokens,
        found=_Defects(run.plan, tokens),
        summary=ExportSummary(format=fmt, output=str(out_path), skipped_file=str(skipped_path)),
        finals=[out_path, skipped_path, side_file(out_path, "summary", ".json")],
        trainer=trainer,
        check_sample=check_sample,
    )


def _warn(ex: _Export, manifest: MergeManifest, short: str | None) -> None:
    """The summary's warnings about what the export is made of: the stub engine's records, cut
    outputs kept as chat rows, a merge that is short, an audit that failed or was not run."""
    rd, summary = ex.run.rd, ex.summary
    summary.engine = ex.run.plan.engine_class
    if ex.run.plan.synthetic:
        summary.warnings.append(STUB_EXPORT)
    if ex.fmt == "conversations" and "truncated" in ex.include:
        summary.warnings.append(CUT_CHAT_ROWS)
    summary.audit, failed_checks = audit_state(rd)
    if short:  # merged with --allow-incomplete: exported, and said
        summary.warnings.append(
            f"the merged dataset holds {manifest.records} of {manifest.planned} planned records "
            "(merged with --allow-incomplete): the export lacks the others"
        )
    if summary.audit == "failed":
        summary.warnings.append(
            f"the audit of run {rd.root} failed ({failed_checks}): see {rd.audit_json} and "
            f"`toolkit audit {rd.root}` before training on this export"
        )
    elif summary.audit == "none":
        summary.warnings.append(
            f"run {rd.root} has no audit: run `toolkit audit {rd.root}` before training on it"
        )


def _begin_tokens(ex: _Export, supervise_think_start: bool | None) -> None:
    """A tokens export's trainer, its loss-mask rule, and its config file beside the output."""
    ex.summary.trainer = ex.trainer
    ex.finals.append(side_file(ex.out_path, *config_name(ex.trainer)))
    ex.summary.supervise_think_start = (
        TRAINERS[ex.trainer].supervise_think_start
        if supervise_think_start is None
        else supervise_think_start
    )


def _begin_conversations(ex: _Export) -> None:
    """A conversations export's SpecForge registration of the chat template (a template that
    refuses the probe conversation: its thinking parser assumed, and said), and its round-trip and
    registration files beside the output."""
    tokens, spec, summary = ex.tokens, ex.run.plan.spec, ex.summary
    info = tokens.info
    stops = [tokens.tok.convert_ids_to_tokens(i) for i in info.eos_ids]
    think = tokens.tok.convert_ids_to_tokens(info.think_start_id)
    try:
        ex.reg = registration(
            tokens.tok,
            think,
            [s for s in stops if isinstance(s, str)],
            name=spec.name,
            think_end=tokens.tok.convert_ids_to_tokens(info.think_end_id),
            kwargs=dict(spec.model.chat_template_kwargs),
        )
    except Exception as e:  # noqa: BLE001 - a template that refuses the probe conversation
        ex.reg = Registration(
            name=spec.name,
            assistant_header="",
            end_of_turn_token=None,
            parser_type="thinking",
            enable_thinking=True,
        )
        summary.warnings.append(
            f"the chat template refuses a probe conversation ({type(e).__name__}: {e}): no "
            "SpecForge registration could be read from it; the round trip assumes its "
            "thinking parser"
        )
    trip_path = side_file(ex.out_path, "roundtrip", ".jsonl")
    reg_path = side_file(ex.out_path, "specforge_template", ".py")
    summary.roundtrip_file, summary.registration_file = str(trip_path), str(reg_path)
    ex.finals += [trip_path, reg_path]
    summary.warnings += builtin_problems(ex.reg, writes_default_system(tokens.tok))


def _write_rows(ex: _Export, tmps: list[Path]) -> None:
    """The export's rows, its skipped file and its format's side files, written to `tmps`; the
    summary's counts and lengths filled in."""
    plan, summary, path = ex.run.plan, ex.summary, ex.run.rd.merged_file
    tmp = tmps[0]
    with open(tmps[1], "wb") as skipped_out:
        acc = _Account(
            plan,
            ex.run.prompts(),
            ex.select,
            ex.include,
            ex.include_failed,
            ex.tokens,
            summary,
            skipped_out,
        )
        if ex.fmt == "parquet":
            summary.rows = _export_parquet(path, plan, tmp, acc, ex.tokens, ex.found)
        elif ex.fmt == "conversations":
            _write_conversations(ex, acc, tmps)
        else:
            with open(tmp, "wb") as out:
                summary.rows = _TEXT_WRITERS[ex.fmt](path, plan, out, acc, ex.tokens, ex.found)
        acc.finish()
        if ex.fmt in TRAINING_FORMATS:
            summary.lengths = acc.lengths.figures()
        if ex.fmt == "tokens":
            figs = summary.lengths
            length = ex.select.max_length or figs.needed or figs.default_length
            write_config(tmps[3], ex.trainer, plan.spec.model.path, ex.out_path, length)
            summary.trainer_config = str(ex.finals[3])


def _write_conversations(ex: _Export, acc: _Account, tmps: list[Path]) -> None:
    """The conversations rows, the round trip of each (or of one in `check_sample`), and the
    SpecForge registration (marked as the stub's when the stub made the records)."""
    plan, summary = ex.run.plan, ex.summary
    stub_note = f"# {STUB_EXPORT}\n" if plan.synthetic else ""
    tmps[4].write_text(stub_note + ex.reg.python())
    with open(tmps[0], "wb") as out, open(tmps[3], "wb") as trip_out:
        every = 1 if ex.check_sample is None else -(-summary.planned // ex.check_sample)
        summary.roundtrip_sample = ex.check_sample
        checks = _Checks(ex.tokens, ex.reg, trip_out, max(every, 1))
        summary.rows = _export_conversations(
            ex.run.rd.merged_file, plan, out, acc, ex.tokens, ex.found, checks
        )
    summary.roundtrip_rows, summary.roundtrip_identical = checks.trip.rows, checks.trip.identical
    summary.arguments_reformatted = checks.reformatted


def _check_defects(ex: _Export, force: bool) -> None:
    """Refuse an export of ok records that fail the audit's record checks, unless `force`, which
    warns about them."""
    rd = ex.run.rd
    if ex.found.count and not force:
        raise FailedError(
            f"{ex.found.summary()}; nothing exported. `toolkit audit {rd.root}` names them: "
            f"generate them again (`toolkit retry {rd.root} --ids FILE`), or export them anyway "
            "with --force"
        )
    if ex.found.count:
        log.warning("exporting them anyway (--force): %s", ex.found.summary())
