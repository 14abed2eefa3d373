"""One slice of a prompt file rendered and measured: its lines read, parsed and rendered through
the chat template, and what it teaches (`Outcome`: reasoning modes, the longest prompt, the places
of failures, of refused and of too long prompts), to be merged with the other slices' in file order
(job/render_pool runs the slices, in a pool of processes or here). A prompt far from the context
length is bounded by its UTF-8 length instead of encoded whole (`bound_kind`)."""

from __future__ import annotations

import io
import unicodedata
from typing import Any

import msgspec

from toolkit.errors import BadInputError
from toolkit.job import chat, sources
from toolkit.job.inputs import prompt_id, scan_lines
from toolkit.job.schema import ModelSpec
from toolkit.job.turns import turn_prompt

SHOWN = 5  # places listed per problem and dataset; the rest are counted
ROW_BYTES = 1 << 10  # a table's row, counted when choosing whether to render in a pool
# SGLang's scheduler refuses an input of max_req_input_len = min(context_len - 1, kv_pool - 1) - 5
# tokens or more (SGLang 0.5.23, srt/managers/tp_worker.py and managers/utils.py); the KV pool is
# unknown before the engine starts, so it is taken as large.
SCHEDULER_MARGIN = 6


class Places(msgspec.Struct):
    """A count of prompts with some property, and the first SHOWN of them (file:line and a
    detail)."""

    count: int = 0
    first: list[str] = []

    def add(self, place: str) -> None:
        self.count += 1
        if len(self.first) < SHOWN:
            self.first.append(place)

    def merge(self, other: Places) -> None:
        self.count += other.count
        self.first.extend(other.first[: SHOWN - len(self.first)])


class Outcome(msgspec.Struct):
    """What measuring the prompts of a dataset (or of a slice of it) taught."""

    # prompts read (a regenerated conversation counts once: its first turn is what is measured)
    prompts: int = 0
    modes: dict[str, int] = {}  # reasoning mode -> prompts
    failed: Places = msgspec.field(default_factory=Places)  # the chat template fails on them
    # their reasoning mode goes against expect_reasoning
    refused: Places = msgspec.field(default_factory=Places)
    # expect_reasoning = false: the model may open it
    model_opens: Places = msgspec.field(default_factory=Places)
    # refused by SGLang (or cut, with auto-truncate)
    too_long: Places = msgspec.field(default_factory=Places)
    # the scheduler lowers their max_new_tokens a bit
    clamped: Places = msgspec.field(default_factory=Places)
    # the largest prompt length (or bound) + max_new_tokens; 0 without a context length
    longest: int = 0
    # on_too_long = "skip": (line, why) of each prompt that does not fit
    skipped_long: list[tuple[int, str]] = []

    def merge(self, other: Outcome) -> None:
        self.prompts += other.prompts
        for mode, n in other.modes.items():
            self.modes[mode] = self.modes.get(mode, 0) + n
        for name in ("failed", "refused", "model_opens", "too_long", "clamped"):
            getattr(self, name).merge(getattr(other, name))
        self.longest = max(self.longest, other.longest)
        self.skipped_long += other.skipped_long


class Setting(msgspec.Struct, frozen=True):
    """What measuring a prompt needs besides the tokenizer: the same in every process."""

    model: ModelSpec
    info: chat.TokenInfo
    context: int | None
    bounded: str | None  # see bound_kind: None encodes every prompt whole
    # think_start and think_end are added tokens: a prompt's end is read from its text (_ending)
    anchored: bool
    # [inputs] on_bad_line = "skip": the plan left bad lines out, and so does measuring
    skip_bad: bool = False
    # [inputs] on_too_long = "skip": too long prompts are kept apart (Outcome.skipped_long)
    skip_long: bool = False


class Slice(msgspec.Struct, frozen=True, array_like=True):
    """Lines of one prompt file: `size` bytes from byte `offset`, the first being line
    `first_line`."""

    dataset: int  # position of the dataset in the job
    path: str
    name: str
    regenerate: bool
    max_new_tokens: int
    offset: int
    size: int
    first_line: int
    data: bytes | None = None  # the slice's lines (None: read from the file at offset)
    rows: bool = False  # offset and size count a table's rows (sources.Source.rows)

    @property
    def bytes(self) -> int:
        """Its bytes (a table's row counted as ROW_BYTES), to tell whether a pool is worth it."""
        return (
            len(self.data) if self.data is not None else self.size * (ROW_BYTES if self.rows else 1)
        )


class Memo:
    """What one process keeps from slice to slice: the ids of the prompt ends met, and its text
    renderer."""

    def __init__(self) -> None:
        self.ends: dict[str, list[int]] = {}
        # chat.text_renderer once made (None: this transformers has none)
        self.renderer: Any = False
        self.tables: dict[str, sources.Source] = {}  # the tables read so far, kept open


class Failure(msgspec.Struct, frozen=True):
    """A slice that raised a toolkit error, carried back to the parent as its message."""

    message: str


def measure_slice(tok: Any, setting: Setting, s: Slice, memo: Memo) -> Outcome | Failure:
    """Read, render and measure the prompts of one slice; a toolkit error comes back as a
    Failure."""
    try:
        data = s.data
        if data is None and s.rows:
            if s.path not in memo.tables:
                memo.tables[s.path] = sources.open_source(s.path)
            data = memo.tables[s.path].span(s.offset, s.size)
        elif data is None:
            with open(s.path, "rb") as f:
                f.seek(s.offset)
                data = f.read(s.size)
        skipped: list | None = [] if setting.skip_bad else None  # the plan reported them already
        prompts = list(
            scan_lines(
                io.BytesIO(data),
                s.path,
                s.name,
                first_line=s.first_line,
                offset=s.offset,
                errors=skipped,
                rows=s.rows,
            )
        )
    except (OSError, BadInputError) as e:
        return Failure(
            f"{e} (the file changed while the job was being checked)"
            if isinstance(e, BadInputError)
            else f"{s.path}: cannot read it ({e}); check the file, then run the command again"
        )
    # the first turn is what is known before generation; later ones hold its answers
    if s.regenerate:
        for p in prompts:
            p.id = prompt_id(p)  # of the conversation, not of its first turn
        prompts = [turn_prompt(p, 0, []) for p in prompts]
    return _outcome(tok, setting, s, prompts, memo)


def _outcome(tok: Any, setting: Setting, s: Slice, prompts: list, memo: Memo) -> Outcome:
    m, info, ctx, mnt = setting.model, setting.info, setting.context, s.max_new_tokens
    out = Outcome(prompts=len(prompts), modes={mode: 0 for mode in chat.MODES})
    refused_mode = chat.CLOSED if m.expect_reasoning else chat.OPENED
    texts = _texts(tok, m, prompts, s.path, out.failed, memo)
    for p, (n, ids) in zip(prompts, _lengths(tok, setting, texts, mnt, memo)):
        if ids is None:
            continue
        mode = chat.reasoning_mode(ids, info)
        out.modes[mode] += 1
        place = f"{s.path}:{p.line}"
        if mode == refused_mode:
            out.refused.add(place)
        elif mode == chat.MODEL_OPENS and not m.expect_reasoning:
            out.model_opens.add(place)
        if ctx is None:
            continue
        # SGLang's order (srt/managers/tokenizer_manager.py, then the scheduler): input >= context;
        # input + max_new_tokens > context; input >= the scheduler's max_req_input_len; then the
        # scheduler's clamp of max_new_tokens to max_req_len - input - 1.
        if n >= ctx or n + mnt > ctx or n >= ctx - SCHEDULER_MARGIN:
            if setting.skip_long:
                out.skipped_long.append(
                    (
                        p.line,
                        f"too long: {n:,} tokens + max_new_tokens {mnt:,} do not fit the "
                        f"context length {ctx:,}",
                    )
                )
                continue
            out.too_long.add(f"{place} ({n:,} tokens)")
        elif n + mnt > ctx - 2:
            out.clamped.add(f"{place} ({n:,} tokens)")
        out.longest = max(out.longest, n + mnt)
    return out


def _lengths(
    tok: Any, setting: Setting, texts: list[str | None], mnt: int, memo: Memo
) -> list[tuple[int, list[int] | None]]:
    """(length or an upper bound of it, ids ending like the prompt's) per text; (0, None) for a
    prompt the template failed on. The length is exact, and the ids all of them, unless
    `setting.bounded` (see bound_kind) and the text's UTF-8 length + 1 (more than the tokenizer can
    make of it) fits with room to spare: then it is that bound, and the ids those of the text's end
    from its last think token on (see _ending), or none."""
    ctx, bounded = setting.context, setting.bounded
    whole: list[int] = []
    out: list[tuple[int, list[int] | None]] = [(0, None)] * len(texts)
    for i, text in enumerate(texts):
        if text is None:
            continue
        if bounded is not None and setting.anchored:
            bound = (
                len((unicodedata.normalize("NFC", text) if bounded else text).encode("utf-8")) + 1
            )
            if ctx is None or (bound + mnt <= ctx - 2 and bound < ctx - SCHEDULER_MARGIN):
                end = _ending(text, setting.model)
                ids = memo.ends.get(end)
                if ids is None:
                    ids = chat.encode_texts(tok, [end])[0] if end else []
                    if len(memo.ends) > 4096:
                        memo.ends.clear()
                    memo.ends[end] = ids
                out[i] = (bound, ids)
                continue
        whole.append(i)
    for i, ids in zip(whole, chat.encode_texts(tok, [texts[i] for i in whole])):
        out[i] = (len(ids), ids)
    return out


def _ending(text: str, model: Any) -> str:
    """The end of a rendered prompt from its last think token on, when that token is the last one
    but whitespace; else "" (its last meaningful token is then no think token: a character that is
    not whitespace follows).

    The think tokens are added tokens, which a tokenizer splits out of the text before anything
    else: the ids of this end are the prompt's last ids, and its reasoning mode is the prompt's."""
    stripped = text.rstrip()
    for token in (model.think_start, model.think_end):
        if stripped.endswith(token):
            return text[len(stripped) - len(token) :]
    return ""


def bound_kind(tok: Any, model: Any) -> tuple[str | None, bool]:
    """(how to bound a prompt's token count by its bytes, whether its end can be read from its
    text).

    The bound: "" (UTF-8 bytes + 1), "NFC" (the bytes of its NFC form + 1), or None (no bound:
    encode every prompt whole). A fast tokenizer makes at most one token per byte of the text it
    normalizes (byte-level BPE, byte fallback; one more for a prefix space); NFKC/NFKD or
    replacements could lengthen the text, so such tokenizers get no bound. The end is read from the
    text when both think tokens are added tokens (split out first)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "split_special_tokens", False):
        return None, False
    try:
        added = tok.get_added_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without it is measured whole
        added = {}
    anchored = model.think_start in added and model.think_end in added
    normalizer = backend.normalizer
    if normalizer is None:
        return "", anchored
    try:
        names = (
            [type(n).__name__ for n in normalizer]
            if type(normalizer).__name__ == "Sequence"
            else [type(normalizer).__name__]
        )
    except TypeError:
        return None, False
    if not set(names) <= {"NFC", "Strip"}:
        return None, False
    return ("NFC" if "NFC" in names else ""), anchored


def _texts(
    tok: Any, model: Any, prompts: list, path: str, failed: Places, memo: Memo
) -> list[str | None]:
    """Rendered text of every prompt, None for those the template fails on (each recorded in
    `failed`).

    chat.text_renderer when it gives render_texts' text for the slice's first prompt (checked in
    every slice), else render_texts itself."""
    if memo.renderer is False:
        memo.renderer = chat.text_renderer(tok, model)
    direct = memo.renderer
    if direct is not None and prompts:
        try:
            same = chat.render_texts(tok, model, prompts[:1]) == [
                direct(prompts[0].messages, prompts[0].tools)
            ]
        except Exception:  # noqa: BLE001 - the template fails on it: said below, by the slower path
            same = False
        if same:
            out: list[str | None] = []
            for p in prompts:
                try:
                    out.append(direct(p.messages, p.tools))
                # the template's own errors, said as render_texts says them
                except Exception as exc:  # noqa: BLE001
                    failed.add(
                        f"{path}:{p.line} (id {prompt_id(p)!r}): {type(exc).__name__}: {exc}"
                    )
                    out.append(None)
            return out
    try:
        return list(chat.render_texts(tok, model, prompts))
    except chat.ChatError:
        pass
    out = []
    for p in prompts:
        try:
            out.append(chat.render_texts(tok, model, [p])[0])
        except chat.ChatError as e:
            cause = e.__cause__ or e
            failed.add(f"{path}:{p.line} (id {prompt_id(p)!r}): {type(cause).__name__}: {cause}")
            out.append(None)
    return out
