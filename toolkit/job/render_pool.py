"""Every prompt of a job rendered through the chat template and measured, on all the cores of the
machine: the render stage of the pre-flight (`toolkit check`, and `run` and `submit`, which share
it).

A prompt file is cut into slices of whole lines (about SLICE_BYTES each). A slice is read, parsed,
rendered and measured on its own, and what it teaches (`Outcome`: reasoning modes, the longest
prompt, the places of failures, of refused and of too long prompts) is merged with the others in
file order: the answer is the one a single process gives, whatever the number of processes. Large
jobs go to a pool of processes (`processes()`: the cores this process may run on, or
TOOLKIT_RENDER_PROCESSES), each holding the tokenizer once (inherited where processes fork, loaded
once each elsewhere); small ones are measured here, where a pool would cost more than it saves.

While it works, a progress line is drawn on stderr when it is a terminal, and a log line is written
every LOG_EVERY_S seconds when it is not.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import signal
import sys
import time
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from toolkit.errors import BadInputError
from toolkit.job import chat, sources
from toolkit.job.inputs import prompt_id, scan_lines
from toolkit.job.spec import ModelSpec
from toolkit.job.turns import turn_prompt

__all__ = [
    "ENV_PROCESSES",
    "Outcome",
    "Places",
    "Setting",
    "Slice",
    "bound_kind",
    "measure",
    "processes",
    "slices",
]

log = logging.getLogger(__name__)

SHOWN = 5  # places listed per problem and dataset; the rest are counted
# prompt lines read and rendered at a time (memory stays flat whatever the dataset size)
SLICE_BYTES = 1 << 19
ROW_BYTES = 1 << 10  # a table's row, counted when choosing whether to render in a pool
# Below this many bytes of prompt lines the job is measured in this process: starting a pool, and
# the first slices of each process, cost about what a second core saves. Measured on 2 shared cores
# with short prompts: a pool of 2 saved 0.8 s of 5.2 at 40,000 prompts (7.6 MB), nothing measurable
# at 10,000 (1.9 MB).
POOL_MIN_BYTES = 4 << 20
ENV_PROCESSES = "TOOLKIT_RENDER_PROCESSES"
# SGLang's scheduler refuses an input of max_req_input_len = min(context_len - 1, kv_pool - 1) - 5
# tokens or more (SGLang 0.5.23, srt/managers/tp_worker.py and managers/utils.py); the KV pool is
# unknown before the engine starts, so it is taken as large.
SCHEDULER_MARGIN = 6
LOG_EVERY_S = 10.0
DRAW_EVERY_S = 0.2
DRAW_AFTER_S = 0.5  # a job measured faster than this draws no progress line at all


class RenderPoolError(BadInputError):
    """A slice that could not be measured (its prompt file changed since it was planned, say)."""


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
    skip_bad: bool = False  # [inputs] on_bad_line = "skip": the plan left bad lines out, and so
    # does measuring
    skip_long: bool = False  # [inputs] on_too_long = "skip": too long prompts are kept apart
    # (Outcome.skipped_long)


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


class _Memo:
    """What one process keeps from slice to slice: the ids of the prompt ends met, and its text
    renderer."""

    def __init__(self) -> None:
        self.ends: dict[str, list[int]] = {}
        # chat.text_renderer once made (None: this transformers has none)
        self.renderer: Any = False
        self.tables: dict[str, sources.Source] = {}  # the tables read so far, kept open


class _Failure(msgspec.Struct, frozen=True):
    """A slice that raised a toolkit error, carried back to the parent as its message."""

    message: str


def processes() -> int:
    """How many processes render: TOOLKIT_RENDER_PROCESSES if set, else the cores this process may
    run on."""
    value = os.environ.get(ENV_PROCESSES, "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise BadInputError(
                f"{ENV_PROCESSES}={value!r}: must be a whole number of processes, at least 1"
            )
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def slices(
    path: str, *, size: int | None = None
) -> Iterator[tuple[int, int, int, bytes | None, bool]]:
    """(offset, size, first line, lines, rows) of consecutive slices of whole lines of a prompt
    source, about `size` bytes each (SLICE_BYTES by default), or of rows of a table (rows True:
    sources.Source.chunks); the lines are None where a slice is read from the file itself (a plain
    JSONL file)."""
    with contextlib.closing(sources.open_source(path)) as source:
        for chunk in source.chunks(size or SLICE_BYTES):
            yield (*chunk, source.rows)


def measure(
    tok: Any, setting: Setting, work: Sequence[Slice], *, total: int, workers: int | None = None
) -> Iterator[Outcome]:
    """The Outcome of every slice of `work`, in order, while a RenderProgress line counts `total`
    prompts. With more than one worker (default: processes()) and enough bytes to measure, the
    slices go to a process pool."""
    workers = processes() if workers is None else workers
    bar = RenderProgress(total)
    done = 0
    try:
        if workers > 1 and len(work) > 1 and sum(s.bytes for s in work) >= POOL_MIN_BYTES:
            results = _pooled(tok, setting, work, min(workers, len(work)))
        else:
            memo = _Memo()
            results = (_measure_slice(tok, setting, s, memo) for s in work)
        for r in results:
            if isinstance(r, _Failure):
                raise RenderPoolError(r.message)
            done += r.prompts
            bar.update(done)
            yield r
    finally:
        bar.close()


def _pooled(
    tok: Any, setting: Setting, work: Sequence[Slice], n: int
) -> Iterator[Outcome | _Failure]:
    methods = multiprocessing.get_all_start_methods()
    fork = "fork" in methods and sys.platform != "darwin"
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    # The processes encode one text at a time on one core each; a tokenizer that used its thread
    # pool here before the fork would warn in every child unless told so. The variable is set only
    # while the processes start.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(n, initializer=_init_worker, initargs=(tok if fork else None, setting))
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        yield from pool.imap(_work, work, chunksize=1)


# The state of a pool process: its tokenizer and setting, set once by _init_worker (each process has
# its own).
_worker: dict[str, Any] = {}


def _init_worker(tok: Any, setting: Setting) -> None:
    # Ctrl-C is the parent's to handle: it ends the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(
        tok=tok if tok is not None else chat.load_tokenizer(setting.model),
        setting=setting,
        memo=_Memo(),
    )


def _work(s: Slice) -> Outcome | _Failure:
    return _measure_slice(_worker["tok"], _worker["setting"], s, _worker["memo"])


def _measure_slice(tok: Any, setting: Setting, s: Slice, memo: _Memo) -> Outcome | _Failure:
    """Read, render and measure the prompts of one slice; a toolkit error comes back as a
    _Failure."""
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
        return _Failure(
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


def _outcome(tok: Any, setting: Setting, s: Slice, prompts: list, memo: _Memo) -> Outcome:
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
    tok: Any, setting: Setting, texts: list[str | None], mnt: int, memo: _Memo
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
    tok: Any, model: Any, prompts: list, path: str, failed: Places, memo: _Memo
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


class RenderProgress:
    """Prompts measured so far: a line redrawn on stderr when it is a terminal, else a log line now
    and then."""

    def __init__(self, total: int, stream: Any = None):
        self.total, self.stream = total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.last = time.monotonic()
        self.drawn = False

    def text(self, done: int, now: float) -> str:
        elapsed = now - self.start
        share = done / self.total if self.total else 1.0
        left = f", about {_duration(elapsed / share - elapsed)} left" if 0 < share < 1 else ""
        return (
            f"rendering prompts: {done:,} / {self.total:,} ({share:.0%}), "
            f"{_duration(elapsed)}{left}"
        )

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self.start >= DRAW_AFTER_S and (
                now - self.last >= DRAW_EVERY_S or done >= self.total
            ):
                self.stream.write("\r\x1b[K" + self.text(done, now))
                self.stream.flush()
                self.last, self.drawn = now, True
        elif now - self.last >= LOG_EVERY_S:
            log.info("%s", self.text(done, now))
            self.last = now

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
