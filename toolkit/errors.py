"""Exit codes of the `toolkit` command, shared by every module that decides one."""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "EXIT_STOPPED", "EXIT_UNKNOWN"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_UNKNOWN = 0, 1, 2, 3, 4
