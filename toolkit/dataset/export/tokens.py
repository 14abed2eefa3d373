"""The `tokens` export, the drafters' format: prompt + output ids and the loss mask of the
assistant turn (`loss_mask`), as each trainer's loader takes them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from toolkit.dataset.export.jsonl import _write_lines
from toolkit.dataset.export.selection import _Account, _Defects, _kept
from toolkit.dataset.export.text import _ids, _Tokens
from toolkit.formats.records import id_at
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat


def loss_mask(
    prompt: bytes, n_output: int, info: chat.TokenInfo, supervise_think_start: bool = True
) -> list[int]:
    """The `tokens` export's loss mask of a prompt (packed ids) followed by `n_output` output ids: 1
    on everything the assistant turn holds after the template's assistant header — a think-start the
    template wrote at the end of the prompt (and the blanks after it), then every output id: the
    reasoning, the think-end, the content, a tool-call section, and the stop token (an output cut by
    max_new_tokens has none: nothing is added) — and 0 on the
    rest of the prompt (system, tools, user turns, earlier turns, the header). This is the span
    SpecForge's parsers supervise (from the end of the assistant header to its end-of-turn token,
    inclusive) with `train_only_last_turn`. `supervise_think_start=False` leaves the template's
    think-start and its blanks out (0): the whole prompt unsupervised, speculators' rule (it masks
    from the end of the rendered generation prompt)."""
    n = len(prompt) >> 2
    head = n
    if supervise_think_start and chat.opens_reasoning(prompt, info):
        head = n - 1
        while id_at(prompt, head) != info.think_start_id:
            head -= 1
    return [0] * head + [1] * (n - head + n_output)


def _export_tokens(
    path: Path, plan: RunPlan, out, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    enc, n = msgspec.json.Encoder(), 0
    think = acc.summary.supervise_think_start is not False
    for recs, refs in _kept(path, acc, defects):
        n += _write_lines(
            out,
            (
                {
                    "id": r.id,
                    "dataset": r.dataset,
                    "sample": ref.sample,
                    "turn": ref.turn,
                    "segments": r.segments,
                    "input_ids": _ids(r.prompt_ids + r.output_ids),
                    "loss_mask": acc.measured(
                        r, loss_mask(r.prompt_ids, r.n_output, tokens.info, think)
                    ),
                }
                for r, ref in zip(recs, refs)
            ),
            enc,
        )
    return n
