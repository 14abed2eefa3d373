"""The request ids (`rid`) the worker sends: one fixed width, unique per HTTP attempt, and naming
the sample of the prompt they ask for.

One width: SGLang's scheduler aborts every rid that an aborted rid is a prefix of, and strings of
one length are never prefixes of each other. Unique by (process tag, sequence number). The shard and
planned position are there for the server's log; the sample number lets the stub engine answer a
request by what it asks for alone (its `outputs.Draws`): a seedless sample k of a prompt is the same
draw whichever process sends it, so a run stopped and started again never draws sample 1 as a twin
of sample 0, and a partial output is continued by the draw it was cut from.
"""

from __future__ import annotations

import re

_RID = re.compile(r"tk-[0-9a-f]{6}-\d{5}-\d{10}-s(\d{6})-\d{8}")


def make_rid(tag: str, shard: int, pos: int, sample: int, seq: int) -> str:
    """The rid of one attempt: `tag` is 6 hex digits, `seq` counts the attempts of the process."""
    return (
        f"tk-{tag}-{shard % 100000:05d}-{pos % 10**10:010d}-s{sample % 10**6:06d}-{seq % 10**8:08d}"
    )


def rid_sample(rid: object) -> int | None:
    """The sample number a rid made by `make_rid` names; None for any other rid."""
    m = _RID.fullmatch(rid) if isinstance(rid, str) else None
    return int(m.group(1)) if m else None
