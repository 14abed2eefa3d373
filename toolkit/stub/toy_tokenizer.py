"""Small real Hugging Face tokenizers for the demo job and the tests.

`build_tokenizer` trains a byte-level BPE on English text that ships with Python (the pydoc topics),
adds the control tokens of one model family so that each encodes to exactly one id, attaches a chat
template, and writes a folder that looks like a model folder to
`transformers.AutoTokenizer.from_pretrained`: tokenizer.json, tokenizer_config.json (with the chat
template), config.json and generation_config.json (with `eos_token_id`). The same arguments always
give the same files.

Families, and the real chat templates (as the models ship them) each one renders with single-token
specials:

    kimi           Kimi-K2.5 (own template: templates/chat/kimi.jinja)
    kimi-thinking  Kimi-K2-Thinking (kimi's tokens plus the media tokens its template writes)
    qwen3          Qwen3 (own template: templates/chat/qwen3.jinja; also Qwen3's real template)
    deepseek       DeepSeek-R1 and its distills (own template: templates/chat/deepseek.jinja; also
                   the real one)
    deepseek-v3    DeepSeek-V3.1 (deepseek's tokens)
    glm            GLM-4.5 / GLM-4.6
    minimax        MiniMax-M2

The families without an own template need `chat_template=` (the model's template source).
`extra_special` adds more control tokens (special, one id each) for a template that writes tokens no
family has.

    python -m toolkit.stub.toy_tokenizer --family kimi OUT_DIR
    python -m toolkit.stub.toy_tokenizer --family glm --chat-template glm-4.6.jinja OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates" / "chat"
MIN_VOCAB = 512
MAX_VOCAB = 8192  # the corpus yields about 9,200 BPE merges; ids stay far below 65,536


class Family(msgspec.Struct, frozen=True):
    """Control tokens and eos wiring of one model family."""

    special: tuple[str, ...]  # control tokens marked special (dropped by skip_special_tokens)
    plain: tuple[str, ...]  # control tokens kept in decoded text, like real think/tool tokens
    eos: str  # the tokenizer's eos_token
    bos: str | None
    pad: str | None
    config_eos: tuple[str, ...]  # eos_token_id of config.json (one entry -> int, several -> list)
    generation_eos: tuple[str, ...]  # eos_token_id of generation_config.json
    template: str | None = None  # file of templates/chat/ used when no chat_template is given


# Qwen3's reasoning and tool tags, plain tokens; GLM's are the same and more.
_THINK_AND_TOOL_TAGS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
FAMILIES: dict[str, Family] = {
    # Kimi-K2.5: the template opens <think>; config.json names [EOS] although the turn ends with
    # <|im_end|>.
    "kimi": Family(
        special=(
            "[BOS]",
            "[EOS]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
        ),
        plain=(
            "<think>",
            "</think>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        eos="<|im_end|>",
        bos="[BOS]",
        pad=None,
        config_eos=("[EOS]",),
        generation_eos=("<|im_end|>",),
        template="kimi.jinja",
    ),
    # Qwen3: the model writes <think> itself; generation_config.json lists <|im_end|> and
    # <|endoftext|>.
    "qwen3": Family(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        plain=_THINK_AND_TOOL_TAGS,
        eos="<|im_end|>",
        bos=None,
        pad="<|endoftext|>",
        config_eos=("<|im_end|>",),
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        template="qwen3.jinja",
    ),
    # DeepSeek-R1: the generation prompt ends with <｜Assistant｜><think>\n.
    "deepseek": Family(
        special=(
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
        ),
        plain=(
            "<think>",
            "</think>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ),
        eos="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        config_eos=("<｜end▁of▁sentence｜>",),
        generation_eos=("<｜end▁of▁sentence｜>",),
        template="deepseek.jinja",
    ),
}
# Kimi-K2-Thinking: the model writes <think> itself; its template also writes media placeholders.
FAMILIES["kimi-thinking"] = msgspec.structs.replace(
    FAMILIES["kimi"],
    special=FAMILIES["kimi"].special
    + ("<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"),
    template=None,
)
# DeepSeek-V3.1: the tokens of R1; its template closes reasoning unless `thinking` is set.
FAMILIES["deepseek-v3"] = msgspec.structs.replace(FAMILIES["deepseek"], template=None)
# GLM-4.5 / 4.6: the model writes <think> itself; every turn marker also stops generation.
FAMILIES["glm"] = Family(
    special=(
        "<|endoftext|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
    ),
    plain=(
        *_THINK_AND_TOOL_TAGS,
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "/nothink",
    ),
    eos="<|endoftext|>",
    bos=None,
    pad="<|endoftext|>",
    config_eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
)
# MiniMax-M2: the template opens <think>; turns are ]~b]role ... [e~[.
FAMILIES["minimax"] = Family(
    special=("]~!b[", "]~b]", "[e~[", "]!p~[", "]!d~["),
    plain=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    eos="[e~[",
    bos="]~!b[",
    pad=None,
    config_eos=("[e~[",),
    generation_eos=("[e~[",),
)


def corpus() -> list[str]:
    """English training text shipped with Python: the pydoc help topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def default_template(family: str) -> str:
    name = FAMILIES[family].template if family in FAMILIES else f"{family}.jinja"
    if name is None:
        raise ValueError(
            f"tokenizer family {family!r} has no template of its own; pass chat_template= (the "
            "model's chat template source)"
        )
    path = TEMPLATES_DIR / name
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"chat template {path} is missing; pass chat_template= or restore the file"
        ) from None


def build_tokenizer(
    out_dir: str | Path,
    family: str,
    *,
    vocab_size: int = 4000,
    chat_template: str | None = None,
    extra_special: tuple[str, ...] | list[str] = (),
) -> Path:
    """Train and save a toy tokenizer of `family` into `out_dir`; return the folder.

    `vocab_size` counts every id, control tokens included. `chat_template` is Jinja source; None
    uses the family's own template in templates/chat/. `extra_special` adds control tokens (special,
    one id each) after the family's.
    """
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise ValueError(
            f"unknown tokenizer family {family!r}; choose one of {', '.join(FAMILIES)}"
        )
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is out of range; use {MIN_VOCAB}..{MAX_VOCAB}")
    spec = FAMILIES[family]
    template = default_template(family) if chat_template is None else chat_template
    extra = tuple(t for t in dict.fromkeys(extra_special) if t not in spec.special + spec.plain)
    if extra:
        spec = msgspec.structs.replace(spec, special=spec.special + extra)
    bpe = _train_bpe(spec, vocab_size)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        chat_template=template,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # template inside tokenizer_config.json, readable by any version
    tok.save_pretrained(out, save_jinja_files=False)
    _portable_config(out / "tokenizer_config.json")
    _compact(out / "tokenizer.json")
    _write_model_configs(out, tok, spec)
    logger.info("built %s tokenizer with %d ids in %s", family, len(tok), out)
    return out


def _train_bpe(spec: Family, vocab_size: int):
    """A byte-level BPE trained on the corpus to `vocab_size` ids, the family's control tokens
    included (added after the learned vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    n_control = len(spec.special) + len(spec.plain)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_control,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    if bpe.get_vocab_size() != vocab_size - n_control:
        raise ValueError(
            f"training gave {bpe.get_vocab_size()} tokens instead of {vocab_size - n_control}"
        )
    # Control tokens go after the learned vocabulary, as in real models; none of them is normalized
    # or split.
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    return bpe


def _write_model_configs(out: Path, tok, spec: Family) -> None:
    """config.json and generation_config.json, with the family's BOS and EOS ids."""

    def ids(tokens: tuple[str, ...]) -> int | list[int]:
        found = [tok.convert_tokens_to_ids(t) for t in tokens]
        return found[0] if len(found) == 1 else found

    bos_id = tok.convert_tokens_to_ids(spec.bos) if spec.bos else None
    config = {"bos_token_id": bos_id, "eos_token_id": ids(spec.config_eos), "vocab_size": len(tok)}
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": ids(spec.generation_eos)},
    )


def _portable_config(path: Path) -> None:
    """Name the generic fast-tokenizer class, which transformers 4.x and 5.x both load from
    tokenizer.json."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    _write_json(path, config)


def _compact(path: Path) -> None:
    """Rewrite a JSON file without indentation (same content, less than half the size)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(
        json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.stub.toy_tokenizer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument(
        "--chat-template", type=Path, help="Jinja file to use instead of the family's template"
    )
    parser.add_argument(
        "--extra-special",
        action="append",
        default=[],
        metavar="TOKEN",
        help="one more control token (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
        out = build_tokenizer(
            args.out_dir,
            args.family,
            vocab_size=args.vocab_size,
            chat_template=template,
            extra_special=args.extra_special,
        )
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{args.family} tokenizer written to {out} ({size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
