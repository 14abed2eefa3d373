"""Lines of at most 100 characters in the whole package; `python scripts/wrap_lines.py FILE ...` wraps
a file that grew longer ones, layout only."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100
NARROW = ["toolkit"]


def _files() -> list[Path]:
    return sorted(p for name in NARROW for p in ([ROOT / name] if name.endswith(".py")
                                                 else (ROOT / name).rglob("*.py")))


def test_lines_fit_100_characters():
    files = _files()
    assert len(files) > 40 and ROOT / "toolkit" / "cluster" / "status.py" in files
    long = [f"{p.relative_to(ROOT)}:{i}: {len(line)}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").split("\n"), 1) if len(line) > WIDTH]
    assert not long, (f"lines over {WIDTH} characters (python scripts/wrap_lines.py wraps them):\n  "
                      + "\n  ".join(long))
