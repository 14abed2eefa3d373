"""Exports of a merged run: JSONL, Parquet, token ids with a loss mask, and chat conversations.

`export_run` (`steps`) checks what is asked and the merged dataset, then reads the records frame
by frame from `RUN/merged/records.zst` (planned order) and writes them as they come, so memory
stays flat. Its parts, each a module:
  selection      which records an export holds, the reasons a record is not training data, and the
                 account of every planned record (`ExportSummary`, the skipped file)
  text           the reasoning and content decoded from the token ids; a prompt line's other fields
  jsonl, parquet, tokens, conversations   one module per format
  merged         whether the merged dataset is fit to export: whole, of this run, not stale
  commit         the output's name and its side files' names, and the temporary files renamed once
                 complete
  steps          `export_run`: the steps of one export, in order

Formats (every one carries dataset, sample, turn and segments):
  jsonl          id, dataset, sample, turn, segments, status, error, prompt_ids, output_ids,
                 reasoning_end, reasoning, content, finish_reason, matched_stop, matched_stop_str,
                 prompt_tokens, completion_tokens, meta (the prompt line's other fields, e.g. a
                 dataset's `source` and `category`: `_Meta`)
  parquet        the same columns with the same types (ids as list<uint32>, matched_stop as int64,
                 meta as JSON text: `rows_schema`)
  tokens         {"id", "dataset", "sample", "turn", "segments", "input_ids": prompt + output,
                 "loss_mask"}: the default and recommended format, the model's exact ids that
                 SpecForge's and speculators' loaders take as they are; the mask covers the
                 assistant turn after its header for SpecForge, the output only for speculators
                 (`loss_mask`, `trainers.TRAINERS`)
  conversations  {"id", "status": "success", "dataset", "sample", "turn", "segments",
                 "conversations": [source messages..., {"role": "assistant", "content",
                 "reasoning_content"}], "tools"} (tools [] when the prompt had none): SpecForge's
                 chat JSONL, with its round trip through the chat template as SpecForge renders it
                 measured per row and the SpecForge registration of the template beside it; a
                 tool-call section the model wrote is a structured "tool_calls" list of the answer
                 (toolcalls.py), not markup in its content. A regenerated conversation is one row
                 with every turn (plus "turns"), written only when every turn is training data;
                 assistant messages of a source history (not regenerated) keep their content, not
                 their reasoning, and the generated answer is the last message (the row trains
                 with only its last turn)
"""

from toolkit.dataset.export.commit import (
    EXTENSIONS,
    default_output,
    output_format,
    output_path,
    side_file,
)
from toolkit.dataset.export.conversations import has_think_marker
from toolkit.dataset.export.jsonl import JsonlRecord
from toolkit.dataset.export.merged import audit_state, short_merge, stale_merge
from toolkit.dataset.export.parquet import rows_schema
from toolkit.dataset.export.selection import (
    CUT_CHAT_ROWS,
    DEFAULT_FORMAT,
    EXPORT_REASONS,
    FORMATS,
    KEPT_BY_DEFAULT,
    LONGER,
    MODES,
    OTHER_TURN,
    STUB_EXPORT,
    TRAINING_FORMATS,
    ExportError,
    ExportSummary,
    Selection,
    SkippedRow,
    kept_reasons,
)
from toolkit.dataset.export.steps import export_run
from toolkit.dataset.export.text import stop_columns
from toolkit.dataset.export.tokens import loss_mask

__all__ = [
    "CUT_CHAT_ROWS",
    "DEFAULT_FORMAT",
    "EXPORT_REASONS",
    "EXTENSIONS",
    "FORMATS",
    "KEPT_BY_DEFAULT",
    "LONGER",
    "MODES",
    "OTHER_TURN",
    "STUB_EXPORT",
    "TRAINING_FORMATS",
    "ExportError",
    "ExportSummary",
    "JsonlRecord",
    "Selection",
    "SkippedRow",
    "audit_state",
    "default_output",
    "export_run",
    "has_think_marker",
    "kept_reasons",
    "loss_mask",
    "output_format",
    "output_path",
    "rows_schema",
    "short_merge",
    "side_file",
    "stale_merge",
    "stop_columns",
]
