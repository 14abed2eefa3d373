"""Tokenizer and chat template: what the model sees.

Owns loading a model's tokenizer the way the model itself is loaded, resolving the token ids that
records are split on (think start/end, tool-call section, eos), and rendering prompts to the exact
`input_ids` sent to the engine. transformers is imported inside the functions that need it, so
importing this module stays cheap.

The functions take duck-typed arguments: `model` is anything with the attributes of the job's
[model] table (path, tokenizer_path, trust_remote_code, chat_template, chat_template_kwargs,
think_start, think_end, tool_call_start); `prompt` is anything with id, dataset, line, messages and
tools.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from toolkit.errors import BadInputError
from toolkit.formats import records

logger = logging.getLogger(__name__)

# Tool-call section delimiters of known families: Kimi-K2, Qwen3 (and GLM), DeepSeek, MiniMax-M2.
TOOL_SECTIONS: dict[str, str] = {
    "<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
    "<tool_call>": "</tool_call>",
    "<｜tool▁calls▁begin｜>": "<｜tool▁calls▁end｜>",
    "<minimax:tool_call>": "</minimax:tool_call>",
}

# Arguments of apply_chat_template that the toolkit sets itself; chat_template_kwargs must not
# override them.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)

PROBE_MESSAGES = [{"role": "user", "content": "Hello."}]
BATCH_SIZE = 256


class ChatError(BadInputError):
    """A tokenizer, chat template or prompt cannot be used; the message says which and what to
    do."""


class TokenInfo(msgspec.Struct, frozen=True, dict=True):
    """Token ids of one tokenizer that the toolkit relies on."""

    think_start_id: int
    think_end_id: int
    # tokenizer eos, then config.json / generation_config.json eos_token_id, no duplicates
    eos_ids: list[int]
    tool_call_start_id: int | None
    tool_call_end_id: int | None
    vocab_size: int  # len(tokenizer): every id the tokenizer can produce, added tokens included
    opens_reasoning: bool  # the generation prompt of a probe conversation ends inside reasoning
    # ids that decode to whitespace only; skipped when looking at a prompt's last token
    blank_ids: list[int] = []
    template_knows_reasoning: bool = False  # the template's source writes or reads the think tokens
    # template variables that switch reasoning on or off (e.g. enable_thinking)
    thinking_kwargs: list[str] = []

    @functools.cached_property
    def blank(self) -> frozenset[int]:
        """`blank_ids` as a set, for the look-ups of every record."""
        return frozenset(self.blank_ids)


# Reasoning mode, in one place: how a rendered prompt leaves the model, read from its last
# meaningful token (`reasoning_mode`, `opens_reasoning`: the pre-flight, the worker's turns, the
# audit and the export), and whether a generated output is reasoning (`output_in_reasoning`: the
# audit and the export's --mode).
OPENED = "opened"  # the prompt ends with think-start: the template opened reasoning
CLOSED = "closed"  # the prompt ends with think-end: the template closed it (thinking
# switched off)
MODEL_OPENS = "model_opens"  # the prompt ends at the assistant header of a template that knows the
# think tokens: the model writes think-start itself (Qwen3, Kimi-K2-Thinking, GLM-4.6)
UNKNOWN = "unknown"  # a template that never mentions the think tokens: cannot tell
MODES = (OPENED, CLOSED, MODEL_OPENS, UNKNOWN)

# Template variables that switch reasoning, in the order a hint names them.
THINKING_VARIABLES = ("thinking", "enable_thinking", "reasoning", "enable_reasoning", "think")


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
        template_knows_reasoning=_mentions(tok.chat_template, (model.think_start, model.think_end)),
        thinking_kwargs=_thinking_variables(tok.chat_template),
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


def reasoning_mode(prompt_ids: bytes | Sequence[int], info: TokenInfo) -> str:
    """OPENED, CLOSED, MODEL_OPENS or UNKNOWN: where a rendered prompt (ids, or packed as records
    hold them) leaves the model, by its last token that is not whitespace only. Token ids decide,
    never text."""
    last = records.last_meaningful(prompt_ids, info.blank)
    if last is not None and last == info.think_start_id:
        return OPENED
    if last is not None and last == info.think_end_id:
        return CLOSED
    return MODEL_OPENS if info.template_knows_reasoning else UNKNOWN


def opens_reasoning(prompt_ids: bytes | Sequence[int], info: TokenInfo) -> bool:
    """Whether a rendered prompt (ids, or packed) ends inside reasoning: with think-start, ignoring
    trailing whitespace-only tokens (`reasoning_mode` OPENED)."""
    return reasoning_mode(prompt_ids, info) == OPENED


def output_in_reasoning(rec: records.Record, info: TokenInfo, opened: bool) -> bool:
    """Whether a record's output was generated in reasoning mode: its prompt opened reasoning
    (`opened`, from `opens_reasoning`), the model opened it (its first output id is think-start), or
    its ids hold the think-end id."""
    out = rec.output_ids
    return (
        opened
        or (len(out) >= 4 and records.id_at(out, 0) == info.think_start_id)
        or records.id_positions(out, info.think_end_id) is not None
    )


def thinking_hint(info: TokenInfo, on: bool) -> str:
    """What to set so the template switches reasoning on (or off): names the kwarg the template
    reads."""
    value = "true" if on else "false"
    if info.thinking_kwargs:
        name = info.thinking_kwargs[0]
        also = (
            f" (the template also reads {', '.join(info.thinking_kwargs[1:])})"
            if len(info.thinking_kwargs) > 1
            else ""
        )
        return f"set [model] chat_template_kwargs = {{ {name} = {value} }}{also}"
    return (
        "this template reads no thinking switch: use a chat template that "
        f"{'opens' if on else 'closes'} reasoning ([model] chat_template)"
    )


def _mentions(template: Any, texts: Sequence[str]) -> bool:
    sources = template.values() if isinstance(template, Mapping) else [template]
    return any(isinstance(src, str) and any(t and t in src for t in texts) for src in sources)


def _thinking_variables(template: Any) -> list[str]:
    """The variables among THINKING_VARIABLES that the template reads without defining them."""
    sources = [
        src
        for src in (template.values() if isinstance(template, Mapping) else [template])
        if isinstance(src, str)
    ]
    found: set[str] = set()
    import jinja2
    from jinja2 import meta

    # transformers renders with loop controls ({% break %}, used by Kimi-K2-Thinking's template) and
    # its own {% generation %} tag; a template this environment still cannot parse is searched for
    # the names as words.
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    for src in sources:
        try:
            found |= meta.find_undeclared_variables(env.parse(src))
        except jinja2.TemplateError:
            found |= {
                v for v in THINKING_VARIABLES if re.search(rf"(?<![\w.'\"]){v}(?![\w'\"])", src)
            }
    return [v for v in THINKING_VARIABLES if v in found]


def render(tok: Any, model: Any, prompt: Any) -> list[int]:
    """The input_ids of one prompt: its messages and tools through the chat template, with the
    generation prompt."""
    try:
        return _render_one(tok, model, prompt.messages, prompt.tools)
    except Exception as exc:
        raise _prompt_error(prompt, exc) from exc


def render_many(
    tok: Any, model: Any, prompts: Iterable[Any], *, batch_size: int = BATCH_SIZE
) -> list[list[int]]:
    """render() for many prompts: the same ids, in the same order, faster.

    Prompts with equal tools are rendered together, `batch_size` per apply_chat_template call, so
    their text is encoded in one parallel batch. When a batch fails, its prompts are rendered one by
    one to name the failing one.
    """
    prompts = list(prompts)
    groups: dict[Any, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(_tools_key(prompt.tools), []).append(index)
    out: list[list[int]] = [[] for _ in prompts]
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            for index, ids in zip(chunk, _render_batch(tok, model, [prompts[i] for i in chunk])):
                out[index] = ids
    return out


def render_texts(
    tok: Any, model: Any, prompts: Iterable[Any], *, batch_size: int = BATCH_SIZE
) -> list[str]:
    """The rendered text of many prompts, the text render_many encodes (`encode_texts` gives the
    same ids), in the same order; raises ChatError naming the first prompt the template fails on."""
    prompts = list(prompts)
    groups: dict[Any, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(_tools_key(prompt.tools), []).append(index)
    out: list[str] = [""] * len(prompts)
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            chunk = [prompts[i] for i in indices[start : start + batch_size]]
            try:
                texts = _apply_text(tok, model, [p.messages for p in chunk], chunk[0].tools)
                if isinstance(texts, str):
                    texts = [texts]
                if len(texts) != len(chunk):
                    raise ValueError(f"{len(texts)} results for {len(chunk)} conversations")
            except Exception:
                texts = []
                for p in chunk:
                    try:
                        texts.append(_apply_text(tok, model, p.messages, p.tools))
                    except Exception as exc:
                        raise _prompt_error(p, exc) from exc
            for index, text in zip(indices[start : start + batch_size], texts):
                out[index] = text
    return out


def text_renderer(tok: Any, model: Any) -> Any:
    """A function (messages, tools) -> the text render_texts gives for a prompt read from a JSONL
    line (plain JSON values), without apply_chat_template's work per call: the same compiled
    template, called with what transformers passes it (its special tokens, the kwargs, messages
    without None values and with reasoning fields aliased). None when this transformers lacks those
    parts. The pre-flight compares its text with render_texts' on a prompt of every slice it
    renders, and uses it only where they agree."""
    try:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
        )
    except ImportError:
        return None
    kwargs = {**tok.special_tokens_map, **model.chat_template_kwargs}
    compiled: dict[bool, Any] = {}

    def render(messages: list[dict], tools: list[dict] | None) -> str:
        key = tools is not None
        template = compiled.get(key)
        if template is None:
            template = compiled[key] = _compile_jinja_template(tok.get_chat_template(None, tools))
        chat = _alias_reasoning_fields(
            [{k: v for k, v in m.items() if v is not None} for m in messages]
        )
        return template.render(
            messages=chat, tools=tools, documents=None, add_generation_prompt=True, **kwargs
        )

    return render


def encode_texts(tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of texts from render_texts: the ids render() gives for their prompts."""
    return _encode_chats(tok, texts) if texts else []


def _apply_text(tok: Any, model: Any, conversations: Any, tools: Any) -> Any:
    return tok.apply_chat_template(
        conversations,
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
        **model.chat_template_kwargs,
    )


def _tools_key(tools: Any) -> Any:
    if tools is None:
        return None
    try:
        return msgspec.json.encode(tools)
    except (TypeError, msgspec.EncodeError):
        return ("unencodable", id(tools))


def _render_batch(tok: Any, model: Any, batch: list[Any]) -> list[list[int]]:
    if len(batch) == 1:
        return [render(tok, model, batch[0])]
    try:
        texts = tok.apply_chat_template(
            [p.messages for p in batch],
            tools=batch[0].tools,
            add_generation_prompt=True,
            tokenize=False,
            **model.chat_template_kwargs,
        )
        rows = _encode_chats(tok, texts)
        if len(rows) != len(batch):
            raise ValueError(f"{len(rows)} results for {len(batch)} conversations")
    except Exception:
        return [render(tok, model, p) for p in batch]  # raises for the first failing prompt
    return rows


def _encode_chats(tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered chats, exactly as apply_chat_template(tokenize=True) makes them: the
    tokenizer called on the text with add_special_tokens=False (the template writes its own special
    tokens).

    A fast tokenizer whose backend has no truncation, no padding and special tokens kept whole (what
    that call sets up) encodes the batch directly, skipping the offsets and Python dicts the call
    builds per text; any other tokenizer goes through the call itself.
    """
    backend = getattr(tok, "backend_tokenizer", None)
    if (
        backend is None
        or backend.truncation is not None
        or backend.padding is not None
        or getattr(backend, "encode_special_tokens", False)
        or getattr(tok, "split_special_tokens", False)
    ):
        return [_as_ids(row) for row in tok(texts, add_special_tokens=False)["input_ids"]]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _render_one(tok: Any, model: Any, messages: list[dict], tools: list[dict] | None) -> list[int]:
    result = tok.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **model.chat_template_kwargs,
    )
    return _as_ids(_unwrap(result))


def _unwrap(result: Any) -> Any:
    """input_ids of apply_chat_template output, which is a list, or a dict/BatchEncoding holding
    input_ids."""
    if isinstance(result, Mapping):
        result = result["input_ids"]
    return result.tolist() if hasattr(result, "tolist") else result


def _as_ids(value: Any) -> list[int]:
    """A plain list of ints (raises TypeError for anything that is not a flat sequence of
    integers)."""
    if type(value) is list and (not value or type(value[0]) is int):
        return value
    return [int(i) for i in value]


def _prompt_error(prompt: Any, exc: Exception) -> ChatError:
    return ChatError(
        f"{prompt.dataset} line {prompt.line} (id {prompt.id!r}): the chat template failed: "
        f"{type(exc).__name__}: {exc}; fix this prompt's messages/tools or the [model] chat "
        "template"
    )


def _check_kwargs(model: Any) -> None:
    clash = sorted(RESERVED_KWARGS.intersection(model.chat_template_kwargs))
    if clash:
        raise ChatError(
            f"[model] chat_template_kwargs sets {', '.join(clash)}, which the toolkit sets itself; "
            f"remove {'it' if len(clash) == 1 else 'them'} from chat_template_kwargs"
        )


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
