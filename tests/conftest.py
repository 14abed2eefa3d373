"""Shared pytest fixtures.

Tokenizers: small real Hugging Face tokenizers built once per session by toolkit.stub.toy_tokenizer.
`no_flock`: this process on a file system without flock (older NFS, Lustre without -o flock).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items) -> None:
    """A test that needs the local cluster, real SGLang or the trainers is slow by nature: `-m "not slow"` leaves it
    out."""
    for item in items:
        if (
            item.get_closest_marker("slurm")
            or item.get_closest_marker("sglang")
            or item.get_closest_marker("trainers")
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def no_flock(monkeypatch) -> None:
    """flock fails with ENOLCK in this process, as on a file system without it: a lock file stands in."""

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", flock)


@pytest.fixture(scope="session")
def toy_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`toy_tokenizer(family)` -> folder of a tokenizer of that family (kimi, qwen3, deepseek), built once.

    The folder is shared by the whole session: copy it before changing anything in it.
    """
    from toolkit.stub.toy_tokenizer import build_tokenizer

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tokenizer(tmp_path_factory.mktemp(f"tokenizer-{family}"), family)
        return built[family]

    return get


REAL_TEMPLATES_DIR = Path(__file__).resolve().parent / "fixtures" / "chat-templates"

# Real chat templates (tests/fixtures/chat-templates/) and the toy tokenizer family holding their control tokens.
REAL_TEMPLATES: dict[str, str] = {
    "kimi-k2-thinking": "kimi-thinking",
    "deepseek-v3.1": "deepseek-v3",
    "deepseek-r1-distill": "deepseek",
    "qwen3": "qwen3",
    "glm-4.6": "glm",
    "minimax-m2": "minimax",
}


@pytest.fixture(scope="session")
def real_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`real_tokenizer(name)` -> folder of a toy tokenizer carrying the real chat template `name` (a key of
    REAL_TEMPLATES), built once per session. Copy it before changing anything in it."""
    from toolkit.stub.toy_tokenizer import build_tokenizer

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            template = (REAL_TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")
            built[name] = build_tokenizer(
                tmp_path_factory.mktemp(f"real-{name}"),
                REAL_TEMPLATES[name],
                chat_template=template,
            )
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real-engine tier's model folder (tests/realsglang.py): built once per session by the SGLang venv.
    A test of the tier fails, with what to run, when that venv is missing."""
    import realsglang

    why = realsglang.missing()
    if why:
        pytest.fail(why)
    return realsglang.build_model(tmp_path_factory.mktemp("tiny-model"))


def _served(tmp_path_factory, kind: str, model: Path):
    import sys

    import realsglang

    tmp = tmp_path_factory.mktemp(f"served-{kind}")
    if kind == "sglang":
        job = realsglang.sglang_job(tmp, model, extra_args=realsglang.PROBE_ARGS)
        python = str(realsglang.python())
    else:
        job = realsglang.stub_job(tmp, model)
        python = sys.executable
    return realsglang.Served(job, python, tmp / "server.log")


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory, tiny_model):
    """Real SGLang serving the tiny model, started once per session through the toolkit's launch path
    (tests/real_sglang/serve.py), with the probe settings of realsglang.PROBE_ARGS."""
    served = _served(tmp_path_factory, "sglang", tiny_model)
    yield served
    served.stop()


@pytest.fixture(scope="session")
def stub_server(tmp_path_factory, tiny_model):
    """The stub engine with the same model folder and settings as sglang_server."""
    served = _served(tmp_path_factory, "stub", tiny_model)
    yield served
    served.stop()
