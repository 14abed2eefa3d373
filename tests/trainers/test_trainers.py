"""Token for token into the trainer: the drafter trainers' OWN data code (SpecForge 0.2.0 and speculators 0.9.0, in
the venv of tests/trainers/install.sh) on the exports of stub runs with real chat templates — a reasoning run with
tool calls and regenerated multi-turn conversations (Kimi-K2-Thinking's template), DeepSeek-R1's template (which
drops reasoning from assistant turns), and a non-reasoning run (Qwen3 with thinking off).

Row by row: the ids each trainer's loader produces equal the ids the run stored, and its loss mask is the one the
toolkit documents for that trainer (docs/dataset.md): SpecForge supervises from the end of the template's assistant
header (a think-start the template wrote included), speculators from the end of the generation prompt. The
conversations export's own round trip (which rows keep the exact ids) agrees with what SpecForge's loader does.
And SpecForge's own training loop runs a few CPU steps from the tokens export (train_steps.py).
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import trainertier

from jobfiles import make_job, write_prompts
from toolkit import read_run, unpack_ids
from toolkit.cli import main as cli_main
from toolkit.dataset.export import export_run
from toolkit.job import chat
from toolkit.job.spec import load_spec

pytestmark = pytest.mark.trainers


@pytest.fixture(scope="module", autouse=True)
def venv():
    why = trainertier.missing()
    if why:
        pytest.fail(why)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def chats(k: int) -> list[dict]:
    out = []
    for i in range(k):
        msgs = [{"role": "system", "content": "Answer briefly."}] if i % 2 else []
        for t in range(2 + i % 2):
            msgs += [{"role": "user", "content": f"question {t} of chat {i}: what is {i} times {t + 3}?"},
                     {"role": "assistant", "content": f"source answer {i}.{t}"}]
        out.append({"id": f"c{i}", "messages": msgs})
    return out


class Run:
    """A finished stub run: its job, run directory, tokenizer folder, stored ids per record id, think-start id."""

    def __init__(self, job: Path, tokenizer: Path):
        self.job, self.tokenizer = job, tokenizer
        self.root = job.parent / "run"
        self.stored = {r.id: (unpack_ids(r.prompt_ids), unpack_ids(r.output_ids)) for r in read_run(self.root)}
        spec = load_spec(job)
        tok = chat.load_tokenizer(spec.model)
        info = chat.token_info(tok, spec.model)
        self.think_start, self.blank = info.think_start_id, set(info.blank_ids)


def make_run(tmp: Path, tokenizer: Path, *, regenerate: bool = True, tools: bool = True, **tables) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    single = write_prompts(tmp / "single.jsonl", 16, tools_every=3 if tools else 0)
    job = make_job(tmp, tokenizer, prompts=single, sampling={"max_new_tokens": 160},
                   audit={"max_length_share": 1.0, "max_failed_share": 1.0},
                   **tables)
    if regenerate:
        regen = tmp / "chats.jsonl"
        regen.write_text("".join(json.dumps(c) + "\n" for c in chats(6)))
        job.write_text(job.read_text() + f'[[datasets]]\nname = "chats"\npath = "{regen}"\nregenerate = true\n')
    assert cli_main(["run", str(job)]) in (0, 1)  # the audit may fail: the stub truncates some outputs
    return Run(job, tokenizer)


def documented_mask(run: Run, prompt: list[int], n_output: int, trainer: str) -> list[int]:
    """The loss mask docs/dataset.md gives for `trainer`, written from the rule, not from the export's code: every
    output id supervised; the prompt not, except, for SpecForge, a think-start the template wrote at its end (and the
    blanks after it)."""
    head = len(prompt)
    if trainer == "specforge":
        k = len(prompt) - 1
        while k >= 0 and prompt[k] in run.blank:
            k -= 1
        if k >= 0 and prompt[k] == run.think_start:
            head = k
    return [0] * head + [1] * (len(prompt) - head + n_output)


def through_tokens(run: Run, tmp: Path, trainer: str) -> tuple[int, int, int]:
    """The tokens export for `trainer` through its own loader: (rows identical in ids and mask, rows, tool rows)."""
    out = tmp / f"tokens-{trainer}.jsonl"
    s = export_run(run.root, output=out, trainer=trainer)  # the default format
    assert s.format == "tokens" and s.rows > 0
    rows = lines(out)
    kind = "specforge-tokens" if trainer == "specforge" else "speculators"
    got = trainertier.load(kind, run.tokenizer, out, tmp / f"{kind}.json")
    want = []
    for row in rows:
        prompt, output = run.stored[row["id"]]
        want.append((tuple(prompt + output), tuple(documented_mask(run, prompt, len(output), trainer))))
    have = [(tuple(g["input_ids"]), tuple(g["loss_mask"])) for g in got]
    if trainer == "specforge":  # its online loader keeps the file's order
        same = sum(h == w for h, w in zip(have, want))
    else:  # prepare-data shuffles the rows (its seed): the same rows, each once
        same = sum((Counter(have) & Counter(want)).values())
    tool_rows = sum(run.tool_start in r["input_ids"][len(run.stored[r["id"]][0]):] for r in rows)
    return same, len(want), tool_rows


def through_conversations(run: Run, tmp: Path, capsys) -> dict:
    """The conversations export through SpecForge's build_eagle3_dataset with the registration the export wrote."""
    out = tmp / "conversations.jsonl"
    capsys.readouterr()
    assert cli_main(["export", str(run.root), "--format", "conversations", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    s = json.loads((tmp / "conversations_summary.json").read_text())
    rows, trip = lines(out), lines(tmp / "conversations_roundtrip.jsonl")
    assert all(isinstance(r["tools"], list) for r in rows)  # on every row
    name = load_spec(run.job).name
    got = trainertier.load("specforge-conversations", run.tokenizer, out, tmp / "sfc.json", name,
                           str(tmp / "conversations_specforge_template.py"))
    identical = masks = 0
    for row, flag, g in zip(rows, trip, got, strict=True):
        assert flag["id"] == row["id"]
        last = f"{row['id']}/t{row['turns'] - 1}" if "turns" in row else row["id"]
        prompt, output = run.stored[last]
        stored = prompt + output
        same = g["input_ids"][: len(stored)] == stored
        assert flag["identical"] == same, row["id"]  # the export's own round trip says what the trainer does
        identical += same
        if same:  # the mask on the stored ids is SpecForge's documented one; what the template adds after is not
            masks += (g["loss_mask"][: len(stored)] == documented_mask(run, prompt, len(output), "specforge")
                      and not any(g["loss_mask"][len(stored):]))
    assert s["roundtrip_rows"] == len(rows) and s["roundtrip_identical"] == identical
    assert f"{identical} of {len(rows)} rows give the model's exact ids" in printed.out
    return {"rows": len(rows), "identical": identical, "masks": masks, "printed": printed, "summary": s}


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory, real_tokenizer):
    run = make_run(tmp_path_factory.mktemp("kimi-run"), real_tokenizer("kimi-k2-thinking"))
    tok = chat.load_tokenizer(load_spec(run.job).model)
    run.tool_start = tok.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    return run


def test_kimi_tokens_export_is_identical_through_both_trainers_loaders_tool_calls_and_turns_included(kimi_run,
                                                                                                      tmp_path):
    for trainer in ("specforge", "speculators"):
        same, total, tool_rows = through_tokens(kimi_run, tmp_path, trainer)
        print(f"kimi-k2-thinking, tokens -> {trainer}: {same}/{total} rows identical (ids and mask), "
              f"{tool_rows} with tool calls")
        assert same == total and tool_rows >= 1
    regenerated = [i for i in kimi_run.stored if "/t1" in i]
    assert regenerated  # multi-turn conversations were regenerated and exported turn by turn


def test_specforge_trains_a_draft_on_the_tokens_export_for_a_few_cpu_steps(kimi_run, tmp_path):
    """SpecForge's own training loop (offline features, one CPU rank) over the exact rows; the hidden states are the
    tiny target's, captured by the test (train_steps.py says what stands in for what)."""
    out = tmp_path / "tokens.jsonl"
    export_run(kimi_run.root, output=out)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    steps = trainertier.train(out, kimi_run.tokenizer, tmp_path / "train", 4, port)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 and math.isfinite(m["grad_norm"]) for m in steps)
    assert json.loads((tmp_path / "train" / "out.json").read_text())["features"] == len(lines(out))


def test_the_specforge_config_of_the_docs_loads_with_its_schema_and_reads_the_tokens_export(kimi_run, tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "dataset.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    tokens = tmp_path / "tokens.jsonl"
    export_run(kimi_run.root, output=tokens)
    config = tmp_path / "run.yaml"
    config.write_text(block.replace("MODEL", str(kimi_run.tokenizer)).replace("RUN/export/tokens.jsonl", str(tokens))
                      .replace("CONTROL_DIR", str(tmp_path / "control")))
    r = subprocess.run([str(trainertier.python()), "-c", "import sys; from specforge.config import load_config; "
                        "c = load_config(sys.argv[1], []); print(c.mode, c.data.prompts_path)", str(config)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["online", str(tokens)]


def test_kimi_conversations_report_their_round_trip_as_specforge_loads_them(kimi_run, tmp_path, capsys):
    r = through_conversations(kimi_run, tmp_path, capsys)
    print(f"kimi-k2-thinking, conversations -> specforge: {r['identical']}/{r['rows']} rows identical, "
          f"{r['masks']} with the documented mask")
    assert r["masks"] == r["identical"] and r["rows"] > 0
    # a tool call alone is an answer (kept), and the built-in registration's system prompt is warned about
    rows = lines(tmp_path / "conversations.jsonl")
    assert any(m.get("tool_calls") for row in rows for m in row["conversations"])
    assert "SpecForge's built-in 'kimi-k2-thinking' inserts the system prompt" in r["printed"].err
    if r["identical"] < r["rows"]:
        assert "train on the tokens export instead" in r["printed"].err
    # ... and it is true: through the built-in registration fewer rows keep the model's ids than through the written one
    builtin = trainertier.load("specforge-conversations", kimi_run.tokenizer, tmp_path / "conversations.jsonl",
                               tmp_path / "builtin.json", "kimi-k2-thinking")
    same = 0
    for row, g in zip(rows, builtin):
        last = f"{row['id']}/t{row['turns'] - 1}" if "turns" in row else row["id"]
        stored = sum(kimi_run.stored[last], [])
        same += g["input_ids"][: len(stored)] == stored
    print(f"kimi-k2-thinking, conversations -> specforge built-in registration: {same}/{r['rows']} rows identical")
    assert same < r["identical"]


def test_deepseek_r1_tokens_are_exact_where_its_template_drops_the_reasoning_from_conversations(tmp_path,
                                                                                                real_tokenizer, capsys):
    run = make_run(tmp_path / "run", real_tokenizer("deepseek-r1-distill"), regenerate=False, tools=False)
    run.tool_start = -1
    figures = []
    for trainer in ("specforge", "speculators"):
        same, total, _ = through_tokens(run, tmp_path, trainer)
        figures.append(f"deepseek-r1-distill, tokens -> {trainer}: {same}/{total} rows identical (ids and mask)")
        assert same == total
    r = through_conversations(run, tmp_path, capsys)
    print("\n".join(figures))
    print(f"deepseek-r1-distill, conversations -> specforge: {r['identical']}/{r['rows']} rows identical")
    assert r["identical"] == 0  # the template writes no reasoning for an assistant turn: no row keeps the model's ids
    assert "train on the tokens export instead" in r["printed"].err


def test_a_non_reasoning_run_is_exact_through_both_loaders(tmp_path, real_tokenizer, capsys):
    run = make_run(tmp_path / "run", real_tokenizer("qwen3"), model={"chat_template_kwargs": {"enable_thinking": False},
                                                                     "expect_reasoning": False})
    tok = chat.load_tokenizer(load_spec(run.job).model)
    run.tool_start = tok.convert_tokens_to_ids("<tool_call>")
    figures = []
    for trainer in ("specforge", "speculators"):
        same, total, _ = through_tokens(run, tmp_path, trainer)
        figures.append(f"qwen3 (thinking off), tokens -> {trainer}: {same}/{total} rows identical (ids and mask)")
        assert same == total
    r = through_conversations(run, tmp_path, capsys)
    print("\n".join(figures))
    print(f"qwen3 (thinking off), conversations -> specforge: {r['identical']}/{r['rows']} rows identical")
    assert r["masks"] == r["identical"]
