"""The pre-flight `check`, `run` and `submit` share: every prompt rendered, its reasoning mode against
[model] expect_reasoning, its length against the context length, and the run directory — before any engine starts."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.cli import main
from toolkit.job import chat
from toolkit.job.check import preflight
from toolkit.job.findings import PreflightError
from toolkit.job.promptcheck import context_length
from toolkit.job.spec import load_spec


def check(job, capsys) -> tuple[int, str, str]:
    code = main(["check", str(job)])
    out, err = capsys.readouterr()
    return code, out, err


def lengths(job) -> list[int]:
    """Rendered length of every prompt of the job's one dataset, in file order."""
    spec = load_spec(job)
    tok = chat.load_tokenizer(spec.model)
    from toolkit.job.inputs import scan_dataset

    return [
        len(ids)
        for ids in chat.render_many(tok, spec.model, list(scan_dataset(spec.datasets[0].path, "d")))
    ]


# --- rendering every prompt -------------------------------------------------------------------------------------


def test_a_prompt_the_template_fails_on_is_named_by_file_line_and_id(
    tmp_path, toy_tokenizer, capsys
):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    lines = prompts.read_text().splitlines()
    for k in (4, 30):  # lines 5 and 31: only the first prompt of a dataset was rendered before
        row = json.loads(lines[k])
        row["messages"] = [{"role": "bot", "content": "hello"}]
        lines[k] = json.dumps(row)
    prompts.write_text("\n".join(lines) + "\n")
    job = make_job(tmp_path, toy_tokenizer("kimi"), prompts=prompts)
    code, out, err = check(job, capsys)
    assert code == 2 and out == ""
    assert f"the chat template fails on 2 prompts: {prompts}:5 (id 'p0004'): TemplateError: " in err
    assert "unknown role bot" in err and f"{prompts}:31 (id 'p0030')" in err
    with pytest.raises(PreflightError):
        prepared_run(job)
    assert not (tmp_path / "run").exists()


def test_check_reports_every_bad_line(tmp_path, toy_tokenizer, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "prompt": "ok"}\n' + '{"prompt": 1}\n' * 12 + '{"id": "a", "prompt": "dup"}\n'
    )
    code, _, err = check(make_job(tmp_path, toy_tokenizer("kimi"), prompts=prompts), capsys)
    assert (
        code == 2
        and f"12 bad lines in 1 prompt file ({prompts}: 12) and 1 duplicate id; the first 10:"
        in err
    )
    assert "... and 3 more" in err


# --- reasoning mode against expect_reasoning ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "switch"),
    [
        ("deepseek-v3.1", {}, "{ thinking = true } (the template also reads enable_thinking)"),
        ("qwen3", {"enable_thinking": False}, "{ enable_thinking = true }"),
        ("glm-4.6", {"enable_thinking": False}, "{ enable_thinking = true }"),
    ],
)
def test_templates_that_close_reasoning_are_refused(
    tmp_path, real_tokenizer, capsys, name, kwargs, switch
):
    a = write_prompts(tmp_path / "prompts.jsonl", 9)
    job = make_job(
        tmp_path, real_tokenizer(name), prompts=a, model={"chat_template_kwargs": kwargs}
    )
    code, out, err = check(job, capsys)
    assert code == 2, out
    assert "the chat template closes reasoning" in err and "expect_reasoning = true" in err
    assert f"set [model] chat_template_kwargs = {switch}" in err
    assert f"9 prompts (d: 9, e.g. {a}:1, {a}:2, {a}:3, {a}:4, {a}:5 (and 4 more))" in err
    with pytest.raises(PreflightError, match="closes reasoning"):
        prepared_run(job)  # `toolkit run` refuses too, before any engine starts
    # switched on, the same job passes
    on = {"deepseek-v3.1": {"thinking": True}}.get(name, {"enable_thinking": True})
    job = make_job(tmp_path, real_tokenizer(name), prompts=a, model={"chat_template_kwargs": on})
    code, out, err = check(job, capsys)
    mode = "opened by the template" if name == "deepseek-v3.1" else "left for the model to open"
    assert code == 0 and f"reasoning: 9 {mode} (expect_reasoning = true)" in out


def test_refused_counts_are_per_dataset(tmp_path, real_tokenizer):
    job = make_job(tmp_path, real_tokenizer("deepseek-v3.1"), n=3)
    b = write_prompts(tmp_path / "b.jsonl", 7, prefix="b")
    job.write_text(job.read_text() + f'[[datasets]]\nname = "b"\npath = "{b}"\n')
    with pytest.raises(PreflightError) as e:
        preflight(job)
    assert "in 10 prompts (d: 3, e.g." in str(e.value) and f"; b: 7, e.g. {b}:1," in str(e.value)


def test_expect_no_reasoning(tmp_path, real_tokenizer, capsys):
    # a template that opens reasoning, and has no switch: refused
    job = make_job(tmp_path / "a", real_tokenizer("minimax-m2"), model={"expect_reasoning": False})
    code, _, err = check(job, capsys)
    assert (
        code == 2
        and "the chat template opens reasoning" in err
        and "expect_reasoning = false" in err
    )
    assert (
        "this template reads no thinking switch: use a chat template that closes reasoning" in err
    )
    # the model opens it itself: a warning that names the switch
    job = make_job(tmp_path / "b", real_tokenizer("qwen3"), n=5, model={"expect_reasoning": False})
    code, out, _ = check(job, capsys)
    assert (
        code == 0 and "warning: 5 prompts (d: 5, e.g." in out and "may open reasoning itself" in out
    )
    assert "{ enable_thinking = false }" in out
    # closed by the template: what non-thinking data needs
    job = make_job(
        tmp_path / "c",
        real_tokenizer("qwen3"),
        n=5,
        model={"expect_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}},
    )
    code, out, _ = check(job, capsys)
    assert (
        code == 0
        and "reasoning: 5 closed by the template (expect_reasoning = false)" in out
        and "warning" not in out
    )


def test_template_that_never_mentions_the_think_tokens_warns(tmp_path, toy_tokenizer, capsys):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_assistant|>"
    )
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=4, model={"chat_template": str(template)})
    code, out, _ = check(job, capsys)
    assert code == 0 and "reasoning: 4 unknown" in out
    assert (
        "warning: the chat template never mentions the think tokens '<think>' / '</think>'" in out
    )


# --- lengths against the context length --------------------------------------------------------------------------


def test_over_long_prompts_are_refused_with_what_to_do(tmp_path, toy_tokenizer, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12, long_every=4)
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        prompts=prompts,
        stub={"context_length": 1024},
        sampling={"max_new_tokens": 100},
    )
    n = lengths(job)
    code, _, err = check(job, capsys)
    assert code == 2
    assert (
        f"3 prompts (d: 3 with max_new_tokens 100, e.g. {prompts}:4 ({n[3]:,} tokens), {prompts}:8 "
        f"({n[7]:,} tokens), {prompts}:12 ({n[11]:,} tokens)) do not fit the context length 1,024 "
        "([engine.stub] context_length)"
    ) in err
    assert "Raise the context length (--context-length in [engine] extra_args" in err
    assert "lower max_new_tokens for that dataset" in err and "drop the lines" in err
    assert 'or skip them, each reported ([inputs] on_too_long = "skip")' in err


def test_over_long_prompts_are_skipped_and_named_with_on_too_long_skip(
    tmp_path, toy_tokenizer, capsys
):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12, long_every=4)
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        prompts=prompts,
        stub={"context_length": 1024},
        sampling={"max_new_tokens": 100},
        inputs={"on_too_long": "skip"},
    )
    n = lengths(job)
    code, out, _ = check(job, capsys)
    assert code == 0, out
    assert "ok — 9 prompts in 1 dataset (3 lines skipped), 1 shard" in out
    assert (
        f"warning: skipped 3 lines of dataset 'd', 3 too long ([inputs] on_too_long = \"skip\"): {prompts}:4: too "
        f"long: {n[3]:,} tokens + max_new_tokens 100 do not fit the context length 1,024; {prompts}:8: "
    ) in out
    rd, plan = prepared_run(job)  # what `run` and `submit` plan: without them
    assert plan.total == 9 and plan.datasets[0].too_long == 3
    assert [s.line for s in plan.datasets[0].skipped] == [4, 8, 12]


def test_bad_lines_skipped_are_said_by_check_and_submit(
    tmp_path, toy_tokenizer, capsys, monkeypatch
):
    monkeypatch.delenv(
        "SLURM_CONF", raising=False
    )  # the dry run without a cluster: the same on every machine
    monkeypatch.setenv("PATH", "/nonexistent")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    prompts.write_text(prompts.read_text() + '{"prompt": 5}\n')
    job = make_job(tmp_path, toy_tokenizer("kimi"), prompts=prompts, inputs={"on_bad_line": "skip"})
    code, out, _ = check(job, capsys)
    said = (
        f"skipped 1 line of dataset 'd', 1 bad ([inputs] on_bad_line = \"skip\"): {prompts}:7: field `prompt`: "
        "must be a string, got int"
    )
    assert (
        code == 0 and "6 prompts in 1 dataset (1 line skipped)" in out and f"warning: {said}" in out
    )
    assert main(["submit", str(job), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "dry run: 6 prompts" in out and f"toolkit: warning: {said}" in err


def test_the_length_rule_is_sglangs(tmp_path, toy_tokenizer):
    """As SGLang checks lengths (tokenizer manager, then scheduler): refused when len + max_new_tokens > context, or len >= context - 6; len + max_new_tokens == context
    passes (the scheduler then lowers max_new_tokens by a token or two: a warning)."""
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=1)
    n = lengths(job)[0]

    def run(ctx: int, mnt: int, flag: str = "--context-length={}") -> list[str]:
        text = job.read_text().replace("max_new_tokens = 256", f"max_new_tokens = {mnt}")
        text = text.replace(
            'kind = "stub"',
            f'kind = "sglang"\nextra_args = {json.dumps(flag.format(ctx).split(" "))}',
        )
        (tmp_path / "j.toml").write_text(text)
        return [
            w for w in preflight(tmp_path / "j.toml").warnings if "cannot start SGLang" not in w
        ]

    assert any("lowers their max_new_tokens" in w for w in run(n + 100, 100))
    assert any("lowers their max_new_tokens" in w for w in run(n + 101, 100, "--context-length {}"))
    assert run(n + 102, 100) == []
    with pytest.raises(PreflightError, match="1 prompt .* do not fit the context length"):
        run(n + 99, 100, "--context-length {}")
    with pytest.raises(PreflightError, match="do not fit"):
        run(n + 6, 1)  # fits len + max_new_tokens, but not the scheduler's max_req_input_len
    assert run(n + 7, 1) == []


def test_context_length_sources(tmp_path, toy_tokenizer):
    model = Path(shutil.copytree(toy_tokenizer("qwen3"), tmp_path / "model"))
    job = make_job(tmp_path, model, n=1, engine={"kind": "sglang"})
    config = json.loads((model / "config.json").read_text())

    def source() -> tuple:
        return context_length(load_spec(job))

    assert source() == (
        131072,
        f"{model / 'tokenizer_config.json'} model_max_length",
        False,
    )  # the last resort
    (model / "config.json").write_text(
        json.dumps({**config, "text_config": {"max_position_embeddings": 4096}})
    )
    assert source()[:2] == (4096, f"{model / 'config.json'} text_config.max_position_embeddings")
    (model / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": 2048, "model_max_length": 9})
    )
    assert source()[:2] == (2048, f"{model / 'config.json'} max_position_embeddings")
    job.write_text(
        job.read_text().replace(
            'kind = "sglang"',
            'kind = "sglang"\nextra_args = ["--context-length", "512", "--allow-auto-truncate"]',
        )
    )
    assert source() == (512, "--context-length in [engine] extra_args", True)


def test_unknown_context_length_is_a_warning(tmp_path, toy_tokenizer, capsys):
    model = Path(shutil.copytree(toy_tokenizer("qwen3"), tmp_path / "model"))
    cfg = model / "tokenizer_config.json"
    cfg.write_text(
        json.dumps(
            {k: v for k, v in json.loads(cfg.read_text()).items() if k != "model_max_length"}
        )
    )
    job = make_job(tmp_path, model, n=2, engine={"kind": "sglang"})
    code, out, _ = check(job, capsys)
    assert code == 0
    assert (
        f"warning: cannot find the model's context length: no --context-length in [engine] extra_args and no "
        f"max_position_embeddings in {model / 'config.json'}: prompt lengths are not checked"
    ) in out


def test_auto_truncate_turns_the_refusal_into_a_warning(tmp_path, toy_tokenizer, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4, long_every=4)
    job = make_job(
        tmp_path,
        toy_tokenizer("qwen3"),
        prompts=prompts,
        engine={"kind": "sglang", "extra_args": ["--context-length=1024", "--allow-auto-truncate"]},
    )
    code, out, _ = check(job, capsys)
    assert code == 0 and "warning: 1 prompt (d: 1, e.g." in out and "--allow-auto-truncate" in out


# --- run directory, and one pre-flight for every command ----------------------------------------------------------


def test_check_warns_of_another_run_in_output_dir(tmp_path, toy_tokenizer, capsys):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=4)
    prepared_run(job)
    code, out, _ = check(job, capsys)
    assert code == 0 and "holds this run already" in out and "warning" not in out
    job.write_text(job.read_text().replace("max_new_tokens = 256", "max_new_tokens = 128"))
    code, out, _ = check(job, capsys)
    assert code == 0 and f"warning: output_dir {tmp_path / 'run'} holds another run" in out
    assert "differs in: sampling" in out and "pass --new-run" in out


def test_submit_and_its_dry_run_run_the_same_preflight(tmp_path, real_tokenizer, monkeypatch):
    from toolkit.cluster import resources, submit

    def no_slurm(*a, **k):
        raise AssertionError("Slurm was asked before the pre-flight ended")

    monkeypatch.setattr(resources, "slurm_output", no_slurm)
    job = make_job(tmp_path, real_tokenizer("deepseek-v3.1"), n=3)
    for dry_run in (True, False):
        with pytest.raises(PreflightError, match=r"closes reasoning .* \{ thinking = true \}"):
            submit.submit(str(job), {}, dry_run=dry_run)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("qwen3", {"enable_thinking": False}),
        ("deepseek-r1-distill", {}),
        ("glm-4.6", {}),
        ("kimi-k2-thinking", {}),
    ],
)
def test_prompts_measured_by_their_tail_give_the_exact_answers(
    tmp_path, real_tokenizer, name, kwargs
):
    """Long prompts far from the limit are bounded by their bytes and only their tail is encoded: the reasoning
    counts and the refused prompts are those of encoding every prompt whole."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24, long_every=3)
    lines = prompts.read_text().splitlines()
    row = json.loads(lines[4])
    row["messages"][0]["content"] = (
        "word " * 400 + " " * 300 + "\n\n\t"
    )  # trailing whitespace past the tail
    lines[4] = json.dumps(row)
    prompts.write_text("\n".join(lines) + "\n")
    n = None
    for ctx in (100_000, 6_000):
        job = make_job(
            tmp_path,
            real_tokenizer(name),
            prompts=prompts,
            stub={"context_length": ctx},
            model={
                "chat_template_kwargs": kwargs,
                "expect_reasoning": "enable_thinking" not in kwargs,
            },
            sampling={"max_new_tokens": 2000},
        )
        results = []
        for exact in (False, True):
            try:
                pf = preflight(job, exact=exact)
                results.append((pf.modes, pf.warnings))
            except PreflightError as e:
                results.append(str(e))
        assert results[0] == results[1]
        if n is None:
            n = max(lengths(job))
            assert (
                n + 2000 > 6_000 and sum(results[0][0].values()) == 24
            )  # the second context refuses some


@pytest.fixture
def no_sglang(monkeypatch):
    """This Python as a login node has it: no `sglang` module to import."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a)
    )


def test_check_notes_that_this_python_cannot_start_sglang_and_run_refuses_it(
    tmp_path, toy_tokenizer, capsys, no_sglang
):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=3, engine={"kind": "sglang"}, stub={})
    assert main(["check", str(job)]) == 0  # a login node that only submits needs no SGLang
    out = capsys.readouterr().out
    assert (
        f'warning: [engine] kind = "sglang": {sys.executable} (the toolkit\'s own Python) cannot'
        in out
    )
    assert (
        "cannot start SGLang (no module named 'sglang'); build the nodes' environment with `bash "
        "scripts/node-env.sh VENV` (SGLang and the toolkit) and start tasks in it (--setup 'source "
        "VENV/bin/activate'). A login node that only submits needs none" in out
    )
    assert (
        main(["run", str(job)]) == 2
    )  # a local run would start it here: refused before anything is written
    err = capsys.readouterr().err
    assert (
        f'toolkit: error: [engine] kind = "sglang": {sys.executable} (the toolkit\'s own' in err
        and "or run the job where SGLang is installed" in err
    )
    assert [p.name for p in (tmp_path / "run").iterdir()] == [
        "check.msgpack"
    ]  # what check kept, and no run


def test_no_sglang_note_for_the_stub_or_a_custom_launcher(
    tmp_path, toy_tokenizer, capsys, no_sglang
):
    tok = toy_tokenizer("kimi")
    for i, engine in enumerate(
        ({"kind": "stub"}, {"kind": "sglang", "command": ["my-launcher", "{port}"]})
    ):
        job = make_job(tmp_path / str(i), tok, n=2, engine=engine)
        assert main(["check", str(job)]) == 0
        assert "cannot start SGLang" not in capsys.readouterr().out
