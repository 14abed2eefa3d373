"""Errors by kind: every error class derives from the kind that is its exit code (toolkit.errors.ERROR_CLASS_BY_CODE), no raise
gives another code, and a failure is one line (`toolkit -v`: its traceback first)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import toolkit
from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.errors import (
    ERROR_CLASS_BY_CODE,
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_MEANINGS,
    BadInputError,
    FailedError,
    ToolkitError,
)

PACKAGE = Path(toolkit.__file__).parent

# Exceptions that never reach the command line, so carry no exit code: each is caught where it is raised and
# said in the words of a toolkit error (or is a separate program's, or mirrors SGLang's own ValueErrors).
OUTSIDE_THE_KINDS = {
    "toolkit.engines.sglang_contract.sampling.SamplingError": "SGLang's own ValueError, mirrored",
    "toolkit.engines.sglang_contract.sampling.TypeMismatch": "SGLang's own ValueError, mirrored",
    "toolkit.formats.frames.CorruptShard": "reworded by its readers (merge, export, logs) as a toolkit error",
    "toolkit.formats.frames.FrameError": "a frame that does not decode: CorruptShard's cause",
    "toolkit.stub.contract.ContractError": "the stub's own program: an HTTP answer, not an exit code",
    "toolkit.stub.contract.RequestError": "the stub's own program: an HTTP answer, not an exit code",
    "toolkit.stub.contract.ParseError": "the stub's own program: an HTTP answer, not an exit code",
    "toolkit.worker.stop.Stopped": "the worker's stop, inside one shard",
}


def _error_classes() -> dict[str, type[BaseException]]:
    """Every exception class the toolkit's modules define, by its full name."""
    found = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], "toolkit."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
            ):
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_error_class_is_one_kind_whose_code_it_keeps():
    classes = _error_classes()
    assert {
        "toolkit.worker.shard.ShardFailed",
        "toolkit.engines.client.ClientError",
    } <= classes.keys()
    assert set(ERROR_CLASS_BY_CODE) <= set(EXIT_MEANINGS) and all(
        k.exit_code == code for code, k in ERROR_CLASS_BY_CODE.items()
    )
    wrong = []
    for name, cls in sorted(classes.items()):
        if name in OUTSIDE_THE_KINDS:
            assert not issubclass(cls, ToolkitError), (
                f"{name} is in the tree now: take it off OUTSIDE_THE_KINDS"
            )
            continue
        if cls is ToolkitError or cls in ERROR_CLASS_BY_CODE.values():
            continue
        kinds = [k for k in ERROR_CLASS_BY_CODE.values() if issubclass(cls, k)]
        if len(kinds) != 1:
            wrong.append(
                f"{name}: derives from {len(kinds)} kinds ({', '.join(k.__name__ for k in kinds)})"
            )
        elif "exit_code" in vars(cls) or cls.exit_code != kinds[0].exit_code:
            wrong.append(f"{name}: a {kinds[0].__name__} with its own exit code {cls.exit_code}")
    assert not wrong, (
        "error classes that are not one kind (toolkit.errors.ERROR_CLASS_BY_CODE):\n  "
        + "\n  ".join(wrong)
    )
    assert not [n for n in OUTSIDE_THE_KINDS if n not in classes], (
        "a class listed outside the kinds is gone"
    )


def test_no_raise_gives_an_exit_code_of_its_own():
    """The kind is the code: an instance cannot say another (`exit_code=` is no argument of any error)."""
    given = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and any(k.arg == "exit_code" for k in node.keywords):
                given.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not given, f"errors given an exit code where they are raised: {given}"
    with pytest.raises(TypeError):
        BadInputError("x", exit_code=EXIT_FAILED)


def test_client_errors_are_failures_whose_kind_is_the_records_word():
    from toolkit.engines import client
    from toolkit.formats.records import FAILURES

    kinds = {
        c: c.kind
        for c in (
            client.Unreachable,
            client.TimedOut,
            client.ServerError,
            client.RequestRejected,
            client.BadResponse,
        )
    }
    assert kinds == {
        client.Unreachable: "unreachable",
        client.TimedOut: "timeout",
        client.ServerError: "server_error",
        client.RequestRejected: "rejected",
        client.BadResponse: "bad_response",
    }
    assert set(kinds.values()) <= FAILURES.keys()
    assert (
        issubclass(client.ClientError, FailedError)
        and client.ServerError(503, b"busy").kind == "server_error"
    )


@pytest.fixture
def planned(tmp_path, toy_tokenizer):
    rd, _ = prepared_run(make_job(tmp_path, toy_tokenizer("kimi"), n=4))
    return rd


def _cases(tmp_path, rd):
    """(argv, the exit code, a word of the message): one failure of each kind."""
    return [
        (["check", str(tmp_path / "nope.toml")], EXIT_BAD_INPUT, "nope.toml"),  # BadInputError
        (["logs", str(rd.root), "0"], EXIT_FAILED, "has not started"),  # FailedError: no log yet
    ]


def test_each_kind_exits_with_its_code_in_one_line(tmp_path, planned, capsys):
    for argv, code, word in _cases(tmp_path, planned):
        assert cli_main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.startswith("toolkit: error: ") and err.count("\n") == 1 and word in err, err
        assert "Traceback" not in err


def test_v_shows_the_traceback_of_a_failure_then_its_line(tmp_path, planned, capsys):
    for argv, code, word in _cases(tmp_path, planned):
        assert cli_main(["-v", *argv]) == code, argv
        err = capsys.readouterr().err
        assert "Traceback (most recent call last):" in err, err
        last = err.rstrip("\n").splitlines()[-1]
        assert last.startswith("toolkit: error: ") and word in last, err
        assert err.count("toolkit: error: ") == 1
