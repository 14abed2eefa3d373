"""Tokenizer and chat template: what the model sees.

Owns loading a model's tokenizer the way the model itself is loaded and resolving the token ids that
records are split on (think start/end, tool-call section, eos: `token_info`). Rendering prompts to
the exact `input_ids` sent to the engine is job/templating's, the reasoning mode the ids tell
job/reasoning's; the rest of the package reads their names from here (`chat.render`,
`chat.OPENED`). transformers is imported inside the functions that need it, so importing this
module stays cheap.

The functions take duck-typed arguments: `model` is anything with the attributes of the job's
[model] table (path, tokenizer_path, trust_remote_code, chat_template, chat_template_kwargs,
think_start, think_end, tool_call_start); `prompt` is anything with id, dataset, line, messages and
tools.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from toolkit.job.reasoning import (
    CLOSED,
    MODEL_OPENS,
    MODES,
    OPENED,
    UNKNOWN,
    TokenInfo,
    mentions,
    opens_reasoning,
    output_in_reasoning,
    reasoning_mode,
    thinking_hint,
    thinking_variables,
)
from toolkit.job.templating import (
    BATCH_SIZE,
    ChatError,
    _check_kwargs,
    _render_one,
    encode_texts,
    render,
    render_many,
    render_texts,
    text_renderer,
)

logger = logging.getLogger(__name__)

# What the rest of the package reads from here: this module's own, and the rendering and reasoning
# names it takes from job/templating and job/reasoning.
__all__ = [
    "BATCH_SIZE",
    "CLOSED",
    "MODEL_OPENS",
    "MODES",
    "OPENED",
    "PROBE_MESSAGES",
    "TOOL_SECTIONS",
    "UNKNOWN",
    "WORD_CACHE",
    "ChatError",
    "TokenInfo",
    "check_model_vocab",
    "encode_texts",
    "load_tokenizer",
    "model_vocab_size",
    "opens_reasoning",
    "output_in_reasoning",
    "probe_ids",
    "reasoning_mode",
    "render",
    "render_many",
    "render_texts",
    "text_renderer",
    "thinking_hint",
    "token_info",
]

# Tool-call section delimiters of known families: Kimi-K2, Qwen3 (and GLM), DeepSeek, MiniMax-M2.
TOOL_SECTIONS: dict[str, str] = {
    "<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
    "<tool_call>": "</tool_call>",
    "<｜tool▁calls▁begin｜>": "<｜tool▁calls▁end｜>",
    "<minimax:tool_call>": "</minimax:tool_call>",
}


PROBE_MESSAGES = [{"role": "user", "content": "Hello."}]


def load_tokenizer(model: Any) -> Any:
    """Load the tokenizer of `model` (tokenizer_path or path), with [model] chat_template applied if
    set."""
    field = "tokenizer_path" if model.tokenizer_path else "path"
    path = Path(model.tokenizer_path or model.path)
    if not path.is_dir():
        raise ChatError(
            f"tokenizer folder {path} does not exist ([model] {field}); "
            "point it at a local folder holding the model's tokenizer files"
        )
    _check_kwargs(model)
    template = None
    if model.chat_template:
        try:
            template = Path(model.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatError(
                f"chat template file {model.chat_template} cannot be read ({exc.strerror or exc}); "
                "fix [model] chat_template, or remove it to use the tokenizer's own template"
            ) from None

    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=model.trust_remote_code, local_files_only=True
        )
    # transformers raises many kinds (OSError, ValueError, KeyError, ImportError)
    except Exception as exc:
        hint = (
            ""
            if model.trust_remote_code
            else "; if the folder ships its own tokenizer code, set trust_remote_code"
        )
        raise ChatError(
            f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    if template is not None:
        tok.chat_template = template
    _bound_word_cache(tok)
    if not getattr(tok, "chat_template", None):
        raise ChatError(
            f"the tokenizer in {path} has no chat template; set [model] chat_template to a .jinja "
            "file (templates/chat/ has examples)"
        )
    logger.info("loaded tokenizer %s from %s (%d ids)", type(tok).__name__, path, len(tok))
    return tok


# Words whose BPE merges a fast tokenizer remembers. Its own default (10,000) kept a worker's memory
# growing with the shard's size until that many distinct words had been seen (peak RSS +4 to +6 %
# from 10k to 300k prompts); at 1,000 it was +1.6 %, and encoding no slower within this machine's
# noise (benchmarks/bench_worker_memory.py).
WORD_CACHE = 1000


def _bound_word_cache(tok: Any) -> None:
    """Bound a fast BPE tokenizer's word cache (others, e.g. tiktoken-based remote code, are left as
    they are)."""
    model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
    resize = getattr(model, "_resize_cache", None)
    if callable(resize):
        resize(WORD_CACHE)


def probe_ids(tok: Any, model: Any) -> list[int]:
    """The input_ids of the one-message probe conversation (PROBE_MESSAGES): what the worker's
    readiness probe sends, a prompt that is none of the job's, so that one prompt's bad answer is
    never taken for the engine's."""
    return _render_one(tok, model, PROBE_MESSAGES, None)


def token_info(tok: Any, model: Any) -> TokenInfo:
    """Resolve and check the think, tool-call and eos token ids of `tok`; probe whether prompts open
    reasoning."""
    think_start_id = _required_single(tok, model.think_start, "think_start")
    think_end_id = _required_single(tok, model.think_end, "think_end")
    if think_start_id == think_end_id:
        raise ChatError(
            f"[model] think_start {model.think_start!r} and think_end {model.think_end!r} are the "
            f"same token {think_start_id}; set them to the model's reasoning start and end tokens"
        )
    tool_start_id, tool_end_id = _tool_call_ids(tok, model)
    blank_ids = _blank_ids(tok)
    try:
        probe = _render_one(tok, model, PROBE_MESSAGES, None)
    except Exception as exc:
        raise ChatError(
            f"the chat template fails on a one-message probe conversation: {type(exc).__name__}: "
            f"{exc}; fix the template or [model] chat_template_kwargs"
        ) from exc
    info = TokenInfo(
        think_start_id=think_start_id,
        think_end_id=think_end_id,
        eos_ids=_eos_ids(tok, model),
        tool_call_start_id=tool_start_id,
        tool_call_end_id=tool_end_id,
        vocab_size=len(tok),
        opens_reasoning=False,  # the probe's reasoning mode, just below
        blank_ids=blank_ids,
        template_knows_reasoning=mentions(tok.chat_template, (model.think_start, model.think_end)),
        thinking_kwargs=thinking_variables(tok.chat_template),
    )
    info = msgspec.structs.replace(info, opens_reasoning=opens_reasoning(probe, info))
    logger.info(
        "think %d/%d, eos %s, tool call %s/%s, prompts %s reasoning",
        info.think_start_id,
        info.think_end_id,
        info.eos_ids,
        info.tool_call_start_id,
        info.tool_call_end_id,
        "open" if info.opens_reasoning else "do not open",
    )
    return info


# Where a model folder's config.json keeps the language model's vocabulary size (multimodal models
# nest it).
_VOCAB_TABLES = ("", "text_config", "language_config", "llm_config")


def model_vocab_size(model: Any) -> tuple[int | None, str]:
    """(vocab_size of the model's config.json, where it was read), or (None, why not): the rows of
    the model's embedding that hold trained weights."""
    config = Path(model.path) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, f"no readable {config}"
    for table in _VOCAB_TABLES:
        section = data.get(table) if table else data
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{config} {table + '.' if table else ''}vocab_size"
    return None, f"no vocab_size in {config}"


def check_model_vocab(tok: Any, info: TokenInfo, model: Any) -> None:
    """Refuse a tokenizer that makes ids the model has no trained row for: an id past SGLang's
    padded embedding kills the whole server (an IndexError in its scheduler), one between vocab_size
    and the padding is read from an untrained row without a word. Nothing to check when the model
    folder has no vocab_size."""
    size, where = model_vocab_size(model)
    if size is None or info.vocab_size <= size:
        return
    outside = range(size, info.vocab_size)
    named = ", ".join(f"{i} {_token_name(tok, i)!r}" for i in list(outside)[:3]) + (
        ", ..." if len(outside) > 3 else ""
    )
    raise ChatError(
        f"the tokenizer makes {info.vocab_size:,} ids but the model has {size:,} ({where}): ids "
        f"{size:,} to {info.vocab_size - 1:,} ({named}) are outside its embedding, and SGLang dies "
        "on a prompt holding one; use the model's own tokenizer ([model] tokenizer_path) or fix "
        "the model's config.json"
    )


def _token_name(tok: Any, token_id: int) -> str:
    try:
        return str(tok.convert_ids_to_tokens(token_id))
    except Exception:  # noqa: BLE001 - a name is only for the message
        return "?"


def _single_id(tok: Any, text: str) -> tuple[int | None, list[int]]:
    """The id of `text` if it is exactly one token (by vocabulary and by encoding), and what it
    encodes to."""
    encoded = list(tok.encode(text, add_special_tokens=False))
    vocab_id = tok.convert_tokens_to_ids(text)
    unk = getattr(tok, "unk_token_id", None)
    if isinstance(vocab_id, int) and vocab_id != unk and encoded == [vocab_id]:
        return vocab_id, encoded
    return None, encoded


def _required_single(tok: Any, text: str, key: str) -> int:
    token_id, encoded = _single_id(tok, text)
    if token_id is None:
        pieces = tok.convert_ids_to_tokens(encoded)
        raise ChatError(
            f"[model] {key} = {text!r} is not a single token of this tokenizer: it encodes to "
            f"{len(encoded)} ids {encoded} ({pieces}); set {key} in the [model] table to the "
            "model's own token (one entry of its vocabulary)"
        )
    return token_id


def _tool_call_ids(tok: Any, model: Any) -> tuple[int | None, int | None]:
    if model.tool_call_start:
        start_id = _required_single(tok, model.tool_call_start, "tool_call_start")
        end = TOOL_SECTIONS.get(model.tool_call_start) or _guess_end(model.tool_call_start)
        return start_id, (_single_id(tok, end)[0] if end else None)
    for start, end in TOOL_SECTIONS.items():
        start_id, _ = _single_id(tok, start)
        if start_id is not None:
            return start_id, _single_id(tok, end)[0]
    return None, None


def _guess_end(start: str) -> str | None:
    """The closing counterpart of a tool-call start token: <x> -> </x>, ..._begin... ->
    ..._end..."""
    if "begin" in start:
        head, _, tail = start.rpartition("begin")
        return head + "end" + tail
    if start.startswith("<") and not start.startswith("</"):
        return "</" + start[1:]
    return None


def _eos_ids(tok: Any, model: Any) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and v not in ids:
                ids.append(v)

    add(tok.eos_token_id)
    for name in ("config.json", "generation_config.json"):
        path = Path(model.path) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ChatError(
                f"{path} cannot be read as JSON ({exc}); fix or remove the file"
            ) from None
        if not isinstance(data, dict):
            raise ChatError(f"{path} is not a JSON object; fix or remove the file")
        add(data.get("eos_token_id"))
        # multimodal models keep the language model's config here
        if isinstance(data.get("text_config"), dict):
            add(data["text_config"].get("eos_token_id"))
    if not ids:
        raise ChatError(
            f"no eos token id found: the tokenizer has no eos_token and {model.path} has no "
            "eos_token_id in "
            "config.json or generation_config.json; add eos_token_id to generation_config.json"
        )
    return ids


def _blank_ids(tok: Any) -> list[int]:
    """Ids whose text is whitespace only (newlines, spaces), found by decoding the whole vocabulary
    once."""
    ids = range(len(tok))
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        # 5x faster than batch_decode; its clean-up of spaces never changes blankness
        if backend is not None:
            texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        else:
            texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    except Exception:  # vocabularies with holes (unused ids) fail as a batch; decode one by one
        texts = [_decode_or_empty(tok, i) for i in ids]
    return [i for i, text in zip(ids, texts) if text and text.isspace()]


def _decode_or_empty(tok: Any, token_id: int) -> str:
    try:
        return tok.decode([token_id], skip_special_tokens=False)
    except Exception:
        return ""
