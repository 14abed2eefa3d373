"""Prompt sources as people have them: ShareGPT rows, compressed JSONL, parquet, a `datasets` folder, a hub
dataset in the local cache, a BOM; each read with its own library, with the same ids from content and the same
file:line (row) errors, and read back from the place the plan pinned."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import zstandard

from jobfiles import make_job, write_prompts
from toolkit.cli import main as cli_main
from toolkit.formats.frames import read_shard
from toolkit.formats.records import unpack_ids
from toolkit.formats.rundir import RunDir
from toolkit.job import chat
from toolkit.job.inputs import PromptReader, scan_dataset
from toolkit.job.plan import plan_job
from toolkit.job.promptline import InputError, content_digest
from toolkit.job.spec import load_spec

ROWS = [
    {"id": "a", "prompt": "What is 2 + 2?"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime."},
        ]
    },
    {
        "conversations": [
            {"from": "system", "value": "Be kind."},
            {"from": "human", "value": "Hello?"},
            {"from": "gpt", "value": "Hi."},
            {"from": "human", "value": "And then?"},
        ]
    },
    {"prompt": "Why is the sky blue?", "source": "physics"},
]


def jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def table(rows):
    """A table of `rows`, its columns those of every row (`Table.from_pylist` takes the first row's)."""
    import pyarrow as pa

    return pa.Table.from_struct_array(pa.array(rows))


def scanned(path, name="ds"):
    return [(p.id, p.line, p.messages) for p in scan_dataset(path, name)]


def read_back(path, prompts, name="ds"):
    """Each prompt again from its place, last to first (a compressed file is reopened to go back)."""
    with PromptReader() as reader:
        return [reader.read(path, name, p.line, p.offset, p.length) for p in reversed(prompts)][
            ::-1
        ]


@pytest.fixture
def plain(tmp_path):
    p = tmp_path / "ds.jsonl"
    p.write_bytes(jsonl(ROWS))
    return p


def test_sharegpt_rows_are_chats_with_specforge_roles_and_the_ids_of_the_same_messages(
    tmp_path, plain
):
    prompts = list(scan_dataset(plain, "ds"))
    share = prompts[2]
    assert share.messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And then?"},
    ]
    same = tmp_path / "same.jsonl"
    same.write_bytes(jsonl([{"messages": share.messages}]))
    assert (
        [p.id for p in scan_dataset(same, "ds")]
        == [share.id]
        == [f"ds:{content_digest(share.messages, None)}"]
    )
    # the conversations export's rows: role/content turns, a trailing assistant answer, kept as a messages row is
    exported = {
        "id": "x#0",
        "conversations": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "reasoning_content": "r"},
        ],
        "tools": [],
    }
    same.write_bytes(jsonl([exported]))
    (p,) = scan_dataset(same, "ds")
    assert p.id == "x#0" and p.messages == exported["conversations"] and p.tools is None


@pytest.mark.parametrize(
    "row, field, words",
    [
        (
            {"conversations": [{"from": "robot", "value": "x"}]},
            "conversations[0].from",
            "unknown speaker 'robot'",
        ),
        ({"conversations": [{"from": "human"}]}, "conversations[0].value", "missing"),
        (
            {"conversations": [{"from": "human", "value": " "}]},
            "conversations[0].value",
            "is empty",
        ),
        ({"conversations": []}, "conversations", "non-empty list"),
        (
            {"conversations": [{"from": "system", "value": "S"}]},
            "conversations",
            "only instructions",
        ),
        (
            {"conversations": [{"from": "human", "value": "x"}], "prompt": "y"},
            "messages",
            "has both `prompt` and",
        ),
        ({"id": "x"}, "messages", "`conversations` (a ShareGPT chat)"),
    ],
)
def test_bad_sharegpt_rows_name_their_field(tmp_path, row, field, words):
    p = tmp_path / "ds.jsonl"
    p.write_bytes(jsonl([ROWS[0], row]))
    with pytest.raises(InputError) as e:
        list(scan_dataset(p, "ds"))
    assert (
        (e.value.line, e.value.field) == (2, field)
        and words in str(e.value)
        and f"{p}:2:" in str(e.value)
    )


def test_a_bom_at_the_start_is_not_part_of_the_first_line(tmp_path, plain):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    prompts = list(scan_dataset(bom, "ds"))
    assert [(p.id, p.line, p.messages) for p in prompts] == scanned(plain)
    assert read_back(bom, prompts)[0].id == "a"


@pytest.mark.parametrize(
    "suffix, compress",
    [
        (".jsonl.gz", gzip.compress),
        (".jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_compressed_jsonl_reads_as_the_plain_file_and_back_from_its_place(
    tmp_path, plain, suffix, compress
):
    path = tmp_path / f"ds{suffix}"
    path.write_bytes(compress(plain.read_bytes()))
    prompts = list(scan_dataset(path, "ds"))
    assert [(p.id, p.line, p.messages) for p in prompts] == scanned(plain)
    assert [(p.offset, p.length) for p in prompts] == [
        (p.offset, p.length) for p in scan_dataset(plain, "ds")
    ]
    again = read_back(path, prompts)
    assert [(p.id, p.messages) for p in again] == [(p.id, p.messages) for p in prompts]


def test_a_bad_line_of_a_compressed_file_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "ds.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl([ROWS[0], {"prompt": 3}])))
    with pytest.raises(InputError, match=rf"^{path}:2: field `prompt`: must be a string"):
        list(scan_dataset(path, "ds"))


def test_parquet_rows_have_the_ids_of_the_same_jsonl_lines_and_are_read_back_by_row(
    tmp_path, plain
):
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "ds.parquet"
    pq.write_table(table(ROWS), path, row_group_size=2)
    prompts = list(scan_dataset(path, "ds"))
    assert [(p.id, p.line, p.messages) for p in prompts] == scanned(plain)  # line: the row number
    assert [(p.offset, p.length) for p in prompts] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert [(p.id, p.messages) for p in read_back(path, prompts)] == [
        (p.id, p.messages) for p in prompts
    ]
    pq.write_table(table([ROWS[0], {"prompt": ""}]), path)
    with pytest.raises(InputError, match=rf"^{path}:2: field `prompt`: is empty"):
        list(scan_dataset(path, "ds"))


def test_without_pyarrow_a_parquet_file_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "ds.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as on a login node without it
    with pytest.raises(InputError, match=r"needs the pyarrow package.*: pip install pyarrow$"):
        list(scan_dataset(path, "ds"))


def test_a_datasets_folder_and_a_hub_dataset_in_the_local_cache(tmp_path, plain, monkeypatch):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset(table(ROWS))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert scanned(tmp_path / "saved") == scanned(plain)
    prompts = list(scan_dataset(tmp_path / "saved", "ds"))
    assert [p.messages for p in read_back(tmp_path / "saved", prompts)] == [
        p.messages for p in prompts
    ]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(
        InputError, match=r"a DatasetDict of splits test, train: name one of their folders"
    ):
        list(scan_dataset(tmp_path / "dict", "ds"))
    assert scanned(tmp_path / "dict" / "test") == scanned(plain)

    # a dataset repository as the hub cache holds it (hf download), read offline
    import huggingface_hub

    # (HF_HOME as this process would have had it: both libraries read it when they are imported)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    repo = tmp_path / "hf" / "hub" / "datasets--org--prompts"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    (repo / "snapshots" / commit / "data" / "train.jsonl").write_bytes(plain.read_bytes())
    (repo / "snapshots" / commit / "data" / "test.jsonl").write_bytes(jsonl(ROWS[:1]))
    assert scanned("hf://datasets/org/prompts") == scanned(plain)
    assert [i for i, _, _ in scanned("hf://datasets/org/prompts:test")] == ["a"]
    with pytest.raises(
        InputError, match=r"dataset org/missing is not in the local hub cache .*hf download"
    ):
        list(scan_dataset("hf://datasets/org/missing", "ds"))


@pytest.mark.parametrize(
    "name, data, words",
    [
        (
            "ds.jsonl",
            gzip.compress(b'{"prompt": "x"}\n', mtime=0),
            "gzip-compressed but named .jsonl: name it with .jsonl.gz",
        ),
        (
            "ds.jsonl",
            zstandard.ZstdCompressor().compress(b'{"prompt": "x"}\n'),
            "zstd-compressed but named .jsonl",
        ),
        (
            "ds.jsonl",
            b"PAR1\x15\x04" + b"\0" * 40,
            "a parquet file but named .jsonl: name it with .parquet",
        ),
        ("ds.jsonl.gz", b'{"prompt": "x"}\n', "named .gz but not gzip-compressed"),
        ("ds.jsonl", b"PK\x03\x04" + b"\0" * 40, "a zip archive"),
        ("ds.jsonl", '{"prompt": "x"}\n'.encode("utf-16"), "UTF-16 text, not UTF-8"),
        ("ds.bin", b'{"prompt": "x"}\n\x00\x01\x02', "not UTF-8 text (binary data)"),
        ("ds.json", b'[{"prompt": "x"},\n {"prompt": "y"}]\n', "a JSON array, not JSON lines"),
        ("ds.jsonl", b'{\n  "prompt": "x"\n}\n', "pretty-printed JSON, not JSON lines"),
    ],
)
def test_what_cannot_be_read_is_named_for_what_it_is(tmp_path, name, data, words):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(InputError) as e:
        list(scan_dataset(path, "ds"))
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value)
    assert (
        e.value.line is None
        and "skip" not in str(e.value)
        and "re-encode the file" not in str(e.value)
    )


def test_check_names_the_file_and_row_of_a_bad_parquet_row(tmp_path, toy_tokenizer, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(table([{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": " "}]), path)
    job = make_job(tmp_path, toy_tokenizer("kimi"), prompts=path)
    assert cli_main(["check", str(job)]) == 2
    assert f"{path}:3: field `prompt`: is empty" in capsys.readouterr().err


def test_check_renders_a_table_in_slices_of_rows_on_several_processes(
    tmp_path, toy_tokenizer, monkeypatch, capsys
):
    pq = pytest.importorskip("pyarrow.parquet")
    from toolkit.job import readers, render_pool

    rows = [json.loads(x) for x in write_prompts(tmp_path / "w.jsonl", 7).read_text().splitlines()]
    pq.write_table(table(rows), tmp_path / "p.parquet", row_group_size=2)
    monkeypatch.setattr(readers, "ROWS_PER_CHUNK", 3)
    monkeypatch.setattr(render_pool, "POOL_MIN_BYTES", 0)
    monkeypatch.setenv(render_pool.ENV_PROCESSES, "2")
    assert [piece[:4] for piece in render_pool.slices(str(tmp_path / "p.parquet"))] == [
        (0, 3, 1, None),
        (3, 3, 4, None),
        (6, 1, 7, None),
    ]
    job = make_job(tmp_path, toy_tokenizer("kimi"), prompts=tmp_path / "p.parquet")
    assert cli_main(["check", str(job)]) == 0
    assert "ok — 7 prompts" in capsys.readouterr().out


def test_the_same_prompt_has_one_id_in_jsonl_and_parquet_plans(tmp_path, toy_tokenizer):
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {k: v for k, v in json.loads(x).items() if k != "id"}
        for x in write_prompts(tmp_path / "w.jsonl", 5, tools_every=2).read_text().splitlines()
    ]
    (tmp_path / "p.jsonl").write_bytes(jsonl(rows))
    pq.write_table(table(rows), tmp_path / "p.parquet")
    ids = [
        [
            r.id
            for r in plan_job(
                load_spec(
                    make_job(tmp_path / kind, toy_tokenizer("kimi"), prompts=tmp_path / f"p.{kind}")
                )
            )[1]
        ]
        for kind in ("jsonl", "parquet")
    ]
    assert ids[0] == ids[1] and len(set(ids[0])) == 5


def _run_and_rows(tmp_path: Path, tok: Path, prompts: Path, fmt: str = "jsonl") -> list[dict]:
    job = make_job(
        tmp_path,
        tok,
        prompts=prompts,
        shards=2,
        sampling={"max_new_tokens": 32},
        audit={"max_length_share": 1.0},
    )
    assert cli_main(["run", str(job)]) == 0
    out = tmp_path / f"out.{fmt}.jsonl"
    assert cli_main(["export", str(tmp_path / "run"), "--format", fmt, "-o", str(out)]) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zst", "parquet", "saved"])
def test_a_run_over_a_compressed_or_parquet_input_generates_every_prompt(
    tmp_path, toy_tokenizer, kind
):
    src = write_prompts(tmp_path / "w.jsonl", 9, extra=lambda i: {"source": f"s{i}"})
    if kind == "zst":
        prompts = tmp_path / "p.jsonl.zst"
        prompts.write_bytes(zstandard.ZstdCompressor().compress(src.read_bytes()))
    elif kind == "saved":
        datasets = pytest.importorskip("datasets")
        prompts = tmp_path / "saved"
        datasets.Dataset(table([json.loads(x) for x in src.read_text().splitlines()])).save_to_disk(
            str(prompts)
        )
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        prompts = tmp_path / "p.parquet"
        pq.write_table(
            table([json.loads(x) for x in src.read_text().splitlines()]), prompts, row_group_size=4
        )
    rows = _run_and_rows(tmp_path / "job", toy_tokenizer("kimi"), prompts)
    assert sorted(r["id"] for r in rows) == [f"p{i:04d}" for i in range(9)]
    # the worker sent each record its own prompt: the ids of the prompt the source line renders to
    tok = chat.load_tokenizer(load_spec(tmp_path / "job" / "job.toml").model)
    lines = {p.id: p for p in scan_dataset(src, "d")}
    recs = [r for k in range(2) for r in read_shard(RunDir(tmp_path / "job" / "run").shard_file(k))]
    assert len(recs) == 9
    assert all(
        unpack_ids(r.prompt_ids)
        == chat.render(tok, load_spec(tmp_path / "job" / "job.toml").model, lines[r.id])
        for r in recs
    )
    # each record carries its own prompt line's fields: the worker and the export read the right prompt back
    assert all(r["meta"] == {"source": f"s{int(r['id'][1:])}"} for r in rows)


@pytest.mark.slow
def test_the_conversations_export_read_back_as_a_job_input_checks(tmp_path, toy_tokenizer, capsys):
    tok = toy_tokenizer("kimi")
    rows = _run_and_rows(
        tmp_path / "first", tok, write_prompts(tmp_path / "w.jsonl", 6), "conversations"
    )
    out = tmp_path / "first" / "out.conversations.jsonl"
    assert len(rows) == 6 and all(r["conversations"][-1]["role"] == "assistant" for r in rows)
    job = make_job(tmp_path / "again", tok, prompts=out)
    capsys.readouterr()
    assert cli_main(["check", str(job)]) == 0
    assert "ok — 6 prompts" in capsys.readouterr().out
    prompts = list(scan_dataset(out, "d"))
    assert [p.messages for p in prompts] == [r["conversations"] for r in rows]
