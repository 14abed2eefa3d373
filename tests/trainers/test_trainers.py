"""Token for token into the trainer: the drafter trainers' OWN data code (SpecForge 0.2.0 and speculators 0.9.0, in
the venv of tests/trainers/install.sh) on the exports of stub runs with real chat templates — a reasoning run with
tool calls and regenerated multi-turn conversations (Kimi-K2-Thinking's template), DeepSeek-R1's template (which
drops reasoning from assistant turns), and a non-reasoning run (Qwen3 with thinking off).

Row by row: the ids each trainer's loader produces equal the ids the run stored, and its loss mask is the one the
toolkit documents for that trainer (docs/dataset.md): SpecForge supervises from the end of the template's assistant
header (a think-start the template wrote included), speculators from the end of the generation prompt. The
conversations export's own round trip (which rows keep the exact ids) agrees with what SpecForge's loader does.
And SpecForge's own training loop runs a few CPU steps from the tokens export (train_steps.py).

The trainer's length: on rows longer than SpecForge's default data.max_length (2048) and speculators' default
--seq-length (8192), every supervised token of every row survives each trainer's loader run with the config the
export wrote beside it, and the share of supervised tokens each default would have cut is printed. SpecForge's
validator of chat rows (`scripts/validate_regenerated_data.py`, not shipped in its wheel or sdist) is applied as its
source states it (tests/specforge_rules.py) to the conversations export of a run with tool calls.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import specforge_rules as sf
import trainertier

import runs
from jobfiles import make_job, write_prompts
from toolkit import read_run, unpack_ids
from toolkit.cli import main as cli_main
from toolkit.dataset.export import Selection, export_run
from toolkit.dataset.finish import merge_and_audit
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
            msgs += [
                {
                    "role": "user",
                    "content": f"question {t} of chat {i}: what is {i} times {t + 3}?",
                },
                {"role": "assistant", "content": f"source answer {i}.{t}"},
            ]
        out.append({"id": f"c{i}", "messages": msgs})
    return out


class Run:
    """A finished stub run: its job, run directory, tokenizer folder, stored ids per record id, the ids of the outputs
    cut by max_new_tokens, think-start id."""

    def __init__(self, job: Path, tokenizer: Path):
        self.job, self.tokenizer = job, tokenizer
        self.root = job.parent / "run"
        records = list(read_run(self.root))
        self.stored = {r.id: (unpack_ids(r.prompt_ids), unpack_ids(r.output_ids)) for r in records}
        self.cut = {r.id for r in records if r.status == "ok" and r.finish == "length"}
        spec = load_spec(job)
        tok = chat.load_tokenizer(spec.model)
        info = chat.token_info(tok, spec.model)
        self.think_start, self.blank = info.think_start_id, set(info.blank_ids)


def make_run(
    tmp: Path,
    tokenizer: Path,
    *,
    regenerate: bool = True,
    tools: bool = True,
    max_new_tokens: int = 160,
    prompts: int = 16,
    **tables,
) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    single = write_prompts(tmp / "single.jsonl", prompts, tools_every=3 if tools else 0)
    job = make_job(
        tmp,
        tokenizer,
        prompts=single,
        sampling={"max_new_tokens": max_new_tokens},
        audit={"max_length_share": 1.0, "max_failed_share": 1.0},
        **tables,
    )
    if regenerate:
        regen = tmp / "chats.jsonl"
        regen.write_text("".join(json.dumps(c) + "\n" for c in chats(6)))
        job.write_text(
            job.read_text() + f'[[datasets]]\nname = "chats"\npath = "{regen}"\nregenerate = true\n'
        )
    assert cli_main(["run", str(job)]) in (
        0,
        1,
    )  # the audit may fail: the stub truncates some outputs
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


def through_tokens(run: Run, tmp: Path, trainer: str) -> tuple[int, int, int, int]:
    """The tokens export for `trainer` through its own loader: (rows identical in ids and mask, rows, tool rows, rows
    of outputs cut by max_new_tokens identical in ids and mask: the model's ids, nothing appended, every output id
    supervised)."""
    out = tmp / f"tokens-{trainer}.jsonl"
    s = export_run(run.root, output=out, trainer=trainer)  # the default format
    assert s.format == "tokens" and s.rows > 0
    rows = lines(out)
    kind = "specforge-tokens" if trainer == "specforge" else "speculators"
    got = trainertier.load(kind, run.tokenizer, out, tmp / f"{kind}.json")
    want = []
    for row in rows:
        prompt, output = run.stored[row["id"]]
        want.append(
            (tuple(prompt + output), tuple(documented_mask(run, prompt, len(output), trainer)))
        )
    have = [(tuple(g["input_ids"]), tuple(g["loss_mask"])) for g in got]
    if trainer == "specforge":  # its online loader keeps the file's order
        same = sum(h == w for h, w in zip(have, want))
    else:  # prepare-data shuffles the rows (its seed): the same rows, each once
        same = sum((Counter(have) & Counter(want)).values())
    tool_rows = sum(run.tool_start in r["input_ids"][len(run.stored[r["id"]][0]) :] for r in rows)
    cut = Counter(w for row, w in zip(rows, want) if row["id"] in run.cut)
    assert all(
        w[1][-1] == 1 for w in cut
    )  # the last id the model wrote is supervised, and nothing follows it
    return same, len(want), tool_rows, sum((Counter(have) & cut).values())


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
    got = trainertier.load(
        "specforge-conversations",
        run.tokenizer,
        out,
        tmp / "sfc.json",
        name,
        str(tmp / "conversations_specforge_template.py"),
    )
    identical = masks = 0
    for row, flag, g in zip(rows, trip, got, strict=True):
        assert flag["id"] == row["id"]
        last = f"{row['id']}/t{row['turns'] - 1}" if "turns" in row else row["id"]
        prompt, output = run.stored[last]
        stored = prompt + output
        same = g["input_ids"][: len(stored)] == stored
        assert flag["identical"] == same, row[
            "id"
        ]  # the export's own round trip says what the trainer does
        identical += same
        if same:  # the mask on the stored ids is SpecForge's documented one; what the template adds after is not
            masks += g["loss_mask"][: len(stored)] == documented_mask(
                run, prompt, len(output), "specforge"
            ) and not any(g["loss_mask"][len(stored) :])
    assert s["roundtrip_rows"] == len(rows) and s["roundtrip_identical"] == identical
    assert f"{identical} of {len(rows)} rows give the model's exact ids" in printed.out
    return {
        "rows": len(rows),
        "identical": identical,
        "masks": masks,
        "printed": printed,
        "summary": s,
    }


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory, real_tokenizer):
    run = make_run(tmp_path_factory.mktemp("kimi-run"), real_tokenizer("kimi-k2-thinking"))
    tok = chat.load_tokenizer(load_spec(run.job).model)
    run.tool_start = tok.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    return run


def test_kimi_tokens_export_is_identical_through_both_trainers_loaders_tool_calls_and_turns_included(
    kimi_run, tmp_path
):
    for trainer in ("specforge", "speculators"):
        same, total, tool_rows, cut = through_tokens(kimi_run, tmp_path, trainer)
        print(
            f"kimi-k2-thinking, tokens -> {trainer}: {same}/{total} rows identical (ids and mask), "
            f"{tool_rows} with tool calls, {cut} of {len(kimi_run.cut)} outputs cut by max_new_tokens"
        )
        assert same == total and tool_rows >= 1
        # outputs cut by max_new_tokens reach the trainer's loader as the model wrote them, masked whole
        assert cut == len(kimi_run.cut) >= 1
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
    assert all(
        math.isfinite(m["loss"]) and m["loss"] > 0 and math.isfinite(m["grad_norm"]) for m in steps
    )
    assert json.loads((tmp_path / "train" / "out.json").read_text())["features"] == len(lines(out))


def test_the_specforge_config_of_the_docs_loads_with_its_schema_and_reads_the_tokens_export(
    kimi_run, tmp_path
):
    text = (Path(__file__).resolve().parents[2] / "docs" / "dataset.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    tokens = tmp_path / "tokens.jsonl"
    export_run(kimi_run.root, output=tokens)
    config = tmp_path / "run.yaml"
    config.write_text(
        block.replace("MODEL", str(kimi_run.tokenizer))
        .replace("RUN/export/tokens.jsonl", str(tokens))
        .replace("CONTROL_DIR", str(tmp_path / "control"))
    )
    r = subprocess.run(
        [
            str(trainertier.python()),
            "-c",
            "import sys; from specforge.config import load_config; "
            "c = load_config(sys.argv[1], []); print(c.mode, c.data.prompts_path, c.data.max_length)",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    mode, path, length = r.stdout.split()
    assert (mode, path) == ("online", str(tokens)) and int(length) > 2048  # the docs set the length
    # the config the export wrote beside the tokens is the docs' one, with its own values
    import yaml

    def keys(d, at=""):
        return {
            k
            for key, v in d.items()
            for k in (
                [f"{at}{key}"] + (sorted(keys(v, f"{at}{key}.")) if isinstance(v, dict) else [])
            )
        }

    written = yaml.safe_load((tmp_path / "tokens_specforge.yaml").read_text())
    assert keys(written) == keys(yaml.safe_load(block))


def test_kimi_conversations_report_their_round_trip_as_specforge_loads_them(
    kimi_run, tmp_path, capsys
):
    r = through_conversations(kimi_run, tmp_path, capsys)
    print(
        f"kimi-k2-thinking, conversations -> specforge: {r['identical']}/{r['rows']} rows identical, "
        f"{r['masks']} with the documented mask"
    )
    assert r["masks"] == r["identical"] and r["rows"] > 0
    # a tool call alone is an answer (kept), and the built-in registration's system prompt is warned about
    rows = lines(tmp_path / "conversations.jsonl")
    assert any(m.get("tool_calls") for row in rows for m in row["conversations"])
    assert "SpecForge's built-in 'kimi-k2-thinking' inserts the system prompt" in r["printed"].err
    if r["identical"] < r["rows"]:
        assert "train on the tokens export instead" in r["printed"].err
    # ... and it is true: through the built-in registration fewer rows keep the model's ids than through the written one
    builtin = trainertier.load(
        "specforge-conversations",
        kimi_run.tokenizer,
        tmp_path / "conversations.jsonl",
        tmp_path / "builtin.json",
        "kimi-k2-thinking",
    )
    same = 0
    for row, g in zip(rows, builtin):
        last = f"{row['id']}/t{row['turns'] - 1}" if "turns" in row else row["id"]
        stored = sum(kimi_run.stored[last], [])
        same += g["input_ids"][: len(stored)] == stored
    print(
        f"kimi-k2-thinking, conversations -> specforge built-in registration: {same}/{r['rows']} rows identical"
    )
    assert same < r["identical"]


def test_deepseek_r1_tokens_are_exact_where_its_template_drops_the_reasoning_from_conversations(
    tmp_path, real_tokenizer, capsys
):
    run = make_run(
        tmp_path / "run", real_tokenizer("deepseek-r1-distill"), regenerate=False, tools=False
    )
    run.tool_start = -1
    figures = []
    for trainer in ("specforge", "speculators"):
        same, total, _, _ = through_tokens(run, tmp_path, trainer)
        figures.append(
            f"deepseek-r1-distill, tokens -> {trainer}: {same}/{total} rows identical (ids and mask)"
        )
        assert same == total
    r = through_conversations(run, tmp_path, capsys)
    print("\n".join(figures))
    print(
        f"deepseek-r1-distill, conversations -> specforge: {r['identical']}/{r['rows']} rows identical"
    )
    assert (
        r["identical"] == 0
    )  # the template writes no reasoning for an assistant turn: no row keeps the model's ids
    assert "train on the tokens export instead" in r["printed"].err


def test_a_non_reasoning_run_is_exact_through_both_loaders(tmp_path, real_tokenizer, capsys):
    run = make_run(
        tmp_path / "run",
        real_tokenizer("qwen3"),
        model={"chat_template_kwargs": {"enable_thinking": False}, "expect_reasoning": False},
    )
    tok = chat.load_tokenizer(load_spec(run.job).model)
    run.tool_start = tok.convert_tokens_to_ids("<tool_call>")
    figures = []
    for trainer in ("specforge", "speculators"):
        same, total, _, _ = through_tokens(run, tmp_path, trainer)
        figures.append(
            f"qwen3 (thinking off), tokens -> {trainer}: {same}/{total} rows identical (ids and mask)"
        )
        assert same == total
    r = through_conversations(run, tmp_path, capsys)
    print("\n".join(figures))
    print(
        f"qwen3 (thinking off), conversations -> specforge: {r['identical']}/{r['rows']} rows identical"
    )
    assert r["masks"] == r["identical"]


def supervised_kept(rows: list[dict], loaded: list[dict]) -> tuple[int, int, int]:
    """(supervised tokens of the export's rows, of them what the loader kept at the same place, rows kept whole)."""
    total = kept = whole = 0
    for row, got in zip(rows, loaded, strict=True):
        n = len(got["input_ids"])
        assert got["input_ids"] == row["input_ids"][:n] and got["loss_mask"] == row["loss_mask"][:n]
        total += sum(row["loss_mask"])
        kept += sum(got["loss_mask"])
        whole += n == len(row["input_ids"])
    return total, kept, whole


def test_every_supervised_token_survives_each_trainers_loader_with_the_config_the_export_wrote(
    tmp_path, real_tokenizer, capsys
):
    """Outputs of up to 12,000 tokens (the stub, through Kimi-K2-Thinking's template): SpecForge's loader with the
    YAML the export wrote (read with SpecForge's schema) and speculators' prepare-data with the command line it wrote
    keep every row whole; at their own defaults (2048, 8192) they cut most of the supervised tokens."""
    run = make_run(
        tmp_path / "run",
        real_tokenizer("kimi-k2-thinking"),
        regenerate=False,
        tools=False,
        max_new_tokens=12000,
        prompts=10,
    )
    figures = []
    for trainer, kind, default in (
        ("specforge", "specforge-config", 2048),
        ("speculators", "speculators-command", 8192),
    ):
        out = tmp_path / f"{trainer}.jsonl"
        capsys.readouterr()
        assert cli_main(["export", str(run.root), "-o", str(out), "--trainer", trainer]) == 0
        printed = capsys.readouterr().out
        rows = lines(out)
        summary = json.loads((tmp_path / f"{trainer}_summary.json").read_text())
        config = Path(summary["trainer_config"])
        longest = max(len(r["input_ids"]) for r in rows)
        assert longest > 8192 and summary["lengths"]["needed"] == longest
        with_config = trainertier.load(
            kind,
            run.tokenizer,
            config,
            tmp_path / f"{kind}-config.json",
            "config" if trainer == "specforge" else "given",
        )
        at_default = trainertier.load(
            kind, run.tokenizer, config, tmp_path / f"{kind}-default.json", "default"
        )
        if trainer == "speculators":  # prepare-data shuffles the rows: back in the export's order
            order = {tuple(r["input_ids"][:64]): i for i, r in enumerate(rows)}
            with_config.sort(key=lambda g: order[tuple(g["input_ids"][:64])])
            at_default.sort(key=lambda g: order[tuple(g["input_ids"][:64])])
        total, kept, whole = supervised_kept(rows, with_config)
        assert (kept, whole) == (total, len(rows))  # every supervised token of every row survives
        total, kept_default, whole_default = supervised_kept(rows, at_default)
        cut = 1 - kept_default / total
        figures.append(
            f"{trainer}: {len(rows)} rows, tokens per row p50 {summary['lengths']['p50']:,} / max "
            f"{longest:,}; supervised tokens kept with the export's config {kept / total:.1%} "
            f"({kept:,} of {total:,}), at the default {default} {kept_default / total:.1%} "
            f"({whole_default} rows whole): {cut:.1%} cut"
        )
        assert (
            summary["lengths"]["supervised_cut_by_default"] == total - kept_default
        )  # the export's own figure
        assert f"({cut:.1%} of the supervised tokens)" in printed
        # 2048 cuts most of what a reasoning model writes; 8192 the rest of the longest rows
        assert cut > (0.5 if trainer == "specforge" else 0) and whole_default < len(rows)
    print("\n".join(figures))


KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.calc:0<|tool_call_argument_begin|>"
    '{"x": "1+1"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_the_conversations_export_passes_specforges_validator_tool_calls_alone_left_out_and_counted(
    tmp_path, real_tokenizer
):
    """`scripts/validate_regenerated_data.py` is in SpecForge's repository only (neither its wheel nor its sdist ships
    it); its rule, as `scripts/conversation_validation.py` states it, refuses an answer that is a tool call alone:

        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {index} content must be a non-empty string"

    A Kimi-K2-Thinking run whose answers are a tool call alone, one with text before its call, the rest text: the
    export leaves the calls alone out (`tool_call_only`, counted) and the rest passes the rule; `--include
    tool_call_only` brings them back, the rule then refuses exactly those rows, and SpecForge's loader trains them."""
    r = subprocess.run(
        [
            str(trainertier.python()),
            "-c",
            "import importlib.metadata as m; "
            "print(sum('validate_regenerated_data' in str(f) for f in m.files('specforge')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip() == "0"  # not shipped: the rule is applied as its source states it
    s = runs.plan_run(
        tmp_path / "synth",
        real_tokenizer("kimi-k2-thinking"),
        "kimi",
        datasets={"tools": 8},
        shards=1,
    )
    call = s.tok(KIMI_CALL, add_special_tokens=False)["input_ids"]

    def tool(content: bool):
        def make(s, pos, rng):
            ids = s.text(rng, 40) + [s.info.think_end_id] + (s.text(rng, 10) if content else [])
            return runs.Out(ids + call + [s.eos], "stop", s.eos)

        return make

    runs.write_run(s, runs.mix(runs.healthy(), p0=tool(False), p3=tool(False), p1=tool(True)))
    merge_and_audit(s.root)
    ids = [ref.id for ref in s.refs]
    out = tmp_path / "conversations.jsonl"
    summary = export_run(s.root, "conversations", out)
    rows = lines(out)
    assert sf.file_problems(rows, expect_reasoning=True, strict_think_markers=True) == []
    assert summary.skipped_by_reason == {"tool_call_only": 2} and summary.exported == 6
    assert {x["id"]: x["reason"] for x in lines(tmp_path / "conversations_skipped.jsonl")} == {
        ids[0]: "tool_call_only",
        ids[3]: "tool_call_only",
    }
    assert any(
        m.get("tool_calls") for r in rows for m in r["conversations"]
    )  # a call after text is kept
    # kept as they are, the rule refuses exactly those rows; SpecForge's own loader trains them
    every = tmp_path / "all.jsonl"
    export_run(
        s.root, "conversations", every, select=Selection(include=frozenset({"tool_call_only"}))
    )
    problems = sf.file_problems(lines(every), expect_reasoning=True, strict_think_markers=True)
    assert len(problems) == 2 and all(
        p.endswith("content must be a non-empty string") for p in problems
    )
    got = trainertier.load(
        "specforge-conversations",
        real_tokenizer("kimi-k2-thinking"),
        every,
        tmp_path / "sfc.json",
        s.plan.spec.name,
        str(tmp_path / "all_specforge_template.py"),
    )
    alone = [g for row, g in zip(lines(every), got) if row["id"] in (ids[0], ids[3])]
    assert len(alone) == 2 and all(sum(g["loss_mask"]) > len(call) for g in alone)
    print(
        f"conversations -> SpecForge's validator rule: {len(rows)} of 8 rows pass, {len(problems)} answers that are "
        "a tool call alone left out (tool_call_only) and counted; kept with --include tool_call_only, the rule "
        f"refuses {len(problems)} rows, SpecForge's loader trains them"
    )
