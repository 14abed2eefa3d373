"""The "model": token material taken from the job's tokenizer (EOS and think ids, the help-topics
corpus, tool-call sections per tokenizer family) and fast text for planned ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from toolkit.stub.config import LOG_PREFIX, StubConfig

logger = logging.getLogger(__name__)

# of the help-topics text, encoded once at start: plenty of distinct "reasoning"
CORPUS_CHARS = 160_000


TOOL_FORMATS = (
    (
        "kimi",
        (
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
        ),
        "<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>",
        "<|tool_call_begin|>functions.{name}:{i}"
        "<|tool_call_argument_begin|>{args}<|tool_call_end|>",
    ),
    (
        "qwen3",
        ("<tool_call>", "</tool_call>"),
        "{calls}",
        '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
    ),
    (
        "deepseek",
        (
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ),
        "<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
    ),
)
TOOL_CALLS = (
    (("get_weather", {"city": "Paris", "unit": "celsius"}),),
    (("search", {"query": "boiling point of water at altitude"}),),
    (("calculator", {"expression": "17 * 23 + 4"}),),
    (("get_weather", {"city": "Oslo"}), ("get_time", {"timezone": "Europe/Oslo"})),
    (("lookup", {"topic": "python context managers", "max_results": 3}),),
    (("run_python", {"code": "print(sum(range(10)))"}),),
)


class StubModel:
    """Token material of one tokenizer, loaded once at start; `planning.plan_output` turns it into
    outputs."""

    def __init__(self, cfg: StubConfig):
        from transformers import AutoTokenizer

        path = cfg.tokenizer_path or cfg.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=cfg.trust_remote_code
        )
        tok = self.tokenizer
        self.vocab_size = len(tok)
        self.model_config = _read_json(Path(cfg.model_path) / "config.json")
        config_eos = _ids(self.model_config.get("eos_token_id"))
        generation_eos = _ids(
            _read_json(Path(cfg.model_path) / "generation_config.json").get("eos_token_id")
        )
        tokenizer_eos = _ids(tok.eos_token_id)
        # SGLang's stop set: config.json and generation_config.json eos ids, plus the tokenizer's
        # eos unless the tokenizer is not initialised (SGLang's tokenizer manager with
        # --skip-tokenizer-init).
        self.eos_ids = frozenset(
            config_eos + generation_eos + ([] if cfg.skip_tokenizer_init else tokenizer_eos)
        )
        emitted = generation_eos or config_eos or tokenizer_eos
        if not emitted:
            raise SystemExit(
                f"{LOG_PREFIX} no eos_token_id in {path} (config.json, generation_config.json, "
                "tokenizer)"
            )
        self.eos_id = emitted[0]
        if self.eos_id not in self.eos_ids:
            logger.warning(
                "the EOS the stub emits (%d) is not a stop token in this mode; outputs run to "
                "max_new_tokens",
                self.eos_id,
            )
        self.think_start_id = self.single_id(cfg.think_start)
        self.think_end_id = self.single_id(cfg.think_end)
        if self.think_start_id is None or self.think_end_id is None:
            logger.warning(
                "%r/%r are not single tokens of this tokenizer: outputs have no reasoning section",
                cfg.think_start,
                cfg.think_end,
            )
            self.think_start_id = self.think_end_id = None
        self.sep_ids = tok.encode("\n\n", add_special_tokens=False)
        self.tool_family, self.tool_sections = self._tool_sections()
        control = (
            set(self.eos_ids) | {self.think_start_id, self.think_end_id} | set(tok.all_special_ids)
        )
        for section in self.tool_sections:
            control.update(
                t for t in section if self.tokenizer.convert_ids_to_tokens(t) in _TOOL_TOKENS
            )
        self._encode_corpus(_help_text(CORPUS_CHARS), control)
        self._newline_only: dict[int, bool] = {}
        self._segment_text: dict[tuple[tuple[int, ...], bool], str] = {}
        self._fast_decode = self._pick_decoder()
        # rewrites text across token boundaries
        cleanup = getattr(tok, "clean_up_tokenization_spaces", False)
        # text may be sliced from the corpus only where that gives exactly `decode`:
        # planning.load_model checks
        self.can_slice_text = self.cuts is not None and not cleanup
        self.fast_text = False

    def _encode_corpus(self, text: str, control: set) -> None:
        """Token ids of the help text, and where each token starts in it (for slicing text instead
        of decoding)."""
        tok = self.tokenizer
        self.corpus_text, self.cuts, self.unsafe_cuts = text, None, frozenset()
        try:
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        # slow or remote-code tokenizers have no offsets: decode instead
        except Exception:  # noqa: BLE001
            ids, offsets = tok.encode(text, add_special_tokens=False), None
        if any(t in control for t in ids):
            ids, offsets = [t for t in ids if t not in control], None
        self.corpus = ids
        self.corpus_ids = frozenset(ids)
        if offsets and len(offsets) == len(ids):
            # cut[i]: where token i starts (the end of token i-1); a cut inside one character is
            # unsafe.
            self.cuts = [0] + [end for _, end in offsets]
            self.unsafe_cuts = frozenset(
                i for i in range(1, len(ids)) if offsets[i][0] < offsets[i - 1][1]
            )

    def sliced_text(self, segments: list[tuple[int, list[int]]], k: int, skip: bool) -> str | None:
        """Text of the first k planned tokens from corpus-text slices, or None where a cut splits a
        character."""
        parts, cuts, unsafe = [], self.cuts, self.unsafe_cuts
        for start, ids in segments:
            if k <= 0:
                break
            m = min(k, len(ids))
            if start >= 0:
                if start in unsafe or start + m in unsafe:
                    return None
                parts.append(self.corpus_text[cuts[start] : cuts[start + m]])
            else:
                key = (tuple(ids[:m]), skip)
                text = self._segment_text.get(key)
                if text is None:
                    text = self._segment_text[key] = self.decode(ids[:m], skip)
                parts.append(text)
            k -= m
        return "".join(parts)

    def prefix_text(
        self, segments: list[tuple[int, list[int]]], planned: list[int], k: int, skip: bool
    ) -> str:
        """`decode(planned[:k])`, by slicing when that is known to give the same text."""
        if self.fast_text:
            text = self.sliced_text(segments, k, skip)
            if text is not None:
                return text
        return self.decode(planned[:k], skip)

    def single_id(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _tool_sections(self) -> tuple[str | None, list[list[int]]]:
        for family, tokens, section, call in TOOL_FORMATS:
            if all(self.single_id(t) is not None for t in tokens):
                out = []
                for calls in TOOL_CALLS:
                    body = "".join(
                        call.format(name=name, args=json.dumps(args), i=i)
                        for i, (name, args) in enumerate(calls)
                    )
                    out.append(
                        self.tokenizer.encode(section.format(calls=body), add_special_tokens=False)
                    )
                return family, out
        return None, []

    def _pick_decoder(self) -> Callable[[list[int], bool], str]:
        """The tokenizers backend's decode when it gives the same text as `tokenizer.decode` (it is
        faster)."""
        tok = self.tokenizer
        slow = lambda ids, skip: tok.decode(ids, skip_special_tokens=skip)  # noqa: E731
        raw = getattr(tok, "_tokenizer", None)
        if raw is None or getattr(tok, "clean_up_tokenization_spaces", False):
            return slow
        sample = self.corpus[:300] + [self.eos_id] + self.corpus[300:400]
        if self.think_end_id is not None:
            sample.insert(50, self.think_end_id)
        try:
            same = all(
                raw.decode(sample, skip_special_tokens=s) == slow(sample, s) for s in (True, False)
            )
        except Exception:  # noqa: BLE001 - any mismatch of APIs means: use the slow path
            same = False
        return (lambda ids, skip: raw.decode(ids, skip_special_tokens=skip)) if same else slow

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast_decode(ids, skip_special_tokens)

    def is_newline_only(self, token_id: int) -> bool:
        known = self._newline_only.get(token_id)
        if known is None:
            try:
                text = self.tokenizer.decode([token_id])
            # prompt ids are not range-checked (neither are they in SGLang)
            except Exception:  # noqa: BLE001
                text = ""
            known = self._newline_only[token_id] = bool(text) and not text.strip("\r\n")
        return known

    def prompt_ends_with(self, prompt: list[int], token_id: int | None) -> bool:
        """Whether the prompt ends with `token_id`, ignoring trailing newline-only tokens."""
        if token_id is None:
            return False
        for t in reversed(prompt[-16:]):
            if t == token_id:
                return True
            if not self.is_newline_only(t):
                return False
        return False


_TOOL_TOKENS = frozenset(t for _, tokens, _, _ in TOOL_FORMATS for t in tokens)


def _help_text(chars: int) -> str:
    """English prose shipped with Python (the pydoc help topics), in a fixed order."""
    from pydoc_data.topics import topics

    parts, total = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        total += len(topics[key])
        if total >= chars:
            break
    return "\n\n".join(parts)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise SystemExit(f"{LOG_PREFIX} {path} is not valid JSON ({e}); fix or remove it") from None
    return data if isinstance(data, dict) else {}
