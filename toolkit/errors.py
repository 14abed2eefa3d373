"""Exit codes of the `toolkit` command, and the kinds of error that are those codes.

Every error the toolkit explains derives from exactly one kind, and the kind is the exit code:
`FailedError` (1: the work failed, or the file system, Slurm or the engine failed it) or
`BadInputError` (2: input the toolkit refuses). The context is in the message, never in another exit
code: a class has one code, and no instance changes it. `cli.main` catches `ToolkitError` once: it
prints `toolkit: error: <message>` and exits with the kind's code (`toolkit -v` prints the traceback
first).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BadInputError",
    "EXIT_BAD_INPUT",
    "EXIT_MEANINGS",
    "EXIT_FAILED",
    "EXIT_IN_PROGRESS",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STOPPED",
    "EXIT_STUCK",
    "EXIT_UNKNOWN",
    "FailedError",
    "ERROR_CLASS_BY_CODE",
    "ToolkitError",
    "stopped_code",
]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
# `status`: the run is still going (shards or the merge job pending or running), nothing failed
EXIT_IN_PROGRESS = 5
# a worker did not end in time once its work was over: the exit guard ended it (exitguard)
EXIT_STUCK = 6
# Ctrl-C (SIGINT), as shells count it (128 + 2): what was done is kept, a run resumes
EXIT_INTERRUPTED = 130

# What each exit code means, in the words `toolkit --help` prints: the one list (docs/commands.md
# says more of each)
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed (status: or stopped, with the command that resumes it)",
    EXIT_BAD_INPUT: "bad input or usage",
    EXIT_STOPPED: "stopped early by SIGTERM or SIGUSR2 (requeue)",
    EXIT_UNKNOWN: "state unknown (Slurm did not answer; status)",
    EXIT_IN_PROGRESS: "still going: something runs it (status)",
    EXIT_STUCK: "a worker did not end in time once its work was over (ended by its exit guard; "
    "the shard resumes)",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (what was done is kept; `toolkit retry RUN` resumes a "
    "run)",
}


def stopped_code(signal_name: str | None) -> int:
    """The exit code of work stopped early by `signal_name`: 130 for Ctrl-C (SIGINT), else 3
    (SIGTERM, SIGUSR2: Slurm's time limit or a preemption; to be requeued)."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_STOPPED


class ToolkitError(Exception):
    """A failure the toolkit explains in one message. Raise one of its kinds
    (`ERROR_CLASS_BY_CODE`), not this root: the kind says the exit code (`exit_code`, the same for
    every instance of a class)."""

    exit_code: ClassVar[int] = EXIT_FAILED


class FailedError(ToolkitError):
    """Exit 1: the work failed — a shard, the merge, the audit, the engine, Slurm, or the file
    system (a full disk) — through no fault of the input; the message says what to do next."""

    exit_code: ClassVar[int] = EXIT_FAILED


class BadInputError(ToolkitError):
    """Exit 2: input the toolkit refuses before doing any work: a spec, prompt file, tokenizer,
    option or run directory."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT


# The kinds of error, by the exit code each is (exit code -> its error class): every other error
# class derives from exactly one of them.
ERROR_CLASS_BY_CODE: dict[int, type[ToolkitError]] = {
    EXIT_FAILED: FailedError,
    EXIT_BAD_INPUT: BadInputError,
}
