"""What the pre-flight found (`Preflight`: the plan, the tokenizer's ids, the prompts' reasoning
modes and lengths, warnings and notes) and the error that stops a job (`PreflightError`, every
problem at once). job/check runs the stages that fill it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from toolkit.errors import BadInputError
from toolkit.formats.prompts import PromptRef
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat, check_cache
from toolkit.job.schema import JobSpec

MODE_WORDS = {
    chat.OPENED: "opened by the template",
    chat.CLOSED: "closed by the template",
    chat.MODEL_OPENS: "left for the model to open",
    chat.UNKNOWN: "unknown (the template never mentions the think tokens)",
}


class PreflightError(BadInputError):
    """A job that must not start: one or more problems, each naming what to change."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems:\n" + "\n".join(f"- {p}" for p in problems)
        )


@dataclass
class Preflight:
    spec: JobSpec
    plan: RunPlan
    refs: list[PromptRef]
    info: chat.TokenInfo | None = None
    modes: dict[str, int] = field(default_factory=dict)  # reasoning mode -> prompts
    context: int | None = None
    context_source: str = ""
    # (prompt + max_new_tokens, dataset) of the tightest prompt
    longest: tuple[int, str] | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what the render stage learned (prepare_run keeps it)
    learned: check_cache.CheckCache | None = None
    # on_too_long = "skip": (dataset, line) -> why
    too_long: dict[tuple[str, int], str] = field(default_factory=dict)

    def summary(self) -> list[str]:
        """What `check` prints after its ok line."""
        lines = []
        if self.modes:
            lines.append(
                "reasoning: "
                + ", ".join(f"{n:,} {MODE_WORDS[m]}" for m, n in self.modes.items() if n)
                + f" (expect_reasoning = {str(self.spec.model.expect_reasoning).lower()})"
            )
        if self.context is not None and self.longest is not None:
            total, ds = self.longest
            lines.append(
                f"lengths: every prompt + max_new_tokens fits the context length {self.context:,} "
                f"({self.context_source}); the longest prompt + its max_new_tokens at most "
                f"{total:,} tokens (dataset {ds!r}; prompts far from the limit are bounded by "
                "their UTF-8 length)"
            )
        return lines + self.notes

    def print_warnings(self, file=None) -> None:
        for w in self.warnings:
            print(f"toolkit: warning: {w}", file=file or sys.stderr)


def plural(n: int) -> str:
    """The `s` of a count's noun: none for one."""
    return "" if n == 1 else "s"
