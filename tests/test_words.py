"""What the help, the template and the docs say matches what the toolkit does: no stale words, no reference to
a table that is not there, and a run with samples counts its outputs as outputs of fewer prompts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from jobfiles import make_job

ROOT = Path(__file__).resolve().parents[1]

# Tasks claim shards one after another: a task is not one shard any more.
STALE = [
    re.compile(r"(one|an?) (slurm )?array task per shard", re.I),
    re.compile(r"\bits some\b", re.I),
]


def _texts() -> dict[str, str]:
    help_text = subprocess.run(
        [sys.executable, "-m", "toolkit", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    submit_help = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    texts = {"toolkit --help": help_text, "toolkit submit --help": submit_help}
    for path in [
        ROOT / "README.md",
        ROOT / "templates" / "job.toml",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "toolkit").rglob("*.py")),
    ]:
        texts[str(path.relative_to(ROOT))] = path.read_text()
    return texts


def test_no_stale_words_in_help_template_docs_or_code():
    texts = _texts()
    assert "claim" in texts["toolkit submit --help"], (
        "submit's help says its tasks claim the shards"
    )
    found = [
        f"{name}: {m.group(0)!r}"
        for name, text in texts.items()
        for rx in STALE
        for m in rx.finditer(text)
    ]
    assert not found, "stale words: " + "; ".join(found)


def test_a_reference_to_a_table_above_has_a_table_above():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"the table above", text):
            before = text[: m.start()]
            assert re.search(r"^\|.*\|\s*$", before, re.M), (
                f"{path.name}: 'the table above' with no table above it"
            )


def test_the_grown_run_refusal_reads_as_english():
    from toolkit.job import grow

    source = Path(grow.__file__).read_text()
    assert "but its {what}" not in source and "some of its prompts changed or are gone" in source


def test_samples_are_counted_as_outputs_of_fewer_prompts(tmp_path, toy_tokenizer):
    """30 prompts × 2 samples are 60 outputs, not "60 prompts", in check and the dry run."""
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=30,
        sampling={"max_new_tokens": 16, "temperature": 1.0, "n": 2},
    )
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "check", str(job)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert "60 outputs (30 prompts × 2 samples) in 1 dataset" in first, first
    assert "60 prompts" not in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": str(tmp_path / "none.conf")},
    )
    assert "dry run: 60 outputs (30 prompts × 2 samples) in 1 dataset" in r.stdout, (
        r.stdout + r.stderr
    )


def test_one_sample_per_prompt_is_counted_in_prompts(tmp_path, toy_tokenizer):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=30)
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "check", str(job)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert ": ok — 30 prompts in 1 dataset" in r.stdout.splitlines()[0]
