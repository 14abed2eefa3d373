"""Exports of a merged run: JSONL, Parquet, token ids with a loss mask, and chat conversations.

Records are read frame by frame from `RUN/merged/records.zst` (planned order) and written as they come, so
memory stays flat. Text is derived from the token ids here, batch-decoded per frame: the reasoning is the
output up to the think-end id (a think-start the model wrote at position 0 excluded), the content is what
follows it; the stop token and the think-end are in neither (see `records.split_parts` for outputs without a
think-end). Only ok records are exported unless `include_failed`. Every ok record exported is checked as the
audit checks one record on its own (`records.defects`: counts, max_new_tokens, vocabulary, finish, split): an
export that meets one is refused, nothing written, unless `force` (then each kind is warned about).

Formats:
  jsonl          id, dataset, sample, turn, status, error, prompt_ids, output_ids, reasoning_end, reasoning, content,
                 finish_reason, matched_stop, matched_stop_str, prompt_tokens, completion_tokens
  parquet        the same columns with the same types (ids as list<uint32>, matched_stop as int64)
  tokens         {"id", "dataset", "sample", "turn", "input_ids": prompt + output, "loss_mask": 0 per prompt id, 1 per output id}: the layout
                 speculative-decoding trainers (EAGLE-3, SpecForge) train a draft model on
  conversations  {"id", "conversations": [source messages..., {"role": "assistant", "content", "reasoning_content"}]}
                 (plus "tools" when the prompt had tools), SpecForge-style chat JSONL; a tool-call section the model
                 wrote is a structured "tool_calls" list of the answer (toolcalls.py), not markup in its content
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from toolkit.dataset.merge import MERGED, load_manifest
from toolkit.errors import EXIT_FAILED, BadInputError
from toolkit.formats.files import io_problem
from toolkit.formats.frames import CorruptShard, decode_batch, iter_frames, read_header
from toolkit.formats.records import OK, RECORD_CHECKS, Record, defects, id_positions, opens_reasoning, split_parts
from toolkit.formats.rundir import RunDir
from toolkit.job import chat
from toolkit.job.inputs import InputError, PromptReader
from toolkit.job.plan import PlannedRefs, RunPlan, check_plan_inputs, load_run
from toolkit.job.toolcalls import parse_tool_calls
from toolkit.job.turns import answer_message, turn_messages, user_turns

__all__ = ["FORMATS", "ExportError", "JsonlRecord", "export_run"]

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "tokens", "conversations")
PARQUET_ROWS = 1024  # records per Parquet row group


class ExportError(BadInputError):
    """An export that cannot be made (bad format, missing optional package, unwritable output)."""


class JsonlRecord(msgspec.Struct):
    """One line of the `jsonl` export (and one row of `parquet`), fields in this order."""

    id: str
    dataset: str
    sample: int
    turn: int
    status: str
    error: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_end: int | None
    reasoning: str
    content: str
    finish_reason: str | None
    matched_stop: int | None        # the stop token id SGLang matched (None: a stop string, or no stop)
    matched_stop_str: str | None    # the stop string SGLang matched, when the stop was a string
    prompt_tokens: int
    completion_tokens: int


class _Tokens:
    """The run's tokenizer and its token info, loaded once per export."""

    def __init__(self, plan: RunPlan):
        model = plan.spec.model
        self.tok = chat.load_tokenizer(model)
        self.info = chat.token_info(self.tok, model)


class _Defects:
    """The ok records that fail the audit's checks of one record (`records.defects`), as they are read."""

    def __init__(self, plan: RunPlan, tokens: _Tokens):
        self.info = tokens.info
        self.max_new = {d.name: plan.spec.sampling_for(d.name).get("max_new_tokens") for d in plan.datasets}
        self.found: dict[str, list[str]] = {}  # kind -> ids
        self.count = 0

    def check(self, rec: Record) -> None:
        kinds = defects(rec, self.info.vocab_size, id_positions(rec.output_ids, self.info.think_end_id),
                        self.max_new.get(rec.dataset))
        self.count += bool(kinds)
        for kind in kinds:
            self.found.setdefault(kind, []).append(rec.id)

    def summary(self) -> str:
        """e.g. `2 ok records fail the audit's record checks: an id outside the tokenizer (p0003, p0007)`."""
        parts = [f"{RECORD_CHECKS[k]} ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''})"
                 for k, ids in self.found.items()]
        return (f"{self.count} ok record{'s' if self.count != 1 else ''} fail the audit's record checks: "
                + "; ".join(parts))


class _Text:
    """Decodes the reasoning and content of a batch of records in one tokenizer call."""

    def __init__(self, plan: RunPlan, tokens: _Tokens):
        self.tok, self.info = tokens.tok, tokens.info
        self.blank = frozenset(self.info.blank_ids)
        self._decode = _batch_decoder(self.tok)

    def parts(self, recs: list[Record]) -> list[tuple[str, str]]:
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = opens_reasoning(r.prompt_ids, self.info.think_start_id, self.blank)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            seqs.append(ids[r0:r1].tolist())
            seqs.append(ids[c0:c1].tolist())
        texts = self._decode(seqs) if seqs else []
        return [(texts[2 * i], texts[2 * i + 1]) for i in range(len(recs))]

    def parts_and_tools(self, recs: list[Record]) -> list[tuple[str, str, str]]:
        """(reasoning, content before any tool-call section, the tool-call section) of each record."""
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = opens_reasoning(r.prompt_ids, self.info.think_start_id, self.blank)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            tc = r.tool_call_at if r.tool_call_at is not None and c0 <= r.tool_call_at < c1 else c1
            seqs += [ids[r0:r1].tolist(), ids[c0:tc].tolist(), ids[tc:c1].tolist()]
        texts = self._decode(seqs) if seqs else []
        return [(texts[3 * i], texts[3 * i + 1], texts[3 * i + 2]) for i in range(len(recs))]


def _batch_decoder(tok: Any):
    """`tok.batch_decode` without cleanup; straight to the Rust backend of a fast tokenizer (same text, several
    times faster, parallel)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        Tokenizer = None
    backend = getattr(tok, "_tokenizer", None)
    if Tokenizer is not None and isinstance(backend, Tokenizer):
        return lambda seqs: backend.decode_batch(seqs, skip_special_tokens=False)
    return lambda seqs: tok.batch_decode(seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _batches(path: Path, include_failed: bool, defects: _Defects) -> Iterator[list[Record]]:
    """The merged records, frame by frame, each ok one checked (`defects`); CorruptShard on a damaged frame, a torn
    last one included (a merged file is written whole: a frame cut short is damage, not a crash mid-write)."""
    tail: list = []
    for frame in iter_frames(path, tail=tail):
        recs = decode_batch(frame)
        for r in recs:
            if r.status == OK:
                defects.check(r)
        if not include_failed:
            recs = [r for r in recs if r.status == OK]
        if recs:
            yield recs
    if tail:
        raise CorruptShard(path, tail[0][0], tail[0][1])


def _ids(packed: bytes) -> list[int]:
    return np.frombuffer(packed, "<u4").tolist()


def stop_columns(matched: int | str | None) -> tuple[int | None, str | None]:
    """SGLang's `matched_stop` (a token id or a stop string) as (id, string): one of them set, or neither."""
    if isinstance(matched, bool) or matched is None:
        return None, None
    if isinstance(matched, int):
        return matched, None
    return None, str(matched)


def _sample(refs: PlannedRefs, r: Record) -> int:
    ref = refs.at(r.index)
    return ref.sample if ref is not None else 0


def _turn(refs: PlannedRefs, r: Record) -> int:
    ref = refs.at(r.index)
    return ref.turn if ref is not None else 0


def _jsonl_rows(recs: list[Record], texts: list[tuple[str, str]], refs: PlannedRefs) -> Iterator[JsonlRecord]:
    for r, (reasoning, content) in zip(recs, texts):
        stop_id, stop_str = stop_columns(r.matched_stop)
        yield JsonlRecord(
            id=r.id, dataset=r.dataset, sample=_sample(refs, r), turn=_turn(refs, r), status=r.status, error=r.error, prompt_ids=_ids(r.prompt_ids),
            output_ids=_ids(r.output_ids), reasoning_end=r.reasoning_end, reasoning=reasoning, content=content,
            finish_reason=r.finish, matched_stop=stop_id, matched_stop_str=stop_str, prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
        )


def _write_lines(out, objs: Iterator[Any], enc: msgspec.json.Encoder) -> int:
    buf = bytearray()
    n = 0
    for obj in objs:
        enc.encode_into(obj, buf, -1)
        buf += b"\n"
        n += 1
    out.write(buf)
    return n


def _export_jsonl(path: Path, plan: RunPlan, out, include_failed: bool, rd: RunDir, tokens: _Tokens,
                  defects: _Defects) -> int:
    text, enc, n, refs = _Text(plan, tokens), msgspec.json.Encoder(), 0, PlannedRefs(rd, plan)
    for recs in _batches(path, include_failed, defects):
        n += _write_lines(out, _jsonl_rows(recs, text.parts(recs), refs), enc)
    return n


def _export_tokens(path: Path, plan: RunPlan, out, include_failed: bool, rd: RunDir, tokens: _Tokens,
                   defects: _Defects) -> int:
    enc, n, refs = msgspec.json.Encoder(), 0, PlannedRefs(rd, plan)
    for recs in _batches(path, include_failed, defects):
        n += _write_lines(out, (
            {"id": r.id, "dataset": r.dataset, "sample": _sample(refs, r), "turn": _turn(refs, r), "input_ids": _ids(r.prompt_ids + r.output_ids),
             "loss_mask": [0] * r.n_prompt + [1] * r.n_output}
            for r in recs
        ), enc)
    return n


def _export_conversations(path: Path, plan: RunPlan, out, include_failed: bool, rd: RunDir, tokens: _Tokens,
                          defects: _Defects) -> int:
    text, enc, n = _Text(plan, tokens), msgspec.json.Encoder(), 0
    refs, reader = PlannedRefs(rd, plan), PromptReader()
    chains: dict[tuple[int, int, int], list[dict[str, Any] | None]] = {}  # regenerated: answers so far
    skipped = 0

    def rows(recs: list[Record]) -> Iterator[dict]:
        nonlocal skipped
        for r, (reasoning, content, section) in zip(recs, text.parts_and_tools(recs)):
            ref = refs.at(r.index)
            ds = plan.datasets[ref.dataset]
            prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
            answer = answer_message(reasoning, content, parse_tool_calls(section) if section else None)
            if ds.regenerate:  # one row per conversation, once its last turn is read
                key = (ref.dataset, ref.line, ref.sample)
                chain = chains.setdefault(key, [])
                chain += [None] * (ref.turn - len(chain)) + [answer if r.status == OK else None]
                if ref.turn + 1 < user_turns(prompt.messages):
                    continue
                del chains[key]
                if None in chain:
                    skipped += 1
                    continue
                messages = [*turn_messages(prompt.messages, len(chain) - 1, chain), chain[-1]]
                row: dict[str, Any] = {"id": r.id.rsplit("/t", 1)[0], "sample": ref.sample, "turns": len(chain),
                                       "conversations": messages}
            else:
                row = {"id": r.id, "sample": ref.sample, "conversations": [*prompt.messages, answer]}
            if prompt.tools:
                row["tools"] = prompt.tools
            yield row

    with reader:
        for recs in _batches(path, include_failed, defects):
            n += _write_lines(out, rows(recs), enc)
    skipped += len(chains)
    if skipped:
        log.warning("%d regenerated conversations left out: a turn of each is failed or missing "
                    "(`toolkit retry` generates them again)", skipped)
    return n


def _export_parquet(path: Path, plan: RunPlan, out_path: Path, include_failed: bool, rd: RunDir, tokens: _Tokens,
                    defects: _Defects) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError("the parquet export needs pyarrow: `pip install pyarrow` (or the toolkit's [parquet] extra)") from None
    ids_type = pa.list_(pa.uint32())
    schema = pa.schema([
        ("id", pa.string()), ("dataset", pa.string()), ("sample", pa.int32()), ("turn", pa.int32()), ("status", pa.string()), ("error", pa.string()),
        ("prompt_ids", ids_type), ("output_ids", ids_type), ("reasoning_end", pa.int32()),
        ("reasoning", pa.string()), ("content", pa.string()), ("finish_reason", pa.string()),
        ("matched_stop", pa.int64()), ("matched_stop_str", pa.string()), ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
    ])

    def id_lists(packed: list[bytes]) -> pa.Array:
        lengths = np.fromiter((len(p) >> 2 for p in packed), np.int32, len(packed))
        offsets = np.zeros(len(packed) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.frombuffer(b"".join(packed), "<u4")
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.uint32()))

    text, n, refs = _Text(plan, tokens), 0, PlannedRefs(rd, plan)
    pending: list[Record] = []
    pending_text: list[tuple[str, str]] = []

    def flush(writer) -> None:
        if not pending:
            return
        cols = [
            pa.array([r.id for r in pending], pa.string()),
            pa.array([r.dataset for r in pending], pa.string()),
            pa.array([_sample(refs, r) for r in pending], pa.int32()),
            pa.array([_turn(refs, r) for r in pending], pa.int32()),
            pa.array([r.status for r in pending], pa.string()),
            pa.array([r.error for r in pending], pa.string()),
            id_lists([r.prompt_ids for r in pending]),
            id_lists([r.output_ids for r in pending]),
            pa.array([r.reasoning_end for r in pending], pa.int32()),
            pa.array([t[0] for t in pending_text], pa.string()),
            pa.array([t[1] for t in pending_text], pa.string()),
            pa.array([r.finish for r in pending], pa.string()),
            pa.array([stop_columns(r.matched_stop)[0] for r in pending], pa.int64()),
            pa.array([stop_columns(r.matched_stop)[1] for r in pending], pa.string()),
            pa.array([r.prompt_tokens for r in pending], pa.int64()),
            pa.array([r.completion_tokens for r in pending], pa.int64()),
        ]
        writer.write_table(pa.Table.from_arrays(cols, schema=schema))
        pending.clear()
        pending_text.clear()

    with pq.ParquetWriter(str(out_path), schema, compression="zstd") as writer:
        for recs in _batches(path, include_failed, defects):
            pending.extend(recs)
            pending_text.extend(text.parts(recs))
            n += len(recs)
            if len(pending) >= PARQUET_ROWS:
                flush(writer)
        flush(writer)
    return n


_TEXT_WRITERS = {"jsonl": _export_jsonl, "tokens": _export_tokens, "conversations": _export_conversations}


def default_output(run_dir: str | os.PathLike, fmt: str) -> Path:
    """Where an export goes when no output is given: RUN/export/records.jsonl, records.parquet, tokens.jsonl, ..."""
    return RunDir(run_dir).export_file(fmt)


def export_run(run_dir: str | os.PathLike, fmt: str, output: str | os.PathLike | None = None, *,
               include_failed: bool = False, force: bool = False) -> int:
    """Write the merged records of a run to `output` in `fmt`; return how many records were written.

    Without `output`, the file is `default_output(run_dir, fmt)` (its folder is created). The file appears under
    its name only when complete (written to a temporary name, then renamed). Ok records that fail the audit's
    record checks refuse the export (ExportError, nothing written) unless `force`, which warns about them.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    rd, plan = load_run(run_dir)
    manifest = load_manifest(rd)  # a merged dataset must exist
    path = rd.merged_file
    if not path.exists():
        raise ExportError(f"{path} is missing: run `toolkit merge {rd.root}` again")
    size = path.stat().st_size
    if size != manifest.bytes:
        raise ExportError(f"{path} has {size} bytes, its manifest says {manifest.bytes}: it changed after the merge; "
                          f"run `toolkit merge {rd.root}` again")
    try:
        head = read_header(path)
    except CorruptShard as e:
        raise _damaged(rd, e) from None
    if head != (plan.fingerprint, MERGED):
        raise ExportError(f"{path} is not the merged dataset of run {plan.fingerprint}; run `toolkit merge {rd.root}` again")
    if output is None:
        output = default_output(run_dir, fmt)
        Path(output).parent.mkdir(exist_ok=True)
    if fmt == "conversations":  # pairs records with their source messages: the files must be those planned
        try:
            check_plan_inputs(plan)
        except InputError as e:
            raise ExportError(f"{e}; the conversations export would pair records with other messages than they were "
                              "generated from") from None
    out_path = Path(output)
    if out_path.is_dir():
        raise ExportError(f"cannot write {output}: it is a folder; give a file name, e.g. "
                          f"{out_path / default_output(run_dir, fmt).name}")
    if out_path.parent and not out_path.parent.is_dir():
        raise ExportError(f"cannot write {out_path}: folder {out_path.parent} does not exist; create it first")
    tokens = _Tokens(plan)
    found = _Defects(plan, tokens)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        if fmt == "parquet":
            n = _export_parquet(path, plan, tmp, include_failed, rd, tokens, found)
        else:
            with open(tmp, "wb") as out:
                n = _TEXT_WRITERS[fmt](path, plan, out, include_failed, rd, tokens, found)
        if found.count and not force:
            raise ExportError(f"{found.summary()}; nothing exported. `toolkit audit {rd.root}` names them: generate "
                              f"them again (`toolkit retry {rd.root} --ids FILE`), or export them anyway with --force",
                              exit_code=EXIT_FAILED)
        if found.count:
            log.warning("exporting them anyway (--force): %s", found.summary())
        os.replace(tmp, out_path)
    except CorruptShard as e:
        tmp.unlink(missing_ok=True)
        raise _damaged(rd, e) from None
    except OSError as e:  # a full disk, say
        tmp.unlink(missing_ok=True)
        raise ExportError(io_problem(e, out_path, "export again"), exit_code=EXIT_FAILED) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


def _damaged(rd: RunDir, e: CorruptShard) -> ExportError:
    return ExportError(f"{rd.merged_file} is damaged ({e.why} at byte {e.offset}): nothing exported; run "
                       f"`toolkit merge {rd.root}` again")
