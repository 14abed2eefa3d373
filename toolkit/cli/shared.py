"""What the command groups share: a subcommand's declaration, the help of a run argument, the
refusal of a number flag below its least value, and `--allow-changed` (run, submit)."""

from __future__ import annotations

import argparse

from toolkit.errors import BadInputError

RUN_HELP_ARG = "run directory, or the job file (its newest run in output_dir)"


def add_command(sub, name: str, func, *, help: str, description: str | None = None, wrap=False):
    """The subcommand `name`, run by `func`: `help` is its line in `toolkit --help`, `description`
    what its own --help says above the flags, as written (its line breaks kept) unless `wrap`."""
    as_written = {} if wrap else {"formatter_class": argparse.RawDescriptionHelpFormatter}
    s = sub.add_parser(name, help=help, description=description, **as_written)
    s.set_defaults(func=func)
    return s


def at_least(flag: str, values, least: int, what: str) -> None:
    """Refuse (bad input) a number flag below `least`, before anything is read or written."""
    for v in [values] if isinstance(values, int) else values or []:
        if v < least:
            raise BadInputError(f"{flag} {v}: give at least {least} ({what})")


def add_allow_changed(s) -> None:
    s.add_argument(
        "--allow-changed",
        action="store_true",
        help="prompts of the job's run whose messages or tools changed in their files (same id) "
        "are generated again, their new records replacing the old (without it they are named and "
        "refused)",
    )
