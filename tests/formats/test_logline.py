"""The log lines, defined once (formats.logline): what the handlers write reads back as it was, and a worker's
records reach the `toolkit run` that started it as JSON, never parsed from the text."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

import runs
from toolkit.formats.logline import (
    ERROR_PREFIX,
    LogLine,
    RelayFormatter,
    error_line,
    parse_relayed,
    parse_text,
    text_formatter,
)


def _record(
    msg: str, *args, level=logging.WARNING, name="toolkit.worker", exc_info=None
) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)


def test_a_text_line_reads_back_as_it_was_written():
    rec = _record("shard %d: %s", 3, "a: b: c (ERROR INFO)")
    got = parse_text(text_formatter().format(rec))
    assert got == LogLine(
        got.created, logging.WARNING, "toolkit.worker", "shard 3: a: b: c (ERROR INFO)"
    )
    assert abs(got.created - rec.created) < 0.001 + 1e-6  # asctime keeps milliseconds
    assert (
        parse_text(text_formatter().format(_record("x", level=logging.ERROR, name="toolkit"))).level
        == 40
    )


@pytest.mark.parametrize(
    "line",
    [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        f"{ERROR_PREFIX}something went wrong: do this",
        "2026-12-06 21:08:33,123 NOTALEVEL toolkit.worker: x",
        "2026-13-06 21:08:33,123 INFO toolkit.worker: a month 13",
        "2026-12-06 21:08:33,123 INFO : no logger name",
        "[2026-12-06 21:08:33] INFO the stub's own line",
        "",
    ],
)
def test_what_is_not_a_log_line_is_none(line):
    assert parse_text(line) is None and parse_relayed(line) is None


def test_a_relayed_record_keeps_its_time_level_logger_and_whole_message():
    try:
        raise ValueError("deep")
    except ValueError:
        rec = _record(
            "two\nlines, ünïcode {json: [1]}",
            level=logging.ERROR,
            name="toolkit.engines.base",
            exc_info=sys.exc_info(),
        )
    line = RelayFormatter().format(rec)
    assert "\n" not in line
    got = parse_relayed(line + "\n")
    assert (got.created, got.level, got.name) == (
        rec.created,
        logging.ERROR,
        "toolkit.engines.base",
    )
    assert (
        got.message.startswith("two\nlines, ünïcode {json: [1]}\nTraceback")
        and "ValueError: deep" in got.message
    )
    back = got.record()
    assert (back.created, back.levelno, back.levelname, back.name) == (
        rec.created,
        40,
        "ERROR",
        rec.name,
    )
    assert back.getMessage() == got.message and back.msecs == int(rec.created % 1 * 1000)
    assert parse_relayed('{"created": 1.0, "level": "INFO"}') is None  # JSON, but not a record
    assert error_line("it broke") == "toolkit: error: it broke"


def test_the_run_relays_a_workers_records_and_says_other_lines_as_warnings(caplog):
    from toolkit.pipeline import _relay

    lines = [
        RelayFormatter().format(_record("engine ready", level=logging.INFO, name="toolkit.worker")),
        RelayFormatter().format(_record("hidden", level=logging.DEBUG, name="toolkit.worker")),
        "Traceback (most recent call last):",
    ]
    caplog.set_level(logging.INFO)
    _relay(io.StringIO("\n".join(lines) + "\n"), logging.getLogger("toolkit.test.run"))
    got = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert got == [
        ("toolkit.worker", "INFO", "engine ready"),
        ("toolkit.test.run", "WARNING", "Traceback (most recent call last):"),
    ]


def test_log_relay_makes_every_record_of_a_command_one_json_line(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 4}, shards=2)
    runs.write_run(s)
    argv = [sys.executable, "-m", "toolkit", "--log-relay", "merge", str(s.root), "--no-audit"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    records = [parse_relayed(line) for line in r.stderr.splitlines()]
    assert records and None not in records, r.stderr
    assert any(
        x.name == "toolkit.dataset.merge" and x.message.startswith("merging shard 0")
        for x in records
    )
    plain = subprocess.run(argv[:3] + argv[4:], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and all(parse_text(line) for line in plain.stderr.splitlines()), (
        plain.stderr
    )
