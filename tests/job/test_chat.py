"""toolkit.job.chat and toolkit.stub.toy_tokenizer on real tokenizers of the three families, built into tmp dirs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from toolkit.job import chat
from toolkit.job.chat import ChatError
from toolkit.job.schema import ModelSpec as Model
from toolkit.stub.toy_tokenizer import build_tokenizer
from toolkit.stub.toy_tokenizer import main as toy_tokenizer_cli

ROOT = Path(__file__).resolve().parents[2]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
]
OPENING = {
    "kimi": "<|tool_calls_section_begin|>",
    "qwen3": "<tool_call>",
    "deepseek": "<｜tool▁calls▁begin｜>",
}
CLOSING = {
    "kimi": "<|tool_calls_section_end|>",
    "qwen3": "</tool_call>",
    "deepseek": "<｜tool▁calls▁end｜>",
}
EOS = {"kimi": "<|im_end|>", "qwen3": "<|im_end|>", "deepseek": "<｜end▁of▁sentence｜>"}


class Prompt(msgspec.Struct):
    """Mirror of toolkit.job.inputs.Prompt."""

    id: str
    dataset: str
    line: int
    messages: list[dict]
    tools: list[dict] | None = None


def prompt(
    text: str = "What is 2 + 2?", *, id: str = "p1", line: int = 1, tools=None, messages=None
) -> Prompt:
    messages = messages or [{"role": "user", "content": text}]
    return Prompt(id=id, dataset="demo.jsonl", line=line, messages=messages, tools=tools)


@pytest.fixture(scope="module")
def loaded(toy_tokenizer):
    """`loaded(family, **model_fields)` -> (model, tokenizer, TokenInfo)."""
    cache: dict = {}

    def get(family: str, **fields):
        key = (family, json.dumps(fields, sort_keys=True))
        if key not in cache:
            model = Model(path=str(toy_tokenizer(family)), **fields)
            tok = chat.load_tokenizer(model)
            cache[key] = (model, tok, chat.token_info(tok, model))
        return cache[key]

    return get


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


# --- rendering and reasoning -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "kwargs", "opens"),
    [
        ("kimi", {}, True),
        ("kimi", {"thinking": True}, True),
        ("kimi", {"thinking": False}, False),
        ("qwen3", {}, False),
        ("qwen3", {"enable_thinking": True}, False),
        ("qwen3", {"enable_thinking": False}, False),
        ("deepseek", {}, True),
    ],
)
def test_generation_prompt_opens_reasoning_only_where_the_template_does(
    loaded, family, kwargs, opens
):
    model, tok, info = loaded(family, chat_template_kwargs=kwargs)
    ids = chat.render(tok, model, prompt())
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert chat.opens_reasoning(ids, info) is opens
    assert info.opens_reasoning is opens
    last = [i for i in ids if i not in info.blank_ids][-1]
    assert (last == info.think_start_id) is opens
    assert tok.decode(ids).count("Hello.") == 0  # the probe conversation does not leak into prompts
    assert "What is 2 + 2?" in tok.decode(ids)


def test_exact_generation_prompt_tails(loaded):
    model, tok, info = loaded("kimi")
    assert chat.render(tok, model, prompt())[-1] == info.think_start_id
    model, tok, info = loaded("kimi", chat_template_kwargs={"thinking": False})
    assert chat.render(tok, model, prompt())[-2:] == [info.think_start_id, info.think_end_id]
    model, tok, info = loaded("deepseek")
    ids = chat.render(tok, model, prompt())
    assert (
        ids[-2] == info.think_start_id and tok.decode(ids[-1:]) == "\n"
    )  # the newline is skipped as blank
    model, tok, info = loaded("qwen3")
    ids = chat.render(tok, model, prompt())
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and info.think_start_id not in ids
    model, tok, info = loaded("qwen3", chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(ids := chat.render(tok, model, prompt())).endswith("<think>\n\n</think>\n\n")
    assert [i for i in ids if i not in info.blank_ids][-1] == info.think_end_id


def test_earlier_assistant_turns_have_empty_think(loaded):
    history = [
        {"role": "user", "content": "Name a prime."},
        {
            "role": "assistant",
            "content": "Seven.",
            "reasoning_content": "Small primes: 2, 3, 5, 7.",
        },
        {"role": "user", "content": "Another?"},
    ]
    for family, turn in (
        ("kimi", "<|im_assistant|>assistant<|im_middle|><think></think>Seven.<|im_end|>"),
        ("qwen3", "<|im_start|>assistant\nSeven.<|im_end|>"),
        ("deepseek", "<｜Assistant｜>Seven.<｜end▁of▁sentence｜>"),
    ):
        model, tok, _ = loaded(family)
        text = tok.decode(chat.render(tok, model, prompt(messages=history)))
        assert turn in text and "Small primes" not in text, family


def _info(knows: bool = True) -> chat.TokenInfo:
    return chat.TokenInfo(
        think_start_id=7,
        think_end_id=8,
        eos_ids=[2],
        tool_call_start_id=None,
        tool_call_end_id=None,
        vocab_size=100,
        opens_reasoning=True,
        blank_ids=[9, 10],
        template_knows_reasoning=knows,
    )


def test_reasoning_mode_has_one_home_for_prompts_lists_and_packed_alike():
    """chat.reasoning_mode / opens_reasoning: the pre-flight, the worker's turns, the audit and the export all ask
    it; a list of ids and the packed ids a record holds give the same answer."""
    from toolkit.formats.records import pack_ids

    info = _info()
    cases = [
        ([1, 2, 7, 9, 10], chat.OPENED),
        ([7], chat.OPENED),
        ([3, 7, 10, 10, 10], chat.OPENED),
        ([1, 7, 8, 9], chat.CLOSED),
        ([1, 7, 5], chat.MODEL_OPENS),
        ([], chat.MODEL_OPENS),
        ([9, 10, 9], chat.MODEL_OPENS),
    ]
    for ids, mode in cases:
        assert chat.reasoning_mode(ids, info) == chat.reasoning_mode(pack_ids(ids), info) == mode, (
            ids
        )
        assert (
            chat.opens_reasoning(ids, info)
            is chat.opens_reasoning(pack_ids(ids), info)
            is (mode == chat.OPENED)
        )
    assert chat.reasoning_mode([1, 7, 5], _info(knows=False)) == chat.UNKNOWN
    assert chat.reasoning_mode([1, 7, 8], _info(knows=False)) == chat.CLOSED
    assert (
        info.blank == frozenset({9, 10})
        and msgspec.json.decode(msgspec.json.encode(info), type=chat.TokenInfo) == info
    )


def test_an_output_is_reasoning_when_the_prompt_or_the_model_opened_it_or_it_holds_the_think_end():
    from toolkit.formats.records import OK, Record, pack_ids

    info = _info()

    def rec(output: list[int]) -> Record:
        return Record(
            "a",
            "d",
            0,
            OK,
            pack_ids([1, 5]),
            pack_ids(output),
            output.index(8) if 8 in output else None,
            None,
            "stop",
            2,
            2,
            len(output),
            0,
            0.1,
            1,
        )

    assert chat.output_in_reasoning(rec([5, 6, 2]), info, opened=True)  # the template opened it
    assert chat.output_in_reasoning(
        rec([7, 5, 8, 6, 2]), info, opened=False
    )  # the model wrote think-start
    assert chat.output_in_reasoning(
        rec([5, 8, 6, 2]), info, opened=False
    )  # a think-end: it was reasoning
    assert not chat.output_in_reasoning(
        rec([5, 6, 7, 2]), info, opened=False
    )  # a think-start later is not
    assert not chat.output_in_reasoning(rec([]), info, opened=False)


def test_opens_reasoning_skips_only_blank_tokens(loaded):
    _, tok, info = loaded("deepseek")
    newline = tok.encode("\n", add_special_tokens=False)
    word = tok.encode("the", add_special_tokens=False)
    assert chat.opens_reasoning([5, info.think_start_id] + newline * 3, info)
    assert not chat.opens_reasoning([5, info.think_start_id] + word, info)
    assert not chat.opens_reasoning([info.think_start_id, info.think_end_id], info)
    assert not chat.opens_reasoning(newline, info)
    assert not chat.opens_reasoning([], info)


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_blank_ids_are_the_ids_that_decode_to_whitespace(loaded, family):
    _, tok, info = loaded(family)
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(len(tok))]
    expected = [i for i, text in enumerate(texts) if text and text.isspace()]
    assert info.blank_ids == expected and len(expected) >= 2  # at least a space and a newline


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_think_ids_are_single_tokens(loaded, family):
    _, tok, info = loaded(family)
    for text, token_id in (("<think>", info.think_start_id), ("</think>", info.think_end_id)):
        assert tok.encode(text, add_special_tokens=False) == [token_id]
        assert tok.decode([token_id]) == text
    assert info.think_start_id != info.think_end_id
    assert info.vocab_size == len(tok) == 4000


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_tool_call_ids_are_located(loaded, family):
    model, tok, info = loaded(family)
    assert tok.decode([info.tool_call_start_id]) == OPENING[family]
    assert tok.decode([info.tool_call_end_id]) == CLOSING[family]
    ids = chat.render(tok, model, prompt(messages=TOOL_TURN, tools=TOOLS))
    assert info.tool_call_start_id in ids and info.tool_call_end_id in ids


def test_explicit_tool_call_start_and_its_closing_token(loaded):
    _, tok, info = loaded("kimi", tool_call_start="<|tool_call_begin|>")
    assert tok.decode([info.tool_call_start_id]) == "<|tool_call_begin|>"
    assert tok.decode([info.tool_call_end_id]) == "<|tool_call_end|>"
    _, tok, info = loaded("qwen3", tool_call_start="<tool_response>")
    assert tok.decode([info.tool_call_end_id]) == "</tool_response>"


def test_tool_call_start_that_is_not_one_token_is_an_error(toy_tokenizer):
    model = Model(path=str(toy_tokenizer("qwen3")), tool_call_start="<function_call>")
    with pytest.raises(
        ChatError, match=r"tool_call_start = '<function_call>' is not a single token"
    ):
        chat.token_info(chat.load_tokenizer(model), model)


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_eos_ids_are_the_tokenizers_and_the_model_folders(loaded, family):
    model, tok, info = loaded(family)
    folder = Path(model.path)
    from_files = []
    for name in ("config.json", "generation_config.json"):
        value = json.loads((folder / name).read_text())["eos_token_id"]
        from_files += value if isinstance(value, list) else [value]
    assert info.eos_ids[0] == tok.eos_token_id == tok.convert_tokens_to_ids(EOS[family])
    assert set(info.eos_ids) == {tok.eos_token_id, *from_files}
    assert len(info.eos_ids) == len(set(info.eos_ids))
    if family == "kimi":  # config.json names [EOS], which the tokenizer's eos (<|im_end|>) is not
        assert tok.convert_tokens_to_ids("[EOS]") in info.eos_ids
    if family == "qwen3":  # generation_config.json holds a list
        assert tok.convert_tokens_to_ids("<|endoftext|>") in info.eos_ids


def test_eos_ids_come_from_model_path_not_tokenizer_path(toy_tokenizer, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    (weights / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 11]}))
    model = Model(path=str(weights), tokenizer_path=str(toy_tokenizer("kimi")))
    tok = chat.load_tokenizer(model)
    assert chat.token_info(tok, model).eos_ids == [tok.eos_token_id, 7, 9, 11]


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_tools_appear_in_the_rendering(loaded, family):
    model, tok, _ = loaded(family)
    plain = tok.decode(chat.render(tok, model, prompt()))
    with_tools = tok.decode(chat.render(tok, model, prompt(tools=TOOLS)))
    for text in ("get_weather", "Current weather of a city.", '"city"'):
        assert text in with_tools and text not in plain


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
@pytest.mark.parametrize("setup", ["default", "split_special_tokens", "backend_truncation"])
def test_render_many_equals_render(loaded, family, setup):
    """Batches encode straight through the fast backend, or through the tokenizer call when the backend is set
    up otherwise: either way the ids are apply_chat_template(tokenize=True)'s, one prompt at a time."""
    model, shared, _ = loaded(family)
    tok = chat.load_tokenizer(model)  # a private copy: the setups below change it
    if setup == "split_special_tokens":
        tok.split_special_tokens = True
    elif setup == "backend_truncation":
        tok.backend_tokenizer.enable_truncation(max_length=8)
    other_tools = [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    prompts = [
        prompt(
            f"question {i} <think> not a tag </think>",
            id=f"p{i}",
            line=i + 1,
            tools=[None, TOOLS, other_tools][i % 5 % 3],
        )
        for i in range(11)
    ] + [prompt(messages=TOOL_TURN, tools=TOOLS, id="tool-turn")]
    batched = chat.render_many(
        tok, model, prompts, batch_size=3
    )  # first, on the tokenizer as set up
    one_by_one = [chat.render(tok, model, p) for p in prompts]
    assert batched == one_by_one
    differs = one_by_one != [chat.render(shared, model, p) for p in prompts]
    assert differs == (setup == "split_special_tokens")  # the setup mattered, and was followed
    assert chat.render_many(tok, model, prompts) == one_by_one
    assert len({tuple(ids) for ids in one_by_one}) == len(prompts)


def test_render_many_names_the_failing_prompt_inside_a_batch(loaded):
    model, tok, _ = loaded("kimi")
    prompts = [prompt(id=f"p{i}", line=i + 1) for i in range(5)]
    prompts[3] = prompt(
        id="bad", line=4, messages=[{"role": "narrator", "content": "Once upon a time"}]
    )
    with pytest.raises(ChatError, match=r"demo.jsonl line 4 \(id 'bad'\).*unknown role narrator"):
        chat.render_many(tok, model, prompts)


# --- errors ------------------------------------------------------------------------------------------------------


def test_missing_tokenizer_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(
        ChatError, match=rf"tokenizer folder {missing} does not exist \(\[model\] path\)"
    ):
        chat.load_tokenizer(Model(path=str(missing)))
    with pytest.raises(ChatError, match=r"\[model\] tokenizer_path"):
        chat.load_tokenizer(Model(path=str(tmp_path), tokenizer_path=str(missing)))


def test_folder_without_tokenizer_files(tmp_path):
    with pytest.raises(ChatError, match=rf"cannot load a tokenizer from {tmp_path}"):
        chat.load_tokenizer(Model(path=str(tmp_path)))


def test_missing_chat_template_file(toy_tokenizer, tmp_path):
    missing = tmp_path / "nope.jinja"
    with pytest.raises(ChatError, match=rf"chat template file {missing} cannot be read"):
        chat.load_tokenizer(Model(path=str(toy_tokenizer("kimi")), chat_template=str(missing)))


def test_chat_template_file_overrides_the_tokenizers(toy_tokenizer, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}<think>{{ '\\n' }}"
    )
    model = Model(path=str(toy_tokenizer("qwen3")), chat_template=str(template))
    tok = chat.load_tokenizer(model)
    info = chat.token_info(tok, model)
    ids = chat.render(tok, model, prompt("hi"))
    assert tok.decode(ids) == "hi<|im_end|><think>\n"
    assert info.opens_reasoning  # the qwen3 template itself does not open reasoning


def test_tokenizer_without_chat_template(toy_tokenizer, tmp_path):
    folder = copy_of(toy_tokenizer("kimi"), tmp_path)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        ChatError, match=rf"tokenizer in {folder} has no chat template; set \[model\] chat_template"
    ):
        chat.load_tokenizer(Model(path=str(folder)))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("think_end", "</thinking>"),
        ("think_start", "<reasoning>"),
        ("think_start", "Ġthe"),  # a vocabulary entry, but the text "Ġthe" encodes to other tokens
    ],
)
def test_think_token_that_is_not_one_token(loaded, key, value):
    model, tok, _ = loaded("kimi")
    if value == "Ġthe":
        assert isinstance(tok.convert_tokens_to_ids(value), int)
    bad = msgspec.structs.replace(model, **{key: value})
    with pytest.raises(ChatError) as err:
        chat.token_info(tok, bad)
    message = str(err.value)
    assert f"[model] {key} = {value!r} is not a single token" in message
    assert str(tok.encode(value, add_special_tokens=False)) in message
    assert f"set {key} in the [model] table" in message


def test_same_think_start_and_end_is_an_error(loaded):
    model, tok, _ = loaded("kimi")
    with pytest.raises(ChatError, match="are the same token"):
        chat.token_info(tok, msgspec.structs.replace(model, think_end="<think>"))


def test_template_raising_names_the_prompt(loaded):
    model, tok, _ = loaded("qwen3")
    bad = prompt(
        id="x-17",
        line=17,
        messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    )
    with pytest.raises(
        ChatError, match=r"demo.jsonl line 17 \(id 'x-17'\): the chat template failed: .*system"
    ):
        chat.render(tok, model, bad)


def test_template_failing_on_the_probe(toy_tokenizer, tmp_path):
    template = tmp_path / "raises.jinja"
    template.write_text("{{ raise_exception('this template needs a system message') }}")
    model = Model(path=str(toy_tokenizer("kimi")), chat_template=str(template))
    tok = chat.load_tokenizer(model)
    with pytest.raises(
        ChatError, match="fails on a one-message probe conversation.*needs a system message"
    ):
        chat.token_info(tok, model)


def test_reserved_chat_template_kwargs(toy_tokenizer):
    model = Model(
        path=str(toy_tokenizer("kimi")), chat_template_kwargs={"tokenize": False, "thinking": True}
    )
    with pytest.raises(
        ChatError, match="chat_template_kwargs sets tokenize, which the toolkit sets itself"
    ):
        chat.load_tokenizer(model)


def test_importing_chat_does_not_import_transformers():
    code = "import sys, toolkit.job.chat; print('transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


# --- toy tokenizers ----------------------------------------------------------------------------------------------


def test_toy_tokenizer_is_deterministic_and_small(toy_tokenizer, tmp_path):
    first = toy_tokenizer("deepseek")
    again = build_tokenizer(tmp_path / "again", "deepseek")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert sum((first / n).stat().st_size for n in names) < 1_000_000


def test_control_tokens_special_flags(loaded):
    _, tok, info = loaded("kimi")
    ids = tok.encode(
        "<|im_user|>hi<think>x</think><|tool_calls_section_begin|><|im_end|>",
        add_special_tokens=False,
    )
    assert len(ids) == 7
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "hi<think>x</think><|tool_calls_section_begin|>"
    )
    assert max(ids) < 65536 and info.vocab_size < 65536


def test_toy_tokenizer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer family 'llama'"):
        build_tokenizer(tmp_path, "llama")
    with pytest.raises(ValueError, match="vocab_size 100000 is out of range"):
        build_tokenizer(tmp_path, "kimi", vocab_size=100_000)
    assert not any(tmp_path.iterdir())


def test_toy_tokenizer_cli_and_vocab_size(tmp_path, capsys):
    assert (
        toy_tokenizer_cli(["--family", "qwen3", "--vocab-size", "1000", str(tmp_path / "q")]) == 0
    )
    assert "qwen3 tokenizer written to" in capsys.readouterr().out
    model = Model(path=str(tmp_path / "q"))
    tok = chat.load_tokenizer(model)
    info = chat.token_info(tok, model)
    assert info.vocab_size == len(tok) == 1000 and info.think_end_id < 1000


def test_demo_tokenizer_is_the_kimi_toy(toy_tokenizer):
    from transformers import AutoTokenizer

    demo = ROOT / "jobs" / "demo" / "tokenizer"
    fresh = toy_tokenizer("kimi")
    stale = f"{demo} is stale; regenerate it with python -m toolkit.stub.toy_tokenizer --family kimi {demo}"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((demo / name).read_text()) == json.loads((fresh / name).read_text()), (
            stale
        )
    old, new = AutoTokenizer.from_pretrained(demo), AutoTokenizer.from_pretrained(fresh)
    assert old.get_vocab() == new.get_vocab(), stale
    assert old.chat_template == new.chat_template, stale
    assert (
        (old.bos_token, old.eos_token) == (new.bos_token, new.eos_token) == ("[BOS]", "<|im_end|>")
    )
    flags = {t.content: t.special for t in old.added_tokens_decoder.values()}
    assert flags == {t.content: t.special for t in new.added_tokens_decoder.values()}, stale
    text = "A <think>b</think> c\n\n  d<|im_end|>"
    assert old.encode(text, add_special_tokens=False) == new.encode(
        text, add_special_tokens=False
    ), stale


# --- real chat templates ---------------------------------------------------------------------------------------

from conftest import REAL_TEMPLATES  # noqa: E402

# The control tokens each real template writes in a full conversation: each must be one id of the toy tokenizer.
REAL_SPECIALS = {
    "kimi-k2-thinking": [
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ],
    "deepseek-v3.1": [
        "<｜begin▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "</think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<｜end▁of▁sentence｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ],
    "deepseek-r1-distill": [
        "<｜begin▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
        "<｜tool▁outputs▁end｜>",
    ],
    "qwen3": [
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "glm-4.6": [
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ],
    "minimax-m2": [
        "]~!b[",
        "]~b]",
        "[e~[",
        "<think>",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
    ],
}
FULL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Ask the tool.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


def full_chat(name: str) -> list[dict]:
    if name.startswith(
        "deepseek"
    ):  # DeepSeek's templates concatenate the arguments: they must be a string
        chat_ = json.loads(json.dumps(FULL_CHAT))
        chat_[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
        return chat_
    return FULL_CHAT


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_templates_render_with_single_token_specials(real_tokenizer, name):
    model = Model(path=str(real_tokenizer(name)))
    tok = chat.load_tokenizer(model)
    info = chat.token_info(tok, model)
    ids = chat.render(tok, model, prompt(messages=full_chat(name), tools=TOOLS))
    pieces, text = tok.convert_ids_to_tokens(ids), tok.decode(ids)
    for special in REAL_SPECIALS[name]:
        assert tok.encode(special, add_special_tokens=False) == [
            tok.convert_tokens_to_ids(special)
        ], special
        if special in text:  # templates drop the reasoning of turns before the last user turn
            assert pieces.count(special) == text.count(special), (
                f"{special} is not rendered as one token by {name}"
            )
    assert sum(special in text for special in REAL_SPECIALS[name]) >= len(REAL_SPECIALS[name]) - 2
    assert tok.decode(ids).count("Thanks. And tomorrow?") == 1
    assert info.template_knows_reasoning


@pytest.mark.parametrize(
    ("name", "kwargs", "mode", "switch"),
    [
        ("kimi-k2-thinking", {}, chat.MODEL_OPENS, []),
        ("deepseek-v3.1", {}, chat.CLOSED, ["thinking", "enable_thinking"]),
        ("deepseek-v3.1", {"thinking": True}, chat.OPENED, ["thinking", "enable_thinking"]),
        ("deepseek-v3.1", {"enable_thinking": True}, chat.OPENED, ["thinking", "enable_thinking"]),
        ("deepseek-r1-distill", {}, chat.OPENED, []),
        ("qwen3", {}, chat.MODEL_OPENS, ["enable_thinking"]),
        ("qwen3", {"enable_thinking": False}, chat.CLOSED, ["enable_thinking"]),
        ("glm-4.6", {}, chat.MODEL_OPENS, ["enable_thinking"]),
        ("glm-4.6", {"enable_thinking": False}, chat.CLOSED, ["enable_thinking"]),
        ("minimax-m2", {}, chat.OPENED, []),
    ],
)
def test_reasoning_mode_of_real_templates(real_tokenizer, name, kwargs, mode, switch):
    model = Model(path=str(real_tokenizer(name)), chat_template_kwargs=kwargs)
    tok = chat.load_tokenizer(model)
    info = chat.token_info(tok, model)
    assert chat.reasoning_mode(chat.render(tok, model, prompt()), info) == mode
    assert info.thinking_kwargs == switch
    if switch:
        assert chat.thinking_hint(info, True).startswith(
            f"set [model] chat_template_kwargs = {{ {switch[0]} = true }}"
        )


def test_thinking_kwargs_of_a_template_with_loop_controls(toy_tokenizer, tmp_path):
    """transformers renders {% break %}; reading the template's variables must parse it too (Kimi-K2-Thinking)."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{%- for m in messages %}{{ m['content'] }}{% if loop.index > 3 %}{% break %}{% endif %}{% endfor -%}"
        "<|im_end|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    )
    model = Model(path=str(toy_tokenizer("kimi")), chat_template=str(template))
    tok = chat.load_tokenizer(model)
    assert chat.token_info(tok, model).thinking_kwargs == ["enable_thinking"]


def test_toy_tokenizer_extra_special_tokens(tmp_path):
    folder = build_tokenizer(
        tmp_path / "x",
        "glm",
        chat_template="{{ messages[0]['content'] }}<|assistant|>",
        extra_special=["<|begin_of_image|>", "<think>"],
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok.encode("<|begin_of_image|>", add_special_tokens=False)) == 1 and len(tok) == 4000
    with pytest.raises(ValueError, match="has no template of its own; pass chat_template="):
        build_tokenizer(tmp_path / "y", "minimax")


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_the_direct_text_renderer_gives_apply_chat_templates_text(real_tokenizer, name):
    """chat.text_renderer (what the pre-flight renders with) against render_texts (apply_chat_template), on chats
    with tools, tool turns, reasoning fields, None values, and thinking switched both ways."""
    chats = [
        full_chat(name),
        [{"role": "user", "content": "Hi."}],
        [
            {"role": "system", "content": "S."},
            {"role": "user", "content": [{"type": "text", "text": "Parts."}]},
        ],
        [
            {"role": "user", "content": "Q?"},
            {"role": "assistant", "content": "A.", "reasoning": "R.", "tool_calls": None},
            {"role": "user", "content": "Again?"},
        ],
    ]
    for kwargs in (
        {},
        {"thinking": False, "enable_thinking": False},
        {"thinking": True, "enable_thinking": True},
    ):
        model = Model(path=str(real_tokenizer(name)), chat_template_kwargs=kwargs)
        tok = chat.load_tokenizer(model)
        render = chat.text_renderer(tok, model)
        for messages in chats:
            for tools in (None, TOOLS):
                try:
                    want = chat.render_texts(tok, model, [prompt(messages=messages, tools=tools)])[
                        0
                    ]
                except ChatError as e:  # the template refuses the chat: the same error, both ways
                    want = f"{type(e.__cause__).__name__}: {e.__cause__}"
                try:
                    got = render(messages, tools)
                except Exception as e:
                    got = f"{type(e).__name__}: {e}"
                assert got == want, (kwargs, messages, tools)


def test_a_fast_tokenizers_word_cache_is_bounded_others_are_left_alone(toy_tokenizer, monkeypatch):
    """The BPE word cache grows with the distinct words a worker meets (its memory with the shard's size:
    benchmarks/bench_worker_memory.py); load_tokenizer bounds it, and a tokenizer without one is left as it is."""

    class BPE:
        def __init__(self):
            self.capacity = None

        def _resize_cache(self, n):
            self.capacity = n

    class Backend:
        model = BPE()

    class Fast:
        backend_tokenizer = Backend()

    fast = Fast()
    chat._bound_word_cache(fast)
    assert fast.backend_tokenizer.model.capacity == chat.WORD_CACHE == 1000
    chat._bound_word_cache(
        object()
    )  # e.g. a tiktoken-based tokenizer of remote code: nothing to bound
    seen = []
    monkeypatch.setattr(chat, "_bound_word_cache", seen.append)
    tok = chat.load_tokenizer(Model(path=str(toy_tokenizer("kimi"))))
    assert seen == [tok] and hasattr(tok.backend_tokenizer.model, "_resize_cache")
