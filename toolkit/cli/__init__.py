"""The `toolkit` command line: parses arguments and calls the modules that do the work.

Exit codes: toolkit.errors.EXIT_MEANINGS, printed by `toolkit --help`; an error exits with the code
of its kind (toolkit.errors.ERROR_CLASS_BY_CODE) after one line, `toolkit: error: ...`
(`toolkit -v`: its traceback first). `status` exits 0 only for a run that is complete and healthy
(cluster.verdicts.verdict).

One module per command group, each with its subcommands' flags beside the functions that run them:
`parser` (the parser and `main`: errors, did-you-mean, -v/--quiet), `local` (run, worker, check,
retry), `slurm` (submit, resubmit, cancel), `status` (status, logs), `dataset` (merge, audit,
export); `shared` holds what several of them use.
"""

from toolkit.cli.parser import (
    EPILOG,
    QUIET_TOKENIZER,
    TAKES_A_JOB_FOR_ITS_RUN,
    build_parser,
    main,
    package_version,
    quiet_terminal,
)
from toolkit.cli.shared import RUN_HELP_ARG
from toolkit.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_IN_PROGRESS,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_UNKNOWN,
)

__all__ = [
    "main",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_BAD_INPUT",
    "EXIT_STOPPED",
    "EXIT_UNKNOWN",
    "EXIT_IN_PROGRESS",
    # as importable as when the command line was one module
    "build_parser",
    "EPILOG",
    "QUIET_TOKENIZER",
    "TAKES_A_JOB_FOR_ITS_RUN",
    "RUN_HELP_ARG",
    "package_version",
    "quiet_terminal",
]
