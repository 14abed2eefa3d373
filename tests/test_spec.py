"""Job specs: every mistake is caught at load time with the file and the key named."""

from pathlib import Path

import pytest

from toolkit.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[1]

BASE = """
name = "t"
output_dir = "out"
[model]
path = "tok"
[sampling]
max_new_tokens = 64
[[datasets]]
name = "a"
path = "a.jsonl"
"""


def write(tmp_path, text, *, files=True):
    if files:
        (tmp_path / "tok").mkdir(exist_ok=True)
        (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_demo_job_loads_with_resolved_paths():
    spec = load_spec(REPO / "jobs" / "demo.toml")
    assert spec.engine.kind == "stub"
    assert Path(spec.model.path).is_absolute() and Path(spec.model.path).is_dir()
    assert all(Path(d.path).is_file() for d in spec.datasets)
    assert spec.sampling_for("chat")["max_new_tokens"] == 768
    assert spec.sampling_for("math")["max_new_tokens"] == 1024


def test_minimal_spec_gets_defaults(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    assert spec.sharding.shards == 1 and spec.engine.kind == "sglang"
    assert spec.output_dir == str(tmp_path / "out")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (("max_new_tokens = 64", "temperature = 0.6"), "needs `max_new_tokens`"),
        (("max_new_tokens = 64", "max_new_tokens = 64\nseed = 1"), "unknown sampling key(s) 'seed'"),
        (("max_new_tokens = 64", "max_new_tokens = 64\ntop_pp = 1"), "SGLang's sampling_params accepts only"),
        (("max_new_tokens = 64", "max_new_tokens = 0"), "positive integer"),
        (("max_new_tokens = 64", "max_new_tokens = 64\nn = 0"), "`n` (samples per prompt) must be a positive integer"),
        (("max_new_tokens = 64", "max_new_tokens = 64\nn = 2\ntemperature = 0"), "identical greedy outputs"),
        (('name = "t"', 'name = "t"\nbogus = 1'), "unknown field `bogus`"),
        (('path = "tok"', 'path = "tok"\ntrust_remote = true'), "unknown field `trust_remote`"),
        (('path = "a.jsonl"', 'path = "missing.jsonl"'), "missing.jsonl does not exist"),
        (('path = "tok"', 'path = "nope/"'), "tokenizer path"),
        (('path = "tok"', 'path = "tok"\nchat_template = "t.jinja"'), "chat_template file"),
        (("max_new_tokens = 64", "max_new_tokens = \"many\""), "positive integer"),
    ],
)
def test_bad_specs_are_named(tmp_path, edit, expected):
    old, new = edit
    p = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(p) in str(e.value)
    assert expected in str(e.value)


def test_dataset_sampling_override_checked(tmp_path):
    p = write(tmp_path, BASE + 'sampling = { seed = 3 }\n')
    with pytest.raises(SpecError, match=r"\[\[datasets\]\] #1 \('a'\) sampling: unknown sampling key"):
        load_spec(p)


def test_duplicate_dataset_names(tmp_path):
    p = write(tmp_path, BASE + '[[datasets]]\nname = "a"\npath = "a.jsonl"\n')
    with pytest.raises(SpecError, match="used twice"):
        load_spec(p)


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="invalid TOML"):
        load_spec(write(tmp_path, "name = \n"))
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "none.toml")


def test_external_engine_needs_url(tmp_path):
    with pytest.raises(SpecError, match="needs `url`"):
        load_spec(write(tmp_path, BASE + '[engine]\nkind = "external"\n'))


@pytest.mark.parametrize("recipe", sorted((REPO / "jobs").glob("*.toml")) + [REPO / "templates" / "job.toml"],
                         ids=lambda p: p.name)
def test_recipes_and_the_template_decode(recipe):
    """Every shipped recipe (and the template listing every key) is a valid spec; data paths may not exist here."""
    spec = load_spec(recipe, check_paths=False)
    assert spec.sampling["max_new_tokens"] >= 1024


def test_real_recipes_match_their_models():
    kimi = load_spec(REPO / "jobs" / "kimi-k2.5.toml", check_paths=False)
    assert kimi.model.trust_remote_code and kimi.engine.tp_size == 8 and kimi.slurm.gpus_per_node == 8
    assert kimi.model.chat_template_kwargs == {"thinking": True}
    assert kimi.model.tool_call_start == "<|tool_calls_section_begin|>" and len(kimi.datasets) == 8
    qwen = load_spec(REPO / "jobs" / "qwen3-thinking.toml", check_paths=False)
    assert qwen.model.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (("", '[[datasets]]\nname = "math"\npath = "${DATA_ROOT}/math.jsonl"\n'), "[[datasets]] #2 ('math') path"),
        (('path = "tok"', 'path = "${DATA_ROOT}/models/x"'), "[model] path"),
        (('path = "tok"', 'path = "tok"\ntokenizer_path = "$DATA_ROOT/tok"'), "[model] tokenizer_path"),
        (('path = "tok"', 'path = "tok"\nchat_template = "${DATA_ROOT}/t.jinja"'), "[model] chat_template"),
        (('output_dir = "out"', 'output_dir = "${DATA_ROOT}/runs"'), "output_dir"),
    ],
)
def test_unset_environment_variable_in_a_path_is_named(tmp_path, monkeypatch, edit, where):
    monkeypatch.delenv("DATA_ROOT", raising=False)
    old, new = edit
    p = write(tmp_path, BASE.replace(old, new, 1) if old else BASE + new)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(e.value) == (f"{p}: {where}: environment variable DATA_ROOT is not set "
                            "(export it, or write the path out)")
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    (tmp_path / "math.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "models" / "x").mkdir(parents=True)
    load_spec(p)  # set: the path resolves
