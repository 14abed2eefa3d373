"""Re-rendering prompts: do the stored prompt ids still come from the run's sources, tokenizer and
template?

The auditor keeps the stored prompt ids of a few positions spread over the plan
(`sample_positions`); `rerender` reads their source lines again, renders them with the chat template
and compares the ids. A mismatch means the tokenizer, the template or the prompt files changed since
generation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolkit.dataset.audit_report import Reprompt
from toolkit.formats.prompts import PromptIndex
from toolkit.formats.records import pack_ids
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat
from toolkit.job.inputs import PromptReader, check_plan_inputs
from toolkit.job.promptline import InputError
from toolkit.job.turns import turn_prompt

__all__ = ["EXAMPLES", "rerender", "sample_positions"]

EXAMPLES = 5  # mismatches described in the report


def sample_positions(total: int, k: int) -> set[int]:
    """`k` planned positions spread evenly over 0 .. total-1 (first and last included), or none."""
    k = min(k, total)
    return set(np.linspace(0, total - 1, k).round().astype(int).tolist()) if k > 0 else set()


def rerender(
    tok: Any, plan: RunPlan, refs: PromptIndex, sampled: dict[int, bytes]
) -> tuple[Reprompt, str | None]:
    """Render the prompts of `sampled` ({planned position: stored packed prompt ids}) from their
    source lines again and compare: (the counts, a problem message when the source files are not
    those planned, else None).

    Later turns of regenerated conversations are left out: their history holds earlier answers, so
    the records themselves are their source.
    """
    rp = Reprompt(sampled=len(sampled))
    if not sampled:
        return rp, None
    try:
        check_plan_inputs(plan)
    except InputError as e:  # a changed file would pair other lines with the stored ids
        return rp, (
            f"{e}: the prompt files are not those the run was generated from, so prompts cannot be "
            "re-rendered or paired with their records"
        )
    prompts, stored = [], []
    with PromptReader() as reader:
        for pos, packed in sorted(sampled.items()):
            ref = refs.at(pos)
            ds = plan.datasets[ref.dataset]
            if ds.regenerate and ref.turn:
                rp.sampled -= 1
                continue
            try:
                prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
                prompts.append(turn_prompt(prompt, 0, []) if ds.regenerate else prompt)
                stored.append(packed)
            except (OSError, InputError) as e:
                rp.mismatched += 1
                if len(rp.examples) < EXAMPLES:
                    rp.examples.append(f"{ref.id}: source line unreadable ({e})")
    try:
        rendered = chat.render_many(tok, plan.spec.model, prompts)
    except chat.ChatError as e:
        rp.mismatched += len(prompts)
        rp.examples.append(f"rendering failed: {e}")
        return rp, None
    for p, ids, packed in zip(prompts, rendered, stored):
        if pack_ids(ids) != packed:
            rp.mismatched += 1
            if len(rp.examples) < EXAMPLES:
                rp.examples.append(
                    f"{p.id}: {len(ids)} ids rendered now, {len(packed) // 4} stored"
                )
    return rp, None
