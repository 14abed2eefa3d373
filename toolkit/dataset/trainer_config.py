"""How long the rows of a training export are, and the trainer config that keeps every row whole.

Both drafter trainers cut a row to a length they are given, ids and loss mask alike, and train
what is left: SpecForge 0.2.0 to `data.max_length` (default 2048; `input_ids[:max_length]` in
`specforge/data/prompt_builder.py` for token rows, and in its chat-row preprocessing), without a
word; speculators 0.9.0 to `prepare-data --seq-length` (default 8192; `_append_row` in
`speculators/data_generation/preprocessing.py`), with a warning. Reasoning outputs run to tens of
thousands of tokens, so a default length drops most of the reasoning and every answer.

- `RowLengths` measures the rows an export writes (tokens per row, the model's ids: p50, p99,
  max) and what each trainer's default length would cut of their supervised tokens.
  The length that keeps every row whole is the longest row's.
- `write_config` writes it beside a `tokens` export as the trainer takes it: for SpecForge a YAML
  for `specforge train --config` (`model.target_model_path`, `data.prompts_path`,
  `data.max_length`, and the deployment block of docs/dataset.md to adapt to the machine), for
  speculators the `prepare-data` command line with `--seq-length`.
"""

from __future__ import annotations

import json
import shlex
from array import array
from pathlib import Path

import msgspec

__all__ = [
    "DEFAULT_LENGTH",
    "LENGTH_SETTING",
    "LengthFigures",
    "RowLengths",
    "config_name",
    "write_config",
]

# what each trainer cuts a row to when it is not told otherwise
DEFAULT_LENGTH = {"specforge": 2048, "speculators": 8192}
# the flag or key that sets it, as the export says it
LENGTH_SETTING = {"specforge": "data.max_length", "speculators": "--seq-length"}


class LengthFigures(msgspec.Struct):
    """The rows of an export measured: tokens per row (prompt + output, the model's ids) and the
    supervised tokens the trainer's default length would cut. In the export's summary."""

    rows: int = 0
    p50: int = 0
    p99: int = 0
    max: int = 0
    supervised: int = 0  # supervised tokens of every row written
    default_length: int = 0  # the trainer's own default length
    rows_cut_by_default: int = 0  # rows longer than it
    supervised_cut_by_default: int = 0  # supervised tokens past it
    setting: str = ""  # data.max_length (SpecForge) or --seq-length (speculators)
    needed: int = 0  # the length that keeps every row whole


class RowLengths:
    """The lengths of the rows an export writes, one at a time; the figures at the end."""

    def __init__(self, trainer: str):
        self.trainer = trainer
        self.default = DEFAULT_LENGTH[trainer]
        self.lengths = array("I")
        self.supervised = self.cut = self.rows_cut = 0

    def add(self, length: int, supervised_from: int) -> None:
        """A row of `length` ids whose loss mask is 1 from `supervised_from` to its end."""
        self.lengths.append(length)
        self.supervised += length - min(supervised_from, length)
        if length > self.default:
            self.rows_cut += 1
            self.cut += length - max(self.default, supervised_from)

    def figures(self) -> LengthFigures:
        ranked = sorted(self.lengths)
        n = len(ranked)

        def rank(q: float) -> int:  # nearest rank
            return ranked[max(0, -(-n * q // 100) - 1)] if n else 0

        return LengthFigures(
            rows=n,
            p50=int(rank(50)),
            p99=int(rank(99)),
            max=ranked[-1] if n else 0,
            supervised=self.supervised,
            default_length=self.default,
            rows_cut_by_default=self.rows_cut,
            supervised_cut_by_default=self.cut,
            setting=LENGTH_SETTING[self.trainer],
            needed=ranked[-1] if n else 0,
        )


def _specforge_yaml(model: str, tokens: Path, length: int) -> str:
    q = json.dumps  # a JSON string is a YAML scalar
    return (
        "# SpecForge 0.2.0: specforge train --config THIS_FILE\n"
        f"# No row of the export has more than {length} ids: data.max_length keeps each whole\n"
        "# (SpecForge's default 2048 cuts longer rows). The deployment block is the one of\n"
        "# docs/dataset.md: set the control folder and the GPUs of this machine.\n"
        "model:\n"
        f"  target_model_path: {q(model)}\n"
        "data:\n"
        f"  prompts_path: {q(str(tokens))}\n"
        f"  max_length: {length}\n"
        "deployment:\n"
        "  mode: disaggregated\n"
        "  disaggregated:\n"
        "    backend: mooncake\n"
        f"    control_dir: {q(str(tokens.parent / 'specforge-control'))}\n"
        "    managed_local:\n"
        '      trainer_cuda_visible_devices: ["0"]\n'
        '      capture_servers: [{port: 30000, cuda_visible_devices: ["1"]}]\n'
    )


def _speculators_sh(model: str, tokens: Path, length: int) -> str:
    cmd = [
        "speculators",
        "prepare-data",
        "--model",
        model,
        "--data",
        str(tokens),
        "--output",
        str(tokens.parent / "speculators-data"),
        "--seq-length",
        str(length),
    ]
    return (
        "#!/bin/sh\n"
        f"# speculators 0.9.0: no row of the export has more than {length} ids: --seq-length\n"
        "# keeps each whole (the default 8192 cuts longer rows).\n"
        + " ".join(shlex.quote(c) for c in cmd)
        + "\n"
    )


def config_name(trainer: str) -> tuple[str, str]:
    """(what, suffix) of the config written beside a tokens export (`export.side_file`):
    `tokens_specforge.yaml`, `tokens_speculators_prepare_data.sh`."""
    return {"specforge": ("specforge", ".yaml"), "speculators": ("prepare_data", ".sh")}[trainer]


def write_config(path: Path, trainer: str, model: str, tokens: Path, length: int) -> None:
    """Write the config of `trainer` that reads the tokens export `tokens` (made absolute) with
    every row whole: `length` is at least its longest row."""
    tokens = tokens.absolute()
    text = (_specforge_yaml if trainer == "specforge" else _speculators_sh)(model, tokens, length)
    path.write_text(text)
