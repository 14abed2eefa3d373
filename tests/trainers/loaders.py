"""Runs in the trainer tier's virtualenv (tests/trainers/install.sh): the trainers' OWN data code on an export, and
what it produced, row by row, as JSON ({"rows": [{"input_ids", "loss_mask"}, ...]} in the file's order).

    python loaders.py specforge-tokens TOKENIZER FILE OUT
        SpecForge's online loader over pre-tokenized rows (`data.prompts_path`):
        specforge.data.prompt_builder.prepare_prompt_tasks
    python loaders.py specforge-conversations TOKENIZER FILE TEMPLATE OUT [REGISTRATION.py]
        SpecForge's online loader over chat rows: specforge.data.preprocessing.build_eagle3_dataset with the
        registered chat template TEMPLATE (the file REGISTRATION.py, executed first, may register it), the last
        assistant turn supervised (data.train_only_last_turn); rows back in the file's order (the loader shuffles
        them with its fixed seed: the permutation is recovered from the same shuffle of the row indexes)
    python loaders.py speculators TOKENIZER FILE OUT
        speculators' `prepare-data` command (pre-tokenized rows pass through), its saved dataset read back
    python loaders.py specforge-config TOKENIZER CONFIG.yaml config|default OUT
        SpecForge's online loader over the token rows a `specforge train` config names (`data.prompts_path`), the
        config read with SpecForge's own schema (specforge.config.load_config): at the config's `data.max_length`
        (`config`), or at the schema's default one (`default`)
    python loaders.py speculators-command TOKENIZER COMMAND.sh given|default OUT
        the `speculators prepare-data` command line of COMMAND.sh run as it is (`given`) or without its
        `--seq-length` (`default`: prepare-data's own), its output folder replaced by a temporary one

Only what the trainers need is imported here: this file never imports the toolkit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

BIG = 1 << 20  # no truncation: max_length / seq_length above any row


def _dump(out: str, rows: list[dict]) -> None:
    Path(out).write_text(json.dumps({"rows": rows}))


def _aslist(x) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    while len(x) == 1 and isinstance(x[0], list):
        x = x[0]
    return [int(v) for v in x]


def specforge_tokens(tokenizer: str, path: str, out: str) -> None:
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    tasks = prepare_prompt_tasks(
        path,
        tok,
        chat_template=None,
        max_length=BIG,
        is_preformatted=False,
        train_only_last_turn=True,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
    )
    _dump(
        out,
        [
            {
                "input_ids": _aslist(t["payload"]["input_ids"]),
                "loss_mask": _aslist(t["payload"]["loss_mask"]),
            }
            for t in tasks
        ],
    )


def specforge_conversations(
    tokenizer: str, path: str, template: str, out: str, registration: str | None
) -> None:
    import warnings

    from datasets import Dataset, load_dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from transformers import AutoTokenizer

    if registration:
        code = Path(registration).read_text()
        exec(compile(code, registration, "exec"), {"__name__": "registration"})
    tok = AutoTokenizer.from_pretrained(tokenizer)
    data = load_dataset("json", data_files=path, split="train")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = build_eagle3_dataset(
            data,
            tok,
            chat_template=template,
            max_length=BIG,
            num_proc=None,
            train_only_last_turn=True,
            shuffle_seed=42,
        )
    order = Dataset.from_dict({"i": list(range(len(data)))}).shuffle(seed=42)["i"]
    rows: list[dict | None] = [None] * len(data)
    for k, i in enumerate(order):
        row = built[k]
        rows[i] = {"input_ids": _aslist(row["input_ids"]), "loss_mask": _aslist(row["loss_mask"])}
    _dump(out, rows)


def specforge_config(tokenizer: str, config: str, which: str, out: str) -> None:
    from specforge.config import load_config
    from specforge.config.schema import DataConfig
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from transformers import AutoTokenizer

    cfg = load_config(config, [])
    length = (
        cfg.data.max_length if which == "config" else DataConfig.model_fields["max_length"].default
    )
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tasks = prepare_prompt_tasks(
        cfg.data.prompts_path,
        tok,
        chat_template=None,
        max_length=length,
        is_preformatted=cfg.data.is_preformatted,
        train_only_last_turn=True,
        cache_dir=None,
        cache_key=None,
        num_proc=1,
    )
    Path(out).write_text(
        json.dumps(
            {
                "max_length": length,
                "rows": [
                    {
                        "input_ids": _aslist(t["payload"]["input_ids"]),
                        "loss_mask": _aslist(t["payload"]["loss_mask"]),
                    }
                    for t in tasks
                ],
            }
        )
    )


def speculators_command(tokenizer: str, script: str, which: str, out: str) -> None:
    import shlex

    from datasets import load_from_disk

    cmd = shlex.split(Path(script).read_text().strip().splitlines()[-1])
    assert cmd[:2] == ["speculators", "prepare-data"], cmd
    flags = dict(zip(cmd[2::2], cmd[3::2]))
    if which == "default":
        flags.pop("--seq-length")
    with tempfile.TemporaryDirectory() as tmp:
        flags["--output"] = tmp + "/out"
        exe = Path(sys.executable).with_name("speculators")
        r = subprocess.run(
            [str(exe), "prepare-data", *sum(flags.items(), ()), "--num-preprocessing-workers", "1"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            sys.exit(
                f"speculators prepare-data exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )
        ds = load_from_disk(tmp + "/out")
        _dump(
            out,
            [
                {"input_ids": _aslist(row["input_ids"]), "loss_mask": _aslist(row["loss_mask"])}
                for row in ds
            ],
        )


def speculators(tokenizer: str, path: str, out: str) -> None:
    from datasets import load_from_disk

    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(sys.executable).with_name("speculators")
        r = subprocess.run(
            [
                str(exe),
                "prepare-data",
                "--model",
                tokenizer,
                "--data",
                path,
                "--output",
                tmp + "/out",
                "--seq-length",
                str(BIG),
                "--num-preprocessing-workers",
                "1",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            sys.exit(
                f"speculators prepare-data exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            )
        ds = load_from_disk(tmp + "/out")
        _dump(
            out,
            [
                {"input_ids": _aslist(row["input_ids"]), "loss_mask": _aslist(row["loss_mask"])}
                for row in ds
            ],
        )


def main(argv: list[str]) -> None:
    what, args = argv[0], argv[1:]
    if what == "specforge-tokens":
        specforge_tokens(*args)
    elif what == "specforge-conversations":
        specforge_conversations(
            args[0], args[1], args[2], args[3], args[4] if len(args) > 4 else None
        )
    elif what == "speculators":
        speculators(*args)
    elif what == "specforge-config":
        specforge_config(*args)
    elif what == "speculators-command":
        speculators_command(*args)
    else:
        sys.exit(f"unknown loader {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
