"""The render stage on every core: slices of whole lines, a process pool whose answer is the one of a single
process (counts, order of the places named, errors by file:line), the number of processes, the progress line."""

from __future__ import annotations

import io
import json
import logging

import pytest

from jobfiles import make_job, write_prompts
from toolkit.errors import BadInputError
from toolkit.job import render_pool, render_slice
from toolkit.job.check import preflight
from toolkit.job.findings import PreflightError


def two_datasets(tmp_path, tok, n=60, **tables):
    """A job of two datasets; in the first, lines 5, 23 and 41 use a role the template refuses, and every 7th
    prompt is long (past a context of 3,000 tokens); in the second, lines 2, 50 and 56."""
    first = write_prompts(tmp_path / "a.jsonl", n, long_every=7)
    second = write_prompts(tmp_path / "b.jsonl", n, prefix="q", tools_every=3)
    for path, bad in ((first, (4, 22, 40)), (second, (1, 49, 55))):
        lines = path.read_text().splitlines()
        for k in bad:
            row = json.loads(lines[k])
            row["messages"] = [{"role": "bot", "content": "hello"}]
            lines[k] = json.dumps(row)
        path.write_text("\n".join(lines) + "\n")
    job = make_job(tmp_path, tok, prompts=first, **tables)
    job.write_text(job.read_text() + f'[[datasets]]\nname = "e"\npath = "{second}"\n')
    return job


def outcome(job, monkeypatch, processes: int):
    monkeypatch.setenv(render_pool.ENV_PROCESSES, str(processes))
    try:
        pf = preflight(job, warn_other_run=False)
        return pf.modes, pf.longest, pf.warnings
    except PreflightError as e:
        return str(e)


@pytest.mark.slow
def test_a_pool_gives_the_answer_of_one_process(tmp_path, toy_tokenizer, monkeypatch):
    job = two_datasets(
        tmp_path,
        toy_tokenizer("kimi"),
        stub={"context_length": 3000},
        sampling={"max_new_tokens": 200},
    )
    pooled = []
    real = render_pool._pooled

    def spy(tok, setting, work, n):
        pooled.append((len(work), n))
        yield from real(tok, setting, work, n)

    monkeypatch.setattr(render_pool, "_pooled", spy)
    monkeypatch.setattr(render_pool, "SLICE_BYTES", 700)  # many slices, failures in several of them
    monkeypatch.setattr(render_pool, "POOL_MIN_BYTES", 0)
    one = outcome(job, monkeypatch, 1)
    assert pooled == []
    many = outcome(job, monkeypatch, 3)
    assert pooled and pooled[0][0] > 10 and pooled[0][1] == 3
    assert many == one
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # the places are named in file order, whichever process rendered them
    assert f"the chat template fails on 6 prompts: {a}:5 (id 'p0004'): TemplateError: " in one
    assert (
        one.index(f"{a}:23 (id 'p0022')")
        < one.index(f"{a}:41 (id 'p0040')")
        < one.index(f"{b}:2 (id 'q0001')")
    )
    assert (
        f"{b}:50 (id 'q0049')" in one and f"{b}:56" not in one and "(and 1 more)" in one
    )  # five shown
    assert "do not fit the context length 3,000" in one and f"{a}:7 (" in one


@pytest.mark.slow
def test_the_pool_passes_a_run_to_the_same_counts(tmp_path, toy_tokenizer, monkeypatch):
    job = make_job(tmp_path, toy_tokenizer("qwen3"), n=400)
    monkeypatch.setattr(render_pool, "SLICE_BYTES", 2000)
    monkeypatch.setattr(render_pool, "POOL_MIN_BYTES", 0)
    one, many = outcome(job, monkeypatch, 1), outcome(job, monkeypatch, 2)
    assert many == one and sum(one[0].values()) == 400


def test_slices_are_whole_lines_that_cover_the_file(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [b"x" * (i % 13) + b"\n" for i in range(200)] + [
        b"y" * 5000 + b"\n",
        b"last line without newline",
    ]
    path.write_bytes(b"".join(lines))
    got = [piece[:3] for piece in render_pool.slices(str(path), size=64)]
    data = path.read_bytes()
    assert got[0][0] == 0 and sum(size for _, size, _ in got) == len(data)
    for (offset, size, line), nxt in zip(got, got[1:] + [(len(data), 0, None)]):
        assert offset + size == nxt[0]
        assert data.count(b"\n", 0, offset) + 1 == line  # the slice starts at line `line`
        assert offset == 0 or data[offset - 1 : offset] == b"\n"
    assert any(size > 5000 for _, size, _ in got)  # a line longer than a slice is read whole


def test_processes_default_to_the_cores_this_process_may_use(monkeypatch):
    import os

    monkeypatch.delenv(render_pool.ENV_PROCESSES, raising=False)
    assert render_pool.processes() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(render_pool.ENV_PROCESSES, "3")
    assert render_pool.processes() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(render_pool.ENV_PROCESSES, bad)
        with pytest.raises(
            BadInputError, match=f"{render_pool.ENV_PROCESSES}='{bad}': must be a whole number"
        ):
            render_pool.processes()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_redrawn_on_a_terminal_and_log_lines_elsewhere(monkeypatch, caplog):
    monkeypatch.setattr(render_pool, "DRAW_AFTER_S", 0)
    monkeypatch.setattr(render_pool, "DRAW_EVERY_S", 0)
    term = Terminal()
    bar = render_pool.RenderProgress(200, term)
    bar.update(50)
    bar.update(200)
    bar.close()
    shown = term.getvalue()
    assert shown.startswith("\r\x1b[Krendering prompts: 50 / 200 (25%), 0s")
    assert "\r\x1b[Krendering prompts: 200 / 200 (100%)" in shown and shown.endswith(
        "\r\x1b[K"
    )  # then cleared

    monkeypatch.setattr(render_pool, "LOG_EVERY_S", 0)
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="toolkit.job.render_pool"):
        bar = render_pool.RenderProgress(200, pipe)
        bar.update(100)
        bar.close()
    assert pipe.getvalue() == ""  # nothing drawn into a pipe or a file
    assert [r.getMessage() for r in caplog.records][0].startswith(
        "rendering prompts: 100 / 200 (50%)"
    )


def test_a_quick_job_draws_nothing(monkeypatch):
    term = Terminal()
    bar = render_pool.RenderProgress(10, term)
    bar.update(10)
    bar.close()
    assert term.getvalue() == ""


def test_a_slice_whose_file_changed_since_planning_is_an_error_naming_it(tmp_path, toy_tokenizer):
    from toolkit.job import chat
    from toolkit.job.schema import ModelSpec

    model = ModelSpec(path=str(toy_tokenizer("kimi")))
    tok = chat.load_tokenizer(model)
    setting = render_slice.Setting(
        model, chat.token_info(tok, model), 4096, *render_slice.bound_kind(tok, model)
    )
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    work = [
        render_slice.Slice(0, str(path), "d", False, 64, offset, size, line)
        for offset, size, line, *_ in render_pool.slices(str(path), size=8)
    ]
    assert len(work) == 2
    with pytest.raises(render_pool.RenderPoolError) as e:
        list(render_pool.measure(tok, setting, work, total=2, workers=1))
    assert str(e.value).startswith(f"{path}:2: field `prompt`: must be a string, got int")
    assert str(e.value).endswith("(the file changed while the job was being checked)")
