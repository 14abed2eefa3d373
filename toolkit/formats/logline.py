"""The toolkit's log lines, defined once: how they are written, and how they are read back.

For people (the terminal, a shard's `logs/NNNNN.log`, a Slurm task's output), every handler writes
`FORMAT` (`text_formatter`): `2026-12-06 21:08:33,123 INFO toolkit.worker: shard 0 ...`;
`parse_text` reads such a line back (a `LogLine`, or None for a line that is not one: a traceback's,
an engine's, a print).

Between processes, nothing is read back from that text: a worker that `toolkit run` starts (`toolkit
--log-relay worker ...`) writes each record on stderr as one JSON object (`RelayFormatter`), and the
run hands it to its own logging as it was (`parse_relayed`, `LogLine.record`): time, level, logger
and the whole message, a traceback included.

An error the command line ends with is one line, `ERROR_PREFIX` + the message (`error_line`).
"""

from __future__ import annotations

import datetime as _dt
import logging

import msgspec

__all__ = [
    "ERROR_PREFIX",
    "FORMAT",
    "LogLine",
    "RelayFormatter",
    "error_line",
    "parse_relayed",
    "parse_text",
    "text_formatter",
]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ERROR_PREFIX = "toolkit: error: "
_TIME = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime, milliseconds after the comma


class LogLine(msgspec.Struct, frozen=True):
    """One log record, as it travels between processes (a JSON object per line) or as a text line
    reads."""

    created: float  # seconds since the epoch
    level: int  # logging.INFO, ...
    name: str  # the logger's name
    message: str  # the message with its arguments in place (and a traceback, when it has one)

    def record(self) -> logging.LogRecord:
        """The record, for this process's logging: shown as when and where it was written."""
        return logging.makeLogRecord(
            {
                "name": self.name,
                "levelno": self.level,
                "levelname": logging.getLevelName(self.level),
                "msg": self.message,
                "created": self.created,
                "msecs": int(self.created % 1 * 1000),
            }
        )


def text_formatter() -> logging.Formatter:
    """The formatter of every log handler a person reads."""
    return logging.Formatter(FORMAT)


def parse_text(line: str) -> LogLine | None:
    """A line `text_formatter` wrote, or None when it is not one (no regular expression: the
    format's own fields, split where it joins them)."""
    head, sep, message = line.rstrip("\n").partition(": ")
    fields = head.split(" ")
    if not sep or len(fields) != 4:
        return None
    day, clock, level, name = fields
    number = logging.getLevelName(level)
    if not isinstance(number, int) or not name:
        return None
    try:
        when = _dt.datetime.strptime(f"{day} {clock}", _TIME)
    except ValueError:
        return None
    return LogLine(when.timestamp(), number, name, message)


class RelayFormatter(logging.Formatter):
    """A record as one JSON line (`LogLine`), for the process that relays it (`parse_relayed`)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        line = LogLine(record.created, record.levelno, record.name, message)
        return msgspec.json.encode(line).decode()


_decoder = msgspec.json.Decoder(LogLine)


def parse_relayed(line: str) -> LogLine | None:
    """A line `RelayFormatter` wrote, or None for any other line (a worker's stderr also holds what
    is no record: a crash's traceback, the command's error line)."""
    line = line.rstrip("\n")
    if not line.startswith("{"):
        return None
    try:
        return _decoder.decode(line)
    except msgspec.DecodeError:  # (ValidationError is one)
        return None


def error_line(error: BaseException | str) -> str:
    """The one line a command ends with when it fails."""
    return f"{ERROR_PREFIX}{error}"
