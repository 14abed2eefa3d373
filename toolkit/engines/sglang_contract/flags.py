"""SGLang's server flags as data, and a check of a command line against them that behaves like
SGLang's parser.

The login node has no sglang, so `toolkit check/run/submit` cannot ask SGLang's own argparse parser
whether a job's `[engine] extra_args` will be accepted. `sglang_flags.json` holds every option of
each supported release, read from the release's wheel by `scripts/sglang_flags.py` (regenerate it
there; never edit it). `parse` walks an argv the way argparse does in SGLang's
`ArgumentParser(prog="sglang serve")` — exact option strings first, `--flag=value`, then unique
prefixes (`allow_abbrev`, argparse's default), values counted by `nargs`, int/float values and
choices checked (those SGLang computes at import too, such as the parser names of
`--reasoning-parser` and `--tool-call-parser`) — so a flag SGLang would refuse is refused here,
before a node is allocated, and an abbreviation such as `--tp-s` is known to mean `--tp-size`. The
stub server builds its SGLang part from the same data (`add_to_parser`).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DATA_FILE",
    "Flag",
    "FlagSet",
    "Parsed",
    "VERSION_ENV",
    "add_to_parser",
    "flag_set",
    "versions",
]


DATA_FILE = Path(__file__).with_name("sglang_flags.json")
# Which release's flags the login-side check uses for kind = "sglang" (default: the newest in the
# data).
VERSION_ENV = "TOOLKIT_SGLANG_VERSION"

# Flags renamed between releases that a near-miss search would not find (read from SGLang's
# server_args.py of each release).
RENAMED = {"--stream-output": "--incremental-streaming-output"}

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Flag:
    options: tuple[str, ...]
    dest: str
    nargs: int | str | None  # 0: a switch; None: exactly one value; '?', '*', '+', or a count
    type: str | None = None  # "int" or "float" when SGLang converts the value; else not checked
    # the choices SGLang's parser is given (literal or computed at import)
    choices: tuple | None = None
    action: str = "store"
    deprecated: str | None = None
    # why the data has no choices for a flag whose SGLang parser has some
    choices_unknown: str | None = None

    @property
    def name(self) -> str:
        return (
            self.options[0]
            if self.options[0].startswith("--") or len(self.options) == 1
            else self.options[1]
        )


@dataclass
class Item:
    """One flag as given on a command line: the token, the flag it resolved to and its values."""

    token: str
    flag: Flag
    option: str  # the option string it resolved to (the token itself unless abbreviated)
    values: list[str] = field(default_factory=list)

    @property
    def abbreviated(self) -> bool:
        return self.token.split("=", 1)[0] != self.option


@dataclass
class Parsed:
    items: list[Item]
    errors: list[str]


@functools.cache
def _data() -> dict:
    return json.loads(DATA_FILE.read_text())


def versions() -> list[str]:
    """The releases in the data, newest first."""
    return list(_data()["versions"])


@functools.cache
def flag_set(version: str | None = None) -> FlagSet:
    """The flags of `version` (default: $TOOLKIT_SGLANG_VERSION, else the newest release in the
    data)."""
    known = versions()
    version = version or os.environ.get(VERSION_ENV) or known[0]
    if version not in known:
        raise KeyError(
            f"SGLang {version} is not in {DATA_FILE.name} (it has {', '.join(known)}); "
            f"add it with scripts/sglang_flags.py {version}"
        )
    d = _data()["versions"][version]
    return FlagSet(
        version,
        d["source"],
        [
            Flag(
                tuple(f["options"]),
                f["dest"],
                f["nargs"],
                f.get("type"),
                tuple(f["choices"]) if f.get("choices") is not None else None,
                f.get("action", "store"),
                f.get("deprecated"),
                f.get("choices_unknown"),
            )
            for f in d["flags"]
        ],
    )


class FlagSet:
    def __init__(self, version: str, source: str, flags: list[Flag]):
        self.version, self.source, self.flags = version, source, flags
        self.by_option = {o: f for f in flags for o in f.options}

    def __contains__(self, option: str) -> bool:
        return option in self.by_option

    # -- argparse's option resolution (Lib/argparse.py: _parse_optional, _get_option_tuples)
    # -------------
    def _is_option_like(self, token: str) -> bool:
        """Whether argparse would take `token` for an option (else it is a value)."""
        if not token or token[0] != "-" or token == "-":
            return False
        if token in self.by_option:
            return True
        if len(token) == 1:
            return False
        if "=" in token and token.split("=", 1)[0] in self.by_option:
            return True
        if _NEGATIVE_NUMBER.match(token):  # SGLang has no option that looks like a negative number
            return False
        if " " in token:
            return False
        return True

    def candidates(self, token: str) -> list[str]:
        """The option strings `token` (before any `=`) abbreviates."""
        prefix = token.split("=", 1)[0]
        if prefix.startswith("--"):
            return [o for o in self.by_option if o.startswith(prefix)]
        # single dash: argparse matches the two-character short option, or long options by prefix
        return [
            o
            for o in self.by_option
            if o == prefix[:2] or (len(prefix) > 2 and o.startswith(prefix))
        ]

    def resolve(self, token: str) -> tuple[Flag | None, str, str | None, str | None]:
        """(flag, option string, explicit value after '=', error) for an option-like token."""
        if token in self.by_option:
            return self.by_option[token], token, None, None
        if "=" in token:
            opt, value = token.split("=", 1)
            if opt in self.by_option:
                return self.by_option[opt], opt, value, None
        matches = self.candidates(token)
        value = token.split("=", 1)[1] if "=" in token else None
        if len(matches) == 1:
            opt = matches[0]
            if not token.startswith("--") and value is None and len(token) > 2 and opt == token[:2]:
                value = token[2:]  # -hVALUE
            return self.by_option[opt], opt, value, None
        if len(matches) > 1:
            return None, token, value, "ambiguous"
        return None, token, value, "unknown"

    # -- the whole command line
    # ---------------------------------------------------------------------
    def parse(self, argv: list[str]) -> Parsed:
        items: list[Item] = []
        errors: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if token == "--":
                errors.append(
                    "`--` ends SGLang's options; everything after it would be refused as "
                    "unrecognized"
                )
                break
            if not self._is_option_like(token):
                errors.append(
                    f"`{token}` is not a flag (SGLang takes no positional arguments: a value "
                    "without its flag, or a flag that takes no value given one?)"
                )
                continue
            flag, opt, value, problem = self.resolve(token)
            if problem == "ambiguous":
                matches = self.candidates(token)
                errors.append(
                    f"`{token}` is ambiguous in SGLang {self.version}: it could be {_or(matches)}; "
                    f"use the full name, e.g. {_or(matches[:4])}"
                )
                i = self._skip_values(argv, i)
                continue
            if problem == "unknown":
                errors.append(self._unknown(token.split("=", 1)[0]))
                i = self._skip_values(argv, i)
                continue
            item = Item(token, flag, opt)
            items.append(item)
            named = f"`{token.split('=', 1)[0]}`" + (f" ({opt})" if item.abbreviated else "")
            if flag.action == "DeprecatedError":
                errors.append(
                    f"{named} is retired in SGLang {self.version}, which refuses it "
                    f"({flag.deprecated})"
                )
            values, i = self._take_values(argv, i, flag, opt, named, value, errors)
            if values is None:
                continue
            item.values = values
            for v in item.values:
                problem = self._check_value(flag, v)
                if problem:
                    errors.append(f"{named}: {problem}")
        return Parsed(items, errors)

    def _take_values(
        self,
        argv: list[str],
        i: int,
        flag: Flag,
        opt: str,
        named: str,
        value: str | None,
        errors: list[str],
    ) -> tuple[list[str] | None, int]:
        """(the values of `flag`, given as `named` (`value`: its `=VALUE`), taken from argv[i:] as
        its nargs says; where argv goes on). None, the problem added to `errors`, when they do not
        fit its nargs."""
        n = flag.nargs
        if value is not None:
            if n == 0:
                errors.append(
                    f"{named} is a switch and takes no value, but was given `={value}`; "
                    f"write {opt} alone (or leave it out)"
                )
                return None, i
            if isinstance(n, int) and n > 1:
                errors.append(f"{named} takes {n} values, not one `=` value")
                return None, i
            return [value], i
        if n == 0:
            return [], i
        values = []
        while i < len(argv) and not self._is_option_like(argv[i]) and argv[i] != "--":
            if n in (None, "?") and values or isinstance(n, int) and len(values) == n:
                break
            values.append(argv[i])
            i += 1
        need = 1 if n in (None, "+") else n if isinstance(n, int) else 0
        if len(values) < need:
            what = "a value" if need == 1 else f"{need} values"
            errors.append(
                f"{named} takes {what} and was given none; write {opt} VALUE (or {opt}=VALUE)"
            )
            return None, i
        return values, i

    def _skip_values(self, argv: list[str], i: int) -> int:
        """After an unknown flag, its likely values are not reported again as stray positionals."""
        while i < len(argv) and not self._is_option_like(argv[i]):
            i += 1
        return i

    def _check_value(self, flag: Flag, value: str) -> str | None:
        converted: object = value
        if flag.type in ("int", "float"):
            try:
                converted = int(value) if flag.type == "int" else float(value)
            except ValueError:
                return f"invalid {flag.type} value `{value}`"
        if (
            flag.choices is not None
            and converted not in flag.choices
            and value not in map(str, flag.choices)
        ):
            return _invalid_choice(value, [str(c) for c in flag.choices], self.version)
        return None

    def _unknown(self, option: str) -> str:
        msg = f"`{option}` is not a flag of SGLang {self.version}"
        older = [v for v in versions() if v != self.version and option in flag_set(v)]
        if older:
            msg += f" (it is one of SGLang {', '.join(older)})"
        hints = [RENAMED[option]] if option in RENAMED and RENAMED[option] in self else []
        hints += [
            o
            for o in difflib.get_close_matches(option, list(self.by_option), n=3, cutoff=0.75)
            if o not in hints
        ]
        if hints:
            return msg + f"; use {_or(hints)}, or remove it"
        return (
            msg
            + "; remove it (`python -m sglang.launch_server --help` on a GPU node lists the flags)"
        )


def _invalid_choice(value: str, choices: list[str], version: str) -> str:
    """Argparse's "invalid choice", with the closest choices first (a long list only when none is
    close)."""
    close = difflib.get_close_matches(value, choices, n=3, cutoff=0.6)
    # `Kimi_K2`: case matters
    close += [c for c in choices if c.lower() == value.lower() and c not in close]
    if not close:
        return f"invalid choice `{value}` (choose from {', '.join(choices)})"
    listed = (
        f"choose from {', '.join(choices)}"
        if len(choices) <= 12
        else f"{len(choices)} choices in SGLang {version}"
    )
    return f"invalid choice `{value}`; did you mean {_or([f'`{c}`' for c in close])}? ({listed})"


def _or(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


# -- the stub's parser
# ----------------------------------------------------------------------------------
def add_to_parser(
    parser: argparse.ArgumentParser, flags: FlagSet, *, skip_dests: set[str]
) -> list[Flag]:
    """Register every flag of `flags` on `parser` (values kept as given, int/float converted,
    choices enforced), except those whose dest is in `skip_dests` (the caller models them itself).
    Returns the flags added."""
    added = []
    for f in flags.flags:
        if f.dest in skip_dests or f.action == "help":
            continue
        kwargs: dict = {"dest": f.dest, "help": argparse.SUPPRESS}
        if f.nargs == 0:
            kwargs.update(action="store_const", const=True, default=None)
            if f.action == "BooleanOptionalAction":
                kwargs["action"] = argparse.BooleanOptionalAction
                del kwargs["const"]
                options = tuple(
                    o
                    for o in f.options
                    if not o.startswith("--no-") or "--" + o[5:] not in f.options
                )
                parser.add_argument(*options, **kwargs)
                added.append(f)
                continue
        else:
            kwargs["nargs"] = f.nargs
            if f.type in ("int", "float"):
                kwargs["type"] = int if f.type == "int" else float
            if f.choices is not None and (f.type or all(isinstance(c, str) for c in f.choices)):
                kwargs["choices"] = list(f.choices)
        parser.add_argument(*f.options, **kwargs)
        added.append(f)
    return added
