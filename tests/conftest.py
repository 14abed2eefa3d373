"""Shared pytest fixtures.

Tokenizers: small real Hugging Face tokenizers built once per session by toolkit.toy_tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def toy_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`toy_tokenizer(family)` -> folder of a tokenizer of that family (kimi, qwen3, deepseek), built once.

    The folder is shared by the whole session: copy it before changing anything in it.
    """
    from toolkit.toy_tokenizer import build_tokenizer

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tokenizer(tmp_path_factory.mktemp(f"tokenizer-{family}"), family)
        return built[family]

    return get
