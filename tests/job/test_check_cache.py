"""What `check` learned is kept in the run directory: the same inputs are not rendered again by a second check,
by submit or by run; a changed prompt file renders its own dataset again, a changed template every dataset."""

from __future__ import annotations

import json

import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.cli import main
from toolkit.formats.rundir import RunDir
from toolkit.job import chat, render_pool, render_slice


@pytest.fixture
def rendered(monkeypatch):
    """The prompts rendered (by dataset), and the tokenizers loaded, in this process (one render process)."""
    monkeypatch.setenv(render_pool.ENV_PROCESSES, "1")
    seen = {"prompts": {}, "loads": 0}
    texts, load = render_slice._texts, chat.load_tokenizer

    def counting_texts(tok, model, prompts, *a, **kw):
        for p in prompts:
            seen["prompts"][p.dataset] = seen["prompts"].get(p.dataset, 0) + 1
        return texts(tok, model, prompts, *a, **kw)

    def counting_load(model):
        seen["loads"] += 1
        return load(model)

    monkeypatch.setattr(render_slice, "_texts", counting_texts)
    monkeypatch.setattr(chat, "load_tokenizer", counting_load)

    def take():
        out = dict(seen)
        seen["prompts"], seen["loads"] = {}, 0
        return out

    return take


def job_of_two(tmp_path, tok, **tables):
    a = write_prompts(tmp_path / "a.jsonl", 20)
    b = write_prompts(tmp_path / "b.jsonl", 30, prefix="q")
    job = make_job(tmp_path, tok, prompts=a, **tables)
    job.write_text(job.read_text() + f'[[datasets]]\nname = "e"\npath = "{b}"\n')
    return job, a, b


def check(job, capsys):
    code = main(["check", str(job)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_a_second_check_and_submit_render_nothing_again(tmp_path, toy_tokenizer, capsys, rendered):
    job, _, _ = job_of_two(tmp_path, toy_tokenizer("kimi"))
    first = check(job, capsys)
    assert rendered() == {"prompts": {"d": 20, "e": 30}, "loads": 1}
    assert (tmp_path / "run" / "check.msgpack").is_file() and not RunDir.is_run(tmp_path / "run")
    assert check(job, capsys) == first  # the same report, from what was kept
    assert rendered() == {"prompts": {}, "loads": 0}  # nothing rendered, no tokenizer loaded
    rd, _ = prepared_run(job)  # what `submit` and `run` do before the run directory
    assert rendered() == {"prompts": {}, "loads": 0} and RunDir.is_run(rd.root)
    assert rd.check_file.is_file()


def test_a_changed_line_renders_its_dataset_again(tmp_path, toy_tokenizer, capsys, rendered):
    job, a, b = job_of_two(tmp_path, toy_tokenizer("kimi"))
    check(job, capsys)
    rendered()
    lines = b.read_text().splitlines()
    row = json.loads(lines[7])
    row["messages"][0]["content"] = "A question changed since the last check."
    lines[7] = json.dumps(row)
    b.write_text("\n".join(lines) + "\n")
    check(job, capsys)
    assert rendered() == {"prompts": {"e": 30}, "loads": 1}
    check(job, capsys)
    assert rendered()["prompts"] == {}


def test_a_changed_template_or_context_renders_everything_again(
    tmp_path, toy_tokenizer, capsys, rendered
):
    job, _, _ = job_of_two(tmp_path, toy_tokenizer("kimi"))
    check(job, capsys)
    rendered()
    job2, _, _ = job_of_two(
        tmp_path, toy_tokenizer("kimi"), model={"chat_template_kwargs": {"thinking": True}}
    )
    check(job2, capsys)
    assert rendered()["prompts"] == {"d": 20, "e": 30}
    job3, _, _ = job_of_two(
        tmp_path,
        toy_tokenizer("kimi"),
        model={"chat_template_kwargs": {"thinking": True}},
        stub={"context_length": 9000},
    )
    check(job3, capsys)
    assert rendered()["prompts"] == {"d": 20, "e": 30}


def test_a_failed_check_keeps_nothing_and_a_damaged_file_is_ignored(
    tmp_path, toy_tokenizer, capsys, rendered
):
    job, a, _ = job_of_two(tmp_path, toy_tokenizer("kimi"))
    good = a.read_text()
    a.write_text(good.replace('"role": "user"', '"role": "bot"', 1))
    assert main(["check", str(job)]) == 2
    assert not (tmp_path / "run").exists()
    a.write_text(good)
    check(job, capsys)
    rendered()
    (tmp_path / "run" / "check.msgpack").write_bytes(b"\x93not a cache")
    check(job, capsys)
    assert rendered()["prompts"] == {"d": 20, "e": 30}


def test_nothing_is_kept_in_another_jobs_run_nor_beside_it_by_a_dry_run(
    tmp_path, toy_tokenizer, capsys, rendered
):
    from toolkit.job.prepare import prepare_run

    job, _, _ = job_of_two(tmp_path, toy_tokenizer("kimi"))
    rd, _ = prepared_run(job)  # a run of this job in output_dir
    kept = rd.check_file.read_bytes()
    other = make_job(tmp_path / "other", toy_tokenizer("kimi"), n=5, name="other")
    other.write_text(
        other.read_text().replace(str(tmp_path / "other" / "run"), str(tmp_path / "run"))
    )
    assert main(["check", str(other)]) == 0 and "holds another run" in capsys.readouterr().out
    prepare_run(other, dry_run=True, as_submitted=True, new_run=True)  # submit --dry-run --new-run
    assert rd.check_file.read_bytes() == kept  # the other job's run keeps its own
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run")) == [
        "run"
    ]  # no run beside it


def test_a_dry_run_of_submit_writes_nothing_but_reads_what_check_kept(
    tmp_path, toy_tokenizer, capsys, rendered, monkeypatch
):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no cluster answers: the same on every machine
    job, _, _ = job_of_two(tmp_path, toy_tokenizer("kimi"))
    assert main(["submit", str(job), "--dry-run"]) == 0
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"
    check(job, capsys)
    rendered()
    assert main(["submit", str(job), "--dry-run"]) == 0
    assert rendered() == {"prompts": {}, "loads": 0}
