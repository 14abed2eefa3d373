"""Job specs: every mistake is caught at load time with the file and the key named."""

import re
from pathlib import Path

import pytest

from toolkit.job.spec import load_spec
from toolkit.job.specerrors import SpecError

REPO = Path(__file__).resolve().parents[2]

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
    assert (
        spec.client.max_tries == 3
    )  # a failure that may pass: tried 3 times within a run, then final
    assert spec.output_dir == str(tmp_path / "out")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (("max_new_tokens = 64", "temperature = 0.6"), "needs `max_new_tokens`"),
        (
            ("max_new_tokens = 64", "max_new_tokens = 64\nseed = 1"),
            ":8: unknown sampling key `seed` in [sampling]; there is no `seed`: use `sampling_seed`",
        ),
        (
            ("max_new_tokens = 64", "max_new_tokens = 64\ntop_pp = 1"),
            ":8: unknown sampling key `top_pp` in [sampling]; did you mean `top_p`?",
        ),
        (
            ("max_new_tokens = 64", "max_new_tokens = 64\nfrobnicate = 1"),
            "SGLang's sampling_params takes: ",
        ),
        (("max_new_tokens = 64", "max_new_tokens = 0"), "positive integer"),
        (
            ("max_new_tokens = 64", "max_new_tokens = 64\nn = 0"),
            "`n` (samples per prompt) must be a positive integer",
        ),
        (
            ("max_new_tokens = 64", "max_new_tokens = 64\nn = 2\ntemperature = 0"),
            "identical greedy outputs",
        ),
        (
            ('name = "t"', 'name = "t"\nbogus = 1'),
            "unknown key `bogus` at the top level; templates/job.toml lists every key",
        ),
        (
            ('path = "tok"', 'path = "tok"\ntrust_remote = true'),
            ":6: unknown key `trust_remote` in [model]; did you mean `trust_remote_code`?",
        ),
        (('path = "a.jsonl"', 'path = "missing.jsonl"'), "missing.jsonl does not exist"),
        (('path = "tok"', 'path = "nope/"'), "tokenizer path"),
        (('path = "tok"', 'path = "tok"\nchat_template = "t.jinja"'), "chat_template file"),
        (("max_new_tokens = 64", 'max_new_tokens = "many"'), "positive integer"),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\n[client]\nmax_tries = 0'),
            "[client] max_tries must be between 1 and 100 (tries of a prompt whose failure may pass, within a run), "
            "got 0",
        ),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\n[client]\nmax_tries = 1000'),
            "max_tries must be between 1 and 100",
        ),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\n[client]\nmax_tries = "3"'),
            "`max_tries` in [client]",
        ),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\n[client]\nbackoff_s = -1'),
            "backoff_s and backoff_max_s must be >= 0",
        ),
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
    p = write(tmp_path, BASE + "sampling = { seed = 3 }\n")
    with pytest.raises(
        SpecError,
        match=r"job.toml:11: unknown sampling key `seed` in \[\[datasets\]\] #1 \('a'\) sampling",
    ):
        load_spec(p)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            ("[sampling]", "[client]\nconcurency = 8\n[sampling]"),
            ":7: unknown key `concurency` in [client]; did you mean `concurrency`?",
        ),
        (
            ("[sampling]", '[client]\nconcurrency = "eight"\n[sampling]'),
            ':7: `concurrency` in [client] takes an integer or "auto", got "eight" (a string)',
        ),
        (
            ("[sampling]", '[sharding]\nshards = "2"\n[sampling]'),
            ':7: `shards` in [sharding] takes an integer, got "2" (a string)',
        ),
        (
            ("[sampling]", '[engine]\nkind = "sglan"\n[sampling]'),
            ':7: `kind` in [engine] takes one of "external", "sglang", "stub", got "sglan" (a string); did you mean "sglang"?',
        ),
        (
            ("[sampling]", "[engine.stub]\nload_delay = 1\n[sampling]"),
            ":7: unknown key `load_delay` in [engine.stub]; did you mean `load_delay_s`?",
        ),
        (
            ("[sampling]", '[engine]\nextra_args = "--x"\n[sampling]'),
            ':7: `extra_args` in [engine] takes a list of strings, got "--x" (a string)',
        ),
        (
            ("max_new_tokens = 64", "max_new_token = 64"),
            ":7: unknown sampling key `max_new_token` in [sampling]; did you mean `max_new_tokens`?",
        ),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\nsampling = { max_new_token = 4 }'),
            ":11: unknown sampling key `max_new_token` in [[datasets]] #1 ('a') sampling; did you mean `max_new_tokens`?",
        ),
        (
            ('path = "a.jsonl"', 'path = "a.jsonl"\nregenrate = true'),
            ":11: unknown key `regenrate` in [[datasets]] #1 ('a'); did you mean `regenerate`?",
        ),
        (
            ('name = "t"\n', "name = 3\n"),
            ":2: `name` at the top level takes a string, got 3 (an integer)",
        ),
    ],
)
def test_a_wrong_key_is_named_with_its_table_line_and_what_it_takes(tmp_path, edit, expected):
    """Not msgspec's `Object contains unknown field ... - at $.client`: the TOML key, its table, the file and line,
    the closest known keys, and what a key takes."""
    old, new = edit
    p = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert f"{p}{expected}" in str(e.value)
    assert "$." not in str(e.value) and "Object contains" not in str(e.value)


def test_unknown_keys_without_a_close_match_say_where_every_key_is_listed(tmp_path):
    p = write(tmp_path, BASE.replace("[sampling]", "[client]\nwhatever = 1\nzzz = 2\n[sampling]"))
    with pytest.raises(
        SpecError,
        match=r"job.toml:7: unknown key `whatever` in \[client\] \(and 1 more: `client.zzz`\); "
        r"templates/job.toml lists every key",
    ):
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


@pytest.mark.parametrize(
    "recipe",
    sorted((REPO / "jobs").glob("*.toml")) + [REPO / "templates" / "job.toml"],
    ids=lambda p: p.name,
)
def test_recipes_and_the_template_decode(recipe):
    """Every shipped recipe (and the template listing every key) is a valid spec; data paths may not exist here."""
    spec = load_spec(recipe, check_paths=False)
    assert spec.sampling["max_new_tokens"] >= 1024


@pytest.mark.parametrize(
    "name",
    [
        "kimi-k2.5",
        "deepseek-r1",
        "qwen3-thinking",
        "kimi-k2.5-dp-attention",
        "deepseek-r1-dp-attention",
    ],
)
def test_each_recipes_commented_start_up_flags_pass_the_check_and_keep_its_other_flags(
    name, tmp_path
):
    """The commented `extra_args` of a recipe (a shorter node start, docs/submit.md) is what `toolkit check` takes
    once uncommented: SGLang 0.5.23's parser accepts it, and it keeps every flag of the active line."""
    import re

    text = (REPO / "jobs" / f"{name}.toml").read_text()
    block = re.search(r"^# (extra_args = \[.*?\])$", text, re.M | re.S)
    assert block, "no commented extra_args in the recipe"
    commented = "\n".join(
        line.removeprefix("# ").removeprefix("#") for line in block.group(1).splitlines()
    )
    active = re.search(r"^extra_args = \[.*?\]$", text, re.M | re.S)
    (tmp_path / "job.toml").write_text(text.replace(active.group(0), commented))
    before = load_spec(REPO / "jobs" / f"{name}.toml", check_paths=False).engine.extra_args
    after = load_spec(
        tmp_path / "job.toml", check_paths=False
    )  # the check of [engine] extra_args included
    assert after.engine.extra_args[: len(before)] == before
    added = after.engine.extra_args[len(before) :]
    assert {"--weight-loader-prefetch-checkpoints", "--cuda-graph-max-bs-decode"} <= set(added)
    graphs = int(added[added.index("--cuda-graph-max-bs-decode") + 1])
    assert graphs >= after.client.concurrency  # no batch the job sends runs without CUDA graphs
    bad = commented.replace(
        "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs"
    )  # ambiguous since 0.5.2x
    (tmp_path / "job.toml").write_text(text.replace(active.group(0), bad))
    with pytest.raises(SpecError, match="cuda-graph-max-bs"):
        load_spec(tmp_path / "job.toml", check_paths=False)


def test_real_recipes_match_their_models():
    kimi = load_spec(REPO / "jobs" / "kimi-k2.5.toml", check_paths=False)
    assert (
        kimi.model.trust_remote_code and kimi.engine.tp_size == 8 and kimi.slurm.gpus_per_node == 8
    )
    assert kimi.model.chat_template_kwargs == {"thinking": True}
    assert kimi.model.tool_call_start == "<|tool_calls_section_begin|>" and len(kimi.datasets) == 8
    qwen = load_spec(REPO / "jobs" / "qwen3-thinking.toml", check_paths=False)
    assert qwen.model.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (
            ("", '[[datasets]]\nname = "math"\npath = "${DATA_ROOT}/math.jsonl"\n'),
            "[[datasets]] #2 ('math') path",
        ),
        (('path = "tok"', 'path = "${DATA_ROOT}/models/x"'), "[model] path"),
        (
            ('path = "tok"', 'path = "tok"\ntokenizer_path = "$DATA_ROOT/tok"'),
            "[model] tokenizer_path",
        ),
        (
            ('path = "tok"', 'path = "tok"\nchat_template = "${DATA_ROOT}/t.jinja"'),
            "[model] chat_template",
        ),
        (('output_dir = "out"', 'output_dir = "${DATA_ROOT}/runs"'), "output_dir"),
    ],
)
def test_unset_environment_variable_in_a_path_is_named(tmp_path, monkeypatch, edit, where):
    monkeypatch.delenv("DATA_ROOT", raising=False)
    old, new = edit
    p = write(tmp_path, BASE.replace(old, new, 1) if old else BASE + new)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(e.value) == (
        f"{p}: {where}: environment variable DATA_ROOT is not set "
        "(export it, or write the path out)"
    )
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    (tmp_path / "math.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "models" / "x").mkdir(parents=True)
    load_spec(p)  # set: the path resolves


@pytest.mark.parametrize(
    "sampling, dataset, expected",
    [
        (
            "top_p = 0.0",
            "",
            "dataset 'a': [sampling]: SGLang 0.5.23 refuses it with HTTP 400 for every request: "
            "top_p must be in (0, 1], got 0.0.",
        ),
        (
            "repetition_penalty = 0.0",
            "",
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0.",
        ),
        ("temperature = -0.5", "", "temperature must be a non-negative finite number, got -0.5."),
        ("min_new_tokens = 100", "", "min_new_tokens must be in [0, max_new_tokens(64)], got 100."),
        (
            'regex = "a+"\njson_schema = "{}"',
            "",
            "Only one of json_schema, regex, ebnf, or structural_tag",
        ),
        (
            "stop = [" + ", ".join(f'"s{i}"' for i in range(33)) + "]",
            "",
            "at most 32 stop strings are allowed, got 33",
        ),
        (
            "sampling_seed = 9223372036854775807",
            "sampling = { sampling_seed = -9223372036854775808 }",
            None,
        ),
        (
            "top_k = 20",
            "sampling = { top_k = 0 }",
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        ('temperature = "hot"', "", '`temperature`: invalid type: string "hot", expected f64'),
        (
            "stop_token_ids = [1, 2.5]",
            "",
            "`stop_token_ids`: invalid type: floating point `2.5`, expected i64",
        ),
        ("beam_width = 4", "", "asks for beam search"),
        ("choice = 1", "", "unknown sampling key `choice` in [sampling]"),
    ],
)
def test_sampling_sglang_would_refuse_is_refused_before_any_gpu_time(
    tmp_path, sampling, dataset, expected
):
    """What SGLang's SamplingParams.verify (or its schema gate) refuses on every request is refused at load time,
    with SGLang's own text, the key and the dataset named; a valid job with the same keys loads."""
    text = (
        BASE.replace("max_new_tokens = 64", "max_new_tokens = 64\n" + sampling, 1) + dataset + "\n"
    )
    p = write(tmp_path, text)
    if expected is None:
        assert load_spec(p).sampling_for("a")["sampling_seed"] == -(2**63)
        return
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(p) in str(e.value) and expected in str(e.value)


def test_the_release_the_engine_runs_judges_the_sampling(tmp_path, monkeypatch):
    """0.5.9 allows repetition_penalty = 0 (0.5.23 refuses it); the stub is judged by the release it imitates."""
    text = BASE.replace("max_new_tokens = 64", "max_new_tokens = 64\nrepetition_penalty = 0.0", 1)
    with pytest.raises(SpecError, match=r"SGLang 0\.5\.23 refuses"):
        load_spec(write(tmp_path, text))
    monkeypatch.setenv("TOOLKIT_SGLANG_VERSION", "0.5.9")
    assert load_spec(write(tmp_path, text)).sampling["repetition_penalty"] == 0.0
    monkeypatch.delenv("TOOLKIT_SGLANG_VERSION")
    assert load_spec(
        write(tmp_path, text + '[engine]\nkind = "stub"\n[engine.stub]\nversion = "0.5.9"\n')
    )


def test_stop_strings_need_the_servers_tokenizer(tmp_path):
    text = BASE.replace("max_new_tokens = 64", 'max_new_tokens = 64\nstop = ["END"]', 1)
    assert load_spec(write(tmp_path, text))
    with pytest.raises(
        SpecError,
        match=r"stop need the server's tokenizer, and \[engine\] extra_args has "
        r"--skip-tokenizer-init",
    ):
        load_spec(write(tmp_path, text + '[engine]\nextra_args = ["--skip-tokenizer-init"]\n'))


def test_a_missing_top_level_key_and_other_names_of_sampling_keys_are_said_in_toml_terms(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, BASE.replace('name = "t"\n', "", 1)))
    assert str(e.value).endswith(": the top level needs `name` (a string)")
    for key, said in (
        ("samples", "samples per prompt are `n`"),
        ("max_tokens", "SGLang calls it `max_new_tokens`"),
    ):
        with pytest.raises(
            SpecError, match=re.escape(f"unknown sampling key `{key}` in [sampling]; {said}")
        ):
            load_spec(write(tmp_path, BASE.replace("[sampling]\n", f"[sampling]\n{key} = 2\n", 1)))


def test_a_relative_prompt_path_that_does_not_exist_says_it_resolves_from_the_job_files_folder(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("DATA", "data")
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, BASE.replace('path = "a.jsonl"', 'path = "${DATA}/a.jsonl"', 1)))
    assert str(e.value).endswith(
        f"prompt file {tmp_path}/data/a.jsonl does not exist ('${{DATA}}/a.jsonl', i.e. 'data/a.jsonl' is "
        f"relative: it resolves from the job file's folder {tmp_path}, not from here)"
    )


def test_every_unset_environment_variable_of_the_paths_is_said_at_once(monkeypatch):
    monkeypatch.delenv("DATA_ROOT", raising=False)
    monkeypatch.delenv("MODEL_ROOT", raising=False)
    with pytest.raises(SpecError) as e:
        load_spec(Path(__file__).resolve().parents[2] / "jobs" / "kimi-k2.5.toml")
    assert str(e.value).endswith(
        "environment variables not set: DATA_ROOT (in output_dir, [[datasets]] path); MODEL_ROOT (in [model] "
        "path); export them (e.g. `export DATA_ROOT=... MODEL_ROOT=...`), or write the paths out"
    )
