"""How the toolkit writes times and lists of numbers, for people and for the files it keeps."""

from __future__ import annotations

import datetime as _dt

__all__ = ["file_stamp", "local_time", "ranges", "utc_now"]


def utc_now() -> str:
    """The current time as ISO 8601 in UTC, to the second: what every manifest and plan records."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def local_time(ts: float) -> str:
    """A Unix time as local ISO 8601, to the second: for files a person on this machine reads."""
    return _dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def file_stamp() -> str:
    """The local time as it goes into a file name that keeps an older copy aside:
    20261203-154501."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def ranges(nums, sep: str = ", ", limit: int | None = None) -> str:
    """'0-3, 7, 9-10' for [0, 1, 2, 3, 7, 9, 10] (sorted first); `sep=","` gives Slurm's array
    syntax.

    With `limit`, at most that many ranges are written, then '... (N in all)'.
    """
    nums = sorted(nums)
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    if limit is not None and len(out) > limit:
        return sep.join(out[:limit]) + f"{sep}... ({len(nums)} in all)"
    return sep.join(out)
