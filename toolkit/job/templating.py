"""Rendering prompts through the chat template: a prompt's messages and tools to the exact
`input_ids` sent to the engine (`render`, `render_many` in batches of equal tools), or to its text
(`render_texts`, `text_renderer`) encoded apart (`encode_texts`); a prompt the template fails on is
a ChatError naming it. transformers is imported inside the functions that need it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from toolkit.errors import BadInputError

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


BATCH_SIZE = 256


class ChatError(BadInputError):
    """A tokenizer, chat template or prompt cannot be used; the message says which and what to
    do."""


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
