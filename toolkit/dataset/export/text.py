"""The text of the records, decoded from their token ids, and the prompt lines' other fields.

Text is derived from the token ids here, batch-decoded per frame (`_Text`; a byte-level BPE
tokenizer's ids through a table of their bytes, `_byte_table`): the reasoning is the output up to
the think-end id (a think-start the model wrote at position 0 excluded), the content is what
follows it; the stop token and the think-end are in neither (see `records.split_parts` for outputs
without a think-end). `_Tokens` is the run's tokenizer, loaded once per export; `_Meta` the fields
a prompt line holds besides its messages, carried into each row.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import Record, split_parts
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat
from toolkit.job.inputs import ExtraReader
from toolkit.job.readers import SourceError
from toolkit.job.sources import source_sha256

log = logging.getLogger(__name__)


# decode_batch spreads a batch over the cores at about 130 ns of CPU per token; the byte table takes
# 43 on one core (`_byte_table`): with more cores than this, decode_batch is the faster
TABLE_CORES = 4


class _Meta:
    """The fields a prompt line holds besides id, messages, prompt and tools (a dataset's `source`,
    `category`, ...), carried into each record's row: re-read from the line at the byte offset the
    plan pinned. A prompt file gone or changed since the run was planned gives None for its records,
    said once."""

    def __init__(self, plan: RunPlan):
        self.datasets = plan.datasets
        self.reader = ExtraReader()
        self.usable: dict[int, bool] = {}

    def of(self, ref: PromptRef) -> dict[str, Any] | None:
        d = ref.dataset
        if d not in self.usable:
            ds = self.datasets[d]
            try:
                self.usable[d] = source_sha256(ds.path) == ds.sha256
            except (FileNotFoundError, SourceError):
                self.usable[d] = False
            if not self.usable[d]:
                log.warning(
                    "%s changed or is gone since the run was planned: the rows of dataset %s "
                    "carry no fields of their prompt lines (meta is null)",
                    ds.path,
                    ds.name,
                )
        return (
            self.reader.read(self.datasets[d].path, ref.offset, ref.length)
            if self.usable[d]
            else None
        )


class _Tokens:
    """The run's tokenizer and its token info, loaded once per export."""

    def __init__(self, plan: RunPlan):
        model = plan.spec.model
        self.tok = chat.load_tokenizer(model)
        self.info = chat.token_info(self.tok, model)


class _Text:
    """Decodes the reasoning and content of a batch of records in one tokenizer call."""

    def __init__(self, plan: RunPlan, tokens: _Tokens):
        self.tok, self.info = tokens.tok, tokens.info
        self._decode = _batch_decoder(self.tok)

    def parts(self, recs: list[Record]) -> list[tuple[str, str]]:
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = chat.opens_reasoning(r.prompt_ids, self.info)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            seqs.append(ids[r0:r1].tolist())
            seqs.append(ids[c0:c1].tolist())
        texts = self._decode(seqs) if seqs else []
        return [(texts[2 * i], texts[2 * i + 1]) for i in range(len(recs))]

    def parts_and_tools(self, recs: list[Record]) -> list[tuple[str, str, str]]:
        """(reasoning, content before any tool-call section, the tool-call section) of each
        record."""
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = chat.opens_reasoning(r.prompt_ids, self.info)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            tc = r.tool_call_at if r.tool_call_at is not None and c0 <= r.tool_call_at < c1 else c1
            seqs += [ids[r0:r1].tolist(), ids[c0:tc].tolist(), ids[tc:c1].tolist()]
        texts = self._decode(seqs) if seqs else []
        return [(texts[3 * i], texts[3 * i + 1], texts[3 * i + 2]) for i in range(len(recs))]


def _batch_decoder(tok: Any):
    """`tok.batch_decode` without cleanup: a byte-level BPE tokenizer's table of bytes
    (`_byte_table`) on up to TABLE_CORES cores, else straight to the Rust backend of a fast
    tokenizer (same text, several times faster than batch_decode, on every core)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        Tokenizer = None
    backend = getattr(tok, "_tokenizer", None)
    if Tokenizer is not None and isinstance(backend, Tokenizer):
        return (_byte_table(backend) if _table_first() else None) or (
            lambda seqs: backend.decode_batch(seqs, skip_special_tokens=False)
        )
    return lambda seqs: tok.batch_decode(
        seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _table_first() -> bool:
    """Whether the byte table decodes faster than `decode_batch` here: on up to TABLE_CORES cores,
    or when the tokenizer's own threads are turned off."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("false", "0", "off", "no"):
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return cores <= TABLE_CORES


def _byte_values() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's map)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs + extra, bs + [256 + n for n in range(len(extra))])}


def _byte_table(backend: Any):
    """The decoding of a byte-level BPE tokenizer (its decoder `ByteLevel`) from a table of the
    bytes of each id: the text `decode_batch` gives, about three times faster (43 against 123 ns
    per token, the latter on two cores; docs/benchmarks.md). Checked when built against
    `decode_batch` on every id of the vocabulary in context and on random sequences; None (decode
    with the tokenizer) for another decoder or when the check finds a difference."""
    from tokenizers.decoders import ByteLevel

    if not isinstance(backend.decoder, ByteLevel):
        return None
    byte_of = _byte_values()
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    table: list[bytes] = []
    for i in range(size):
        token = added.get(i)
        if token is not None:  # an added token: its text
            table.append(token.encode())
            continue
        token = backend.id_to_token(i) or ""  # a hole in the vocabulary decodes to nothing
        try:
            table.append(bytes(byte_of[c] for c in token))
        except KeyError:  # a character outside the map: the token's own text
            table.append(token.encode())
    get = table.__getitem__

    def decode(seqs: list[list[int]]) -> list[str]:
        try:
            return [b"".join(map(get, s)).decode("utf-8", "replace") for s in seqs]
        except IndexError:  # an id outside the vocabulary (an export forced past the audit)
            return backend.decode_batch(seqs, skip_special_tokens=False)

    rng = np.random.default_rng(0)
    every = rng.permutation(size).tolist()
    probe = [every[k : k + 7] for k in range(0, size, 7)]
    probe += rng.integers(0, size, (500, 40)).tolist()
    same = decode(probe) == backend.decode_batch(probe, skip_special_tokens=False)
    return decode if same else None


def _ids(packed: bytes) -> list[int]:
    return np.frombuffer(packed, "<u4").tolist()


def stop_columns(matched: int | str | None) -> tuple[int | None, str | None]:
    """SGLang's `matched_stop` (a token id or a stop string) as (id, string): one of them set, or
    neither."""
    if isinstance(matched, bool) or matched is None:
        return None, None
    if isinstance(matched, int):
        return matched, None
    return None, str(matched)
