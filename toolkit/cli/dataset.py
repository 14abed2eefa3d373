"""`merge`, `audit` and `export`: a run's shard files made one dataset (dataset.merge), checked
(dataset.audit) and written as a trainer reads it (dataset.export)."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.cli.shared import RUN_HELP_ARG, add_command, at_least
from toolkit.errors import EXIT_OK, FailedError
from toolkit.formats.files import shown_path


def add_merge(sub) -> None:
    s = add_command(
        sub,
        "merge",
        cmd_merge,
        help="merge a run's shard files into one dataset (in planned order, exactly once) and "
        "audit it",
        description="Stream every shard file of RUN into RUN/merged/records.zst in planned prompt "
        "order, keeping each\nrecord exactly once, with RUN/merged/manifest.json (counts, "
        "checksums, problems). Then audit it\n(RUN/merged/audit.json, audit.html) unless "
        "--no-audit.\n\nexit codes: 0 merged and audit passed, 1 audit failed or records "
        "missing/damaged, 2 cannot merge",
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    s.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="merge even if some shards are unfinished; missing ids go to merged/missing_ids.txt",
    )
    s.add_argument("--no-audit", action="store_true", help="only merge")


def cmd_merge(args) -> int:
    from toolkit.dataset.finish import merge_and_audit
    from toolkit.dataset.merge import merge_run
    from toolkit.formats.rundir import RunDir

    if not args.no_audit:
        merge_and_audit(args.run, allow_incomplete=args.allow_incomplete)
        return EXIT_OK
    m = merge_run(args.run, allow_incomplete=args.allow_incomplete)
    print(
        f"merged {m.records} of {m.planned} planned records ({m.ok} ok, {m.failed} failed) into "
        f"{RunDir(args.run).merged_file}; {m.missing} missing, {m.duplicates} duplicates kept "
        f"once, {len(m.corrupt)} damaged frames"
    )
    if m.corrupt or m.foreign or not (m.complete or args.allow_incomplete):
        raise FailedError(
            f"{RunDir(args.run).shown}: merged with damaged frames or shards of another run, or "
            "incomplete: see the line above; `toolkit audit` says what each check finds"
        )
    return EXIT_OK


def add_audit(sub) -> None:
    s = add_command(
        sub,
        "audit",
        cmd_audit,
        help="check a merged run: coverage, reasoning capture, truncation, consistency; write "
        "reports",
        description="Audit RUN/merged/records.zst: every planned id present once, reasoning split "
        "on the think-end id,\ntruncation, stop tokens, token counts, prompts re-rendered from "
        "the source. Thresholds come from the\njob's [audit] table. Writes RUN/merged/audit.json, "
        "audit.html and failed_ids.txt (missing_ids.txt is the merge's).\n\nexit codes: 0 passed, "
        "1 a check failed, 2 no merged dataset or unreadable run",
    )
    s.add_argument("run", help=RUN_HELP_ARG + ", merged with `toolkit merge`")


def cmd_audit(args) -> int:
    from toolkit.dataset.finish import audit_and_report

    audit_and_report(args.run)
    return EXIT_OK


EXPORT_HELP = (
    "Export RUN/merged/records.zst (ok records only unless --include-failed):\n  "
    "jsonl          one object per record: id, dataset, sample, turn, segments, status, "
    "error, prompt_ids,\n                 output_ids, reasoning_end, reasoning, content, "
    "finish_reason, matched_stop (token id),\n                 matched_stop_str (stop "
    "string), prompt_tokens, completion_tokens\n  parquet        the same columns and types "
    '(needs pyarrow)\n  tokens         the default: {"id", "dataset", "sample", '
    '"turn", "segments", "input_ids": prompt +\n                 output, '
    "\"loss_mask\"}, the model's exact ids, which SpecForge's and speculators' "
    "loaders\n                 take as they are; the mask: 1 on every output id, and for "
    "SpecForge also on a\n                 think-start the template wrote after its assistant "
    "header (--trainer, --think-start);\n                 outputs cut by max_new_tokens kept "
    "as the model wrote them (--exclude truncated)\n  conversations  SpecForge's chat JSONL "
    "(id, status, conversations, tools; dataset, sample, turn,\n                 "
    "segments): the source messages, then the assistant turn with `content` "
    "and\n                 "
    "`reasoning_content`; SpecForge tokenizes them again: the export measures per "
    "row\n                 whether that gives the model's ids, and writes the SpecForge "
    "registration of the template\n\ntokens and conversations leave out records that are not "
    "training data (a repetition loop, no think-end,\nan empty part, a think marker inside a "
    "part, reasoning where none is expected, a NaN stop;\nin conversations also truncated: "
    "the chat template would close the cut turn); --include REASON\nkeeps them, --exclude "
    "REASON leaves out what a format keeps. Every selected record is\naccounted for: "
    "printed, and beside the output in NAME_skipped.jsonl (each record left out,\nwith its "
    "reason) and NAME_summary.json (exported + skipped + failed + missing + filtered ==\n"
    "planned; NAME: the output's name without .jsonl, records.parquet's records_parquet). The "
    "rows are measured\n(tokens per row: p50, p99, max); tokens also writes the trainer's "
    "config with the length that\nkeeps every row whole (NAME_specforge.yaml, "
    "NAME_prepare_data.sh); --max-length N leaves longer rows out.\n\nAn "
    "ok record that fails the audit's checks of one record (token counts, max_new_tokens, "
    "vocabulary,\nfinish, reasoning split) refuses the export (exit 1, nothing written) "
    "unless --force."
)


def add_export(sub) -> None:
    s = add_command(
        sub,
        "export",
        cmd_export,
        help="write a merged run as jsonl, parquet, tokens (input_ids + loss_mask) or "
        "conversations",
        description=EXPORT_HELP,
    )
    s.add_argument("run", help=RUN_HELP_ARG + ", merged with `toolkit merge`")
    s.add_argument(
        "--format",
        choices=["jsonl", "parquet", "tokens", "conversations"],
        help="tokens (the default, recommended for training): input_ids + loss_mask, the model's "
        "exact ids; jsonl or parquet: one row per record; conversations: chat rows with "
        "reasoning_content (SpecForge renders and tokenizes them again: the export says how many "
        "rows keep the exact ids). Without it, the output's extension says it: .parquet writes "
        "parquet, .jsonl or .json tokens; a --format the extension does not hold is refused",
    )
    s.add_argument(
        "--trainer",
        choices=["specforge", "speculators"],
        default="specforge",
        help="tokens: the trainer whose loss-mask rule to follow (default specforge; speculators "
        "leaves the template's think-start unsupervised) and the default file name",
    )
    s.add_argument(
        "--think-start",
        choices=["supervised", "unsupervised"],
        help="tokens: whether a think-start the chat template wrote at the end of the prompt is "
        "in the loss mask (default: the trainer's rule)",
    )
    s.add_argument(
        "-o",
        "--output",
        help="output file, or a folder (existing, or ending with /) to write the default "
        "name into (default: RUN/export/tokens.jsonl, tokens_speculators.jsonl, records.jsonl, "
        "records.parquet or conversations.jsonl)",
    )
    s.add_argument("--include-failed", action="store_true", help="also export failed records")
    _add_export_reasons(s)
    _add_export_selection(s)
    s.add_argument(
        "--force",
        action="store_true",
        help="export ok records that fail the audit's record checks (counts, max_new_tokens, "
        "vocabulary, finish, reasoning split) too, with a warning; without it such records refuse "
        "the export",
    )


def _add_export_reasons(s) -> None:
    """`export`'s flags on the records a format leaves out and why: --include, --exclude,
    --max-length, and the round trip's --check-sample."""
    s.add_argument(
        "--include-truncated",
        action="store_true",
        help="keep outputs cut by max_new_tokens in conversations too (--include truncated; "
        "tokens keeps them unless --exclude truncated)",
    )
    s.add_argument(
        "--include",
        action="append",
        metavar="REASON",
        help="keep records left out for REASON (repeatable; `all` keeps every ok record): nan, "
        "degenerate, truncated, no_think_end, empty_reasoning, empty_content, think_marker, "
        "reasoning, other_turn, text_think_marker, unreadable_tool_call, empty_answer, "
        "tool_call_only",
    )
    s.add_argument(
        "--exclude",
        action="append",
        metavar="REASON",
        help="leave out records of REASON that the format keeps (repeatable; `all`): "
        "`--exclude truncated` leaves the outputs cut by max_new_tokens out of tokens; in jsonl "
        "and parquet any reason",
    )
    s.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="leave out rows of more than N ids (prompt + output), each with the reason "
        "longer_than_max_length, instead of letting the trainer cut them; the trainer's config "
        "written beside a tokens export then says N",
    )
    s.add_argument(
        "--check-sample",
        type=int,
        metavar="N",
        help="conversations: check the round trip of about N rows, one every planned/N, "
        "instead of every row (for very large exports; the summary says how many were checked "
        "and how many give the model's ids)",
    )


def _add_export_selection(s) -> None:
    """`export`'s flags that select records: by dataset, finish, reasoning mode, sample, turn."""
    s.add_argument(
        "--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)"
    )
    s.add_argument(
        "--finish",
        action="append",
        choices=["stop", "length", "loop"],
        help="only ok outputs with this "
        "finish reason (repeatable; loop: stopped in a repetition loop by [client] loop_stop)",
    )
    s.add_argument(
        "--mode",
        choices=["reasoning", "non-reasoning"],
        help="only ok outputs in this reasoning mode "
        "(reasoning: the prompt or the model opened it, or the output holds the think-end id)",
    )
    s.add_argument(
        "--sample",
        action="append",
        type=int,
        metavar="K",
        help="only sample K of each prompt (repeatable)",
    )
    s.add_argument(
        "--turn",
        action="append",
        type=int,
        metavar="K",
        help="only turn K (from 0) of regenerated "
        "conversations (repeatable); a conversations row then ends at that turn",
    )


def cmd_export(args) -> int:
    from toolkit.dataset import export

    at_least("--sample", args.sample, 0, "sample indices count from 0")
    at_least("--turn", args.turn, 0, "turn indices count from 0")
    fmt = export.output_format(args.output, args.format)  # a mismatch refused here
    include = set(args.include or [])
    if args.include_truncated:
        include.add("truncated")
    if "all" in include:
        include = set(export.EXPORT_REASONS)  # an unknown name is refused by export_run
    exclude = set(args.exclude or [])
    if "all" in exclude:
        exclude = set(export.EXPORT_REASONS)
    select = export.Selection(
        datasets=frozenset(args.dataset) if args.dataset else None,
        finish=frozenset(args.finish) if args.finish else None,
        mode=args.mode,
        samples=frozenset(args.sample) if args.sample is not None else None,
        turns=frozenset(args.turn) if args.turn is not None else None,
        include=frozenset(include) if include else None,
        max_length=args.max_length,
        exclude=frozenset(exclude) if exclude else None,
    )
    think = None if args.think_start is None else args.think_start == "supervised"
    s = export.export_run(
        args.run,
        fmt,
        args.output,
        include_failed=args.include_failed,
        force=args.force,
        select=select,
        trainer=args.trainer,
        supervise_think_start=think,
        check_sample=args.check_sample,
    )
    output = Path(s.output)
    for w in s.warnings:
        print(f"warning: {w}", file=sys.stderr)
    what = fmt if args.format else f"{fmt}, the default: the model's exact ids"
    if not args.format and fmt != export.DEFAULT_FORMAT:
        what = f"{fmt}, from the output's extension"
    if fmt == "tokens":
        what += (
            f"; loss mask for {s.trainer}, the template's think-start "
            f"{'supervised' if s.supervise_think_start else 'not supervised'}"
        )
    print(f"wrote {s.rows} rows ({s.exported} records) to {shown_path(output)} ({what})")
    print(s.line())
    print(
        f"left out, with the reason per id: {shown_path(s.skipped_file)}; summary: "
        f"{shown_path(export.side_file(output, 'summary', '.json'))}"
    )
    if s.lengths is not None and s.lengths.rows:
        _print_lengths(s, args)
    if fmt == "conversations":
        _print_roundtrip(s, args)
    return EXIT_OK


def _print_lengths(s, args) -> None:
    """The export's tokens per row, and the trainer's length that keeps every row whole."""
    n = s.lengths
    trainer = s.trainer or "specforge"
    length = args.max_length or n.needed
    cut = n.supervised_cut_by_default / n.supervised if n.supervised else 0.0
    print(
        f"tokens per row: p50 {n.p50:,}, p99 {n.p99:,}, max {n.max:,}; at its default "
        f"{n.setting} {n.default_length}, {trainer} would cut {n.rows_cut_by_default} of "
        f"{n.rows} rows ({cut:.1%} of the supervised tokens)"
    )
    where = f" (written in {shown_path(s.trainer_config)})" if s.trainer_config else ""
    sep = ":" if n.setting.startswith("data.") else ""
    print(f"every row whole: {trainer} {n.setting}{sep} {length}{where}")


def _print_roundtrip(s, args) -> None:
    """A conversations export's round trip: how many rows SpecForge's rendering gives the model's
    ids, and its chat-template registration."""
    differ = s.roundtrip_rows - s.roundtrip_identical
    print(
        f"round trip as SpecForge renders the rows: {s.roundtrip_identical} of "
        f"{s.roundtrip_rows} rows give the model's exact ids, {differ} differ (per row: "
        f"{shown_path(s.roundtrip_file)})"
        + (
            ""
            if s.roundtrip_sample is None
            else f"; rows checked: {s.roundtrip_rows} of {s.rows} (--check-sample)"
        )
    )
    if s.arguments_reformatted:
        print(
            f"{s.arguments_reformatted} tool calls have arguments SpecForge would train "
            "re-serialised (not as json.dumps writes them)"
        )
    print(
        "SpecForge chat-template registration of this model: "
        f"{shown_path(s.registration_file)} (import it before training; data.chat_template = "
        "its name)"
    )
    if differ:
        print(
            f"warning: {differ} rows would not train on the model's ids: train on the tokens "
            f"export instead (`toolkit export {args.run}`)",
            file=sys.stderr,
        )
