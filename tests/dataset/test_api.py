"""The Python API as a user meets it: `dir(toolkit)` and `help(toolkit)` show the API alone, records read under the
exports' field names, `to_dataset(view="tokens")` is the tokens export's training rows, and a script beside a clone
named `toolkit` imports the package."""

from __future__ import annotations

import json
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import runs
import toolkit
from toolkit.dataset.export import export_run
from toolkit.dataset.merge import merge_run
from toolkit.errors import ToolkitError
from toolkit.formats.frames import read_shard

ROOT = Path(__file__).resolve().parents[2]


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def merged(tmp_path_factory, toy_tokenizer):
    """A merged kimi run of 2 samples per prompt: healthy outputs, a truncated one, one without think-end and a
    failure (training rows leave the three out)."""
    s = runs.plan_run(
        tmp_path_factory.mktemp("api"),
        toy_tokenizer("kimi"),
        datasets={"math": 5, "chat": 3},
        shards=2,
        sampling={"n": 2, "temperature": 0.7},
    )
    runs.write_run(s, runs.mix(runs.healthy(), p2=runs.truncated, p6=runs.no_think_end), failed=[9])
    merge_run(s.root)
    return s


def test_dir_and_help_show_the_api_alone():
    assert dir(toolkit) == sorted(toolkit.__all__)
    assert set(toolkit.__all__) == {
        "Record",
        "read_rows",
        "read_run",
        "read_shard",
        "to_dataset",
        "unpack_ids",
    }
    assert all(hasattr(toolkit, name) for name in toolkit.__all__)
    text = pydoc.plain(pydoc.render_doc(toolkit))
    assert "\nDATA\n" not in text  # no `annotations = _Feature(...)`, no imported names
    for name in ("annotations", "logging", "Iterator", "Path", "Any"):
        assert name not in dir(toolkit)
    assert "    to_dataset(run_dir: str | pathlib.Path, *, ok_only: bool = True" in text
    assert "view: str = 'records', trainer: str | None = None" in text


def test_a_record_reads_its_finish_under_the_exports_name(merged, tmp_path):
    recs = list(toolkit.read_run(merged.root))
    assert {r.finish_reason for r in recs} == {"stop", "length", None}  # None: the failed request
    assert all(r.finish_reason == r.finish for r in recs)
    rows = {r.id: r.finish_reason for r in toolkit.read_rows(merged.root)}
    assert rows == {r.id: r.finish_reason for r in recs}
    export_run(merged.root, "jsonl", tmp_path / "r.jsonl", include_failed=True)
    assert {x["id"]: x["finish_reason"] for x in lines(tmp_path / "r.jsonl")} == rows
    # the stored form is unchanged: a shard file written as before decodes, field for field
    rec = next(read_shard(merged.rd.shard_file(0)))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rec), type=toolkit.Record) == rec
    assert "finish_reason" not in toolkit.Record.__struct_fields__


@pytest.mark.parametrize("trainer", ["specforge", "speculators"])
def test_the_tokens_view_is_the_tokens_exports_rows_as_uint32_ids(merged, tmp_path, trainer):
    import pyarrow as pa

    ds = toolkit.to_dataset(merged.root, view="tokens", trainer=trainer, cache_dir=tmp_path / "hf")
    export_run(merged.root, "tokens", tmp_path / "t.jsonl", trainer=trainer)
    exported = lines(tmp_path / "t.jsonl")
    assert ds.to_list() == exported  # the same rows, the same order, the same mask
    assert ds.data.schema.field("input_ids").type == pa.list_(pa.uint32())
    assert ds.data.schema.field("loss_mask").type == pa.list_(pa.uint8())
    by_index = {r.index: r.id for r in merged.written.values()}
    failed = next(r for r in merged.written.values() if r.status != "ok")
    # the output cut by max_new_tokens (index 2) is the model's own: kept
    left_out = {by_index[6]: "no_think_end", failed.id: failed.failure}
    assert {x["id"]: x["reason"] for x in lines(tmp_path / "t_skipped.jsonl")} == left_out
    assert ds["id"] == [by_index[i] for i in sorted(by_index) if by_index[i] not in left_out]
    everything = toolkit.to_dataset(
        merged.root, cache_dir=tmp_path / "hf"
    )  # the records view keeps the ok ones
    assert everything["id"] == [by_index[i] for i in sorted(by_index) if i != failed.index]
    assert everything["finish_reason"][2] == "length"


def test_the_tokens_views_mask_follows_the_trainer(merged, tmp_path):
    views = {
        t: toolkit.to_dataset(merged.root, view="tokens", trainer=t, cache_dir=tmp_path / "hf")
        for t in ("specforge", "speculators")
    }
    assert views["specforge"]["input_ids"] == views["speculators"]["input_ids"]
    # the template opens <think> after its assistant header: SpecForge supervises it, speculators does not
    assert [sum(m) for m in views["specforge"]["loss_mask"]] == [
        sum(m) + 1 for m in views["speculators"]["loss_mask"]
    ]


def test_the_tokens_view_refuses_what_the_export_refuses(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path / "r", toy_tokenizer("kimi"), datasets={"math": 4}, shards=1)
    runs.write_run(s)
    with pytest.raises(
        ToolkitError, match=r"toolkit merge"
    ):  # not merged: the export's own words, not datasets'
        toolkit.to_dataset(s.root, view="tokens", cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match=r"view='row': choose one of 'records', 'tokens'"):
        toolkit.to_dataset(s.root, view="row", cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match=r"trainer= is the tokens view's"):
        toolkit.to_dataset(s.root, trainer="speculators", cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match=r"ok_only=False"):
        toolkit.to_dataset(s.root, view="tokens", ok_only=False, cache_dir=tmp_path / "hf")
    assert not list((tmp_path / "hf").glob("toolkit-tokens-*"))  # the temporary export removed


def test_a_script_beside_a_clone_named_toolkit_imports_the_package(tmp_path):
    (tmp_path / "toolkit").symlink_to(ROOT, target_is_directory=True)  # a clone named toolkit
    (tmp_path / "script.py").write_text(
        "import toolkit, toolkit.cli\n"
        "print(toolkit.__file__)\nprint(toolkit.cli.__file__)\nprint(' '.join(dir(toolkit)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it
    r = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    package, cli, names = r.stdout.splitlines()
    assert Path(package).resolve() == ROOT / "toolkit" / "__init__.py"
    assert Path(cli).resolve() == ROOT / "toolkit" / "cli" / "__init__.py"
    assert names.split() == sorted(toolkit.__all__)
    # and `python -m toolkit` started in that folder, as the toolkit starts its own processes
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("toolkit "), r.stderr
