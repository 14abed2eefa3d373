"""The Python API reads a run as its merged dataset would hold it: the newest attempt of each planned id, in
planned order, merged or not, with its text, and as a Hugging Face `datasets.Dataset`."""

from __future__ import annotations

import builtins
import json
import random

import msgspec
import pytest

import runs
import toolkit
from toolkit.dataset.export import export_run
from toolkit.dataset.merge import merge_run
from toolkit.formats.frames import read_shard
from toolkit.formats.records import OK, PARTIAL, unpack_ids


def _source(i: int) -> dict:
    return {"source": f"set-{i % 3}", "level": i}


@pytest.fixture
def retried(tmp_path, toy_tokenizer):
    """A run of 2 samples per prompt whose shard files hold, besides one record per id: a failed record and its
    retry, a partial output kept at a stop and the record that continued it in a second segment, a record
    written twice (a task that ran twice), and a partial output never continued; one shard has no done manifest."""
    s = runs.plan_run(
        tmp_path,
        toy_tokenizer("kimi"),
        datasets={"math": 5, "chat": 3},
        shards=2,
        extra=_source,
        sampling={"n": 2, "temperature": 0.7},
    )
    first = runs.write_run(s, failed=[1], done=[1])
    cut = msgspec.structs.replace(
        first[s.refs[2].id],
        status=PARTIAL,
        finish="abort",
        output_ids=first[s.refs[2].id].output_ids[: 4 * 9],
        reasoning_end=None,
    )
    cut_open = msgspec.structs.replace(
        first[s.refs[5].id],
        status=PARTIAL,
        finish="abort",
        output_ids=first[s.refs[5].id].output_ids[: 4 * 3],
        reasoning_end=None,
    )
    healthy = runs.healthy()
    rng = random.Random(5)
    retry = runs.record(s, 1, healthy(s, 1, rng), attempts=2)
    continued = msgspec.structs.replace(first[s.refs[2].id], segments=2, attempts=2)
    twice = runs.record(s, 3, healthy(s, 3, rng))
    runs.write_shard(s, 0, [cut, retry, twice, cut_open, continued], done=False)
    newest = dict(first)
    newest.update(
        {retry.id: retry, continued.id: continued, twice.id: twice, cut_open.id: cut_open}
    )
    s.newest = [newest[r.id] for r in s.refs]
    return s


def test_read_run_yields_the_newest_attempt_of_each_id_in_planned_order(retried):
    s = retried
    written = [r for k in range(2) for r in read_shard(s.rd.shard_file(k))]
    assert len(written) == len(s.refs) + 5  # the shard files hold superseded attempts
    got = list(toolkit.read_run(s.root))
    assert [r.id for r in got] == [r.id for r in s.refs]
    assert [msgspec.msgpack.encode(r) for r in got] == [msgspec.msgpack.encode(r) for r in s.newest]
    by_id = {r.id: r for r in got}
    assert by_id[s.refs[1].id].status == OK and by_id[s.refs[1].id].attempts == 2
    assert by_id[s.refs[2].id].status == OK and by_id[s.refs[2].id].segments == 2
    assert (
        by_id[s.refs[5].id].status == PARTIAL
    )  # never continued: what there is, said by its status
    assert {r.id.rsplit("#", 1)[1] for r in got} == {"0", "1"}


def test_read_run_reads_a_current_merge_and_the_shards_again_once_they_changed(retried):
    s = retried
    merge_run(s.root, allow_incomplete=True)
    merged = [msgspec.msgpack.encode(r) for r in read_shard(s.rd.merged_file)]
    assert [msgspec.msgpack.encode(r) for r in toolkit.read_run(s.root)] == merged
    again = runs.record(s, 5, runs.healthy()(s, 5, random.Random(9)))
    runs.write_shard(s, 0, [again], done=False)  # the partial output continued since the merge
    got = {r.id: r for r in toolkit.read_run(s.root)}
    assert got[again.id].status == OK and msgspec.msgpack.encode(
        got[again.id]
    ) == msgspec.msgpack.encode(again)


def test_read_rows_have_the_text_sample_and_meta_of_the_jsonl_export(retried, tmp_path):
    s = retried
    rows = list(toolkit.read_rows(s.root))
    assert [r.id for r in rows] == [r.id for r in s.refs]
    assert [(r.sample, r.status) for r in rows[:4]] == [(0, "ok"), (1, "ok"), (0, "ok"), (1, "ok")]
    dec = lambda ids: s.tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    for row, rec in zip(rows, s.newest):
        if rec.status == OK:
            out = unpack_ids(rec.output_ids)
            assert row.reasoning == dec(out[: rec.reasoning_end]) and row.content == dec(
                out[rec.reasoning_end + 1 : -1]
            )
        assert row.meta == _source(int(row.id.split("-")[1].split("#")[0]))
    ok = list(toolkit.read_rows(s.root, ok_only=True))
    assert len(ok) == len(rows) - 1 and all(r.status == OK for r in ok)
    merge_run(s.root, allow_incomplete=True)
    export_run(s.root, "jsonl", tmp_path / "e.jsonl")
    exported = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [msgspec.structs.asdict(r) for r in ok] == exported


def test_to_dataset_is_a_datasets_dataset_of_the_ok_rows_and_follows_the_run(retried, tmp_path):
    import datasets  # an optional dependency of the toolkit; the test extras install it

    s = retried
    ds = toolkit.to_dataset(s.root, cache_dir=tmp_path / "hf")
    assert isinstance(ds, datasets.Dataset)
    ok = list(toolkit.read_rows(s.root, ok_only=True))
    assert ds.num_rows == len(ok) and ds["id"] == [r.id for r in ok]
    assert ds["reasoning"] == [r.reasoning for r in ok] and ds["output_ids"] == [
        r.output_ids for r in ok
    ]
    assert [json.loads(m) for m in ds["meta"]] == [r.meta for r in ok]
    import pyarrow as pa

    from toolkit.dataset.export import rows_schema

    # the parquet export's column types: ids as uint32 (4 bytes a token in the cache, not int64's 8)
    assert ds.data.schema.equals(rows_schema(pa), check_metadata=False)
    assert ds.data.schema.field("output_ids").type == pa.list_(pa.uint32())
    assert toolkit.to_dataset(s.root, ok_only=False, cache_dir=tmp_path / "hf").num_rows == len(
        s.refs
    )
    again = runs.record(s, 5, runs.healthy()(s, 5, random.Random(9)))
    runs.write_shard(
        s, 0, [again], done=False
    )  # the partial output continued: not a dataset cached before it
    assert toolkit.to_dataset(s.root, cache_dir=tmp_path / "hf").num_rows == len(ok) + 1


def test_to_dataset_without_the_datasets_package_says_how_to_get_it(retried, monkeypatch, tmp_path):
    real = builtins.__import__

    def without_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ModuleNotFoundError("No module named 'datasets'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_datasets)
    with pytest.raises(
        ImportError, match=r"to_dataset needs the `datasets` package: pip install datasets"
    ):
        toolkit.to_dataset(retried.root, cache_dir=tmp_path)


def test_the_python_examples_of_the_readme_and_the_docs_run(tmp_path, toy_tokenizer):
    """The README's and docs/dataset.md's Python blocks, run against a merged run (theirs is runs/demo): their
    training rows (`view="tokens"`) are a merged run's."""
    s = runs.plan_run(
        tmp_path / "demo",
        toy_tokenizer("kimi"),
        datasets={"math": 5, "chat": 3},
        shards=2,
        extra=_source,
        sampling={"n": 2, "temperature": 0.7},
    )
    runs.write_run(s, runs.mix(runs.healthy(), p3=runs.truncated), failed=[1])
    merge_run(s.root)
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocks = [
        b
        for page in ("README.md", "docs/dataset.md")
        for b in re.findall(r"```python\n(.*?)```", (root / page).read_text(), re.S)
    ]
    assert len(blocks) == 2 and all(
        "toolkit.to_dataset" in b and 'view="tokens"' in b for b in blocks
    )
    printed: list[str] = []
    for block in blocks:
        code = block.replace('"runs/demo"', repr(str(s.root)))
        code = code.replace(
            "toolkit.to_dataset(",
            f"toolkit.to_dataset(cache_dir={str(tmp_path / 'hf')!r}, run_dir=",
        )
        exec(compile(code, "example", "exec"), {"print": lambda *args: printed.append(args[0])})
    ok = [r.id for r in sorted(s.written.values(), key=lambda r: r.index) if r.status == OK]
    assert len(ok) == 2 * 8 - 1 and printed == ok + ok  # the ok rows, once per block
