"""Exit codes of the `toolkit` command, and the error every toolkit failure raises with its code.

`cli.main` catches `ToolkitError` once: it prints `toolkit: error: <message>` and exits with the error's
`exit_code` (the class's, or the one an instance was given).
"""

from __future__ import annotations

__all__ = ["BadInputError", "EXIT_BAD_INPUT", "EXIT_MEANINGS", "EXIT_FAILED", "EXIT_IN_PROGRESS", "EXIT_INTERRUPTED", "EXIT_OK",
           "EXIT_STOPPED", "EXIT_STUCK", "EXIT_UNKNOWN", "ToolkitError", "stopped_code"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
EXIT_IN_PROGRESS = 5  # `status`: the run is still going (shards or the merge job pending or running), nothing failed
EXIT_STUCK = 6        # a worker did not end in time once its work was over: the exit guard ended it (exitguard)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells count it (128 + 2): what was done is kept, a run resumes

# What each exit code means, in the words `toolkit --help` prints: the one list (docs/commands.md says more of each)
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed (status: or stopped, with the command that resumes it)",
    EXIT_BAD_INPUT: "bad input or usage",
    EXIT_STOPPED: "stopped early by SIGTERM or SIGUSR2 (requeue)",
    EXIT_UNKNOWN: "state unknown (Slurm did not answer; status)",
    EXIT_IN_PROGRESS: "still going: something runs it (status)",
    EXIT_STUCK: "a worker did not end in time once its work was over (ended by its exit guard; the shard resumes)",
    EXIT_INTERRUPTED: "interrupted by Ctrl-C (what was done is kept; run it again to resume)",
}


def stopped_code(signal_name: str | None) -> int:
    """The exit code of work stopped early by `signal_name`: 130 for Ctrl-C (SIGINT), else 3 (SIGTERM, SIGUSR2:
    Slurm's time limit or a preemption; to be requeued)."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_STOPPED


class ToolkitError(Exception):
    """A failure the toolkit explains in one message; `exit_code` is what the command exits with."""

    exit_code: int = EXIT_FAILED

    def __init__(self, *args, exit_code: int | None = None):
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


class BadInputError(ToolkitError):
    """Input the toolkit refuses before doing any work: a spec, prompt file, tokenizer, option or run directory."""

    exit_code = EXIT_BAD_INPUT
