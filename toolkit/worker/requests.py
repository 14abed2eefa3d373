"""One open shard's requests, with one writer: the rids sent and not answered yet (aborted one by
one on an engine the worker does not own), how many requests are out, the output tokens they brought
and when the last answer came (the hang watch counts from it), the failed tries of each id redone in
this budget (Record.tries) and the partial outputs to continue (PARTIAL records, by id). The shard's
requests (worker.inflight) change it through its methods only."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from toolkit.engines.rids import make_rid
from toolkit.formats.records import Record

__all__ = ["Requests"]


class Requests:
    """The requests of shard `shard` (see the module's docstring); `tries` and `partial` as its
    file left them (worker.run)."""

    def __init__(
        self,
        shard: int,
        tries: dict[str, int] | None = None,
        partial: dict[str, Record] | None = None,
        *,
        tag: str | None = None,
    ):
        self.shard = shard
        self.tries: dict[str, int] = tries if tries is not None else {}
        self.partial: dict[str, Record] = partial if partial is not None else {}
        self.rids: set[str] = set()  # sent and not answered
        self.in_flight = 0  # requests sent and not answered
        self.tokens = 0  # output tokens this run's answers brought
        self.last_answer = time.monotonic()
        self.rid_seq = 0
        self.rid_tag = tag if tag is not None else os.urandom(3).hex()

    def rid_maker(self, pos: int, sample: int, made: list[str]) -> Callable[[], str]:
        """A fresh rid per HTTP attempt (engines/rids: one width, so an abort by rid never takes
        another request with it; naming the sample asked for), added to `made`."""

        def make() -> str:
            self.rid_seq += 1
            rid = make_rid(self.rid_tag, self.shard, pos, sample, self.rid_seq)
            made.append(rid)
            self.rids.add(rid)
            return rid

        return make

    def sent(self) -> None:
        self.in_flight += 1

    def back(self, made: list[str]) -> None:
        """A request is back (answered or not): its rids are no longer in flight."""
        self.in_flight -= 1
        self.rids.difference_update(made)

    def answered(self, tokens: int) -> None:
        """An answer came, with `tokens` new output tokens."""
        self.last_answer = time.monotonic()
        self.tokens += tokens

    def heard(self) -> None:
        """The engine answered (a rejection, or generation starting): the hang watch counts from
        now."""
        self.last_answer = time.monotonic()

    def take_partial(self, id: str) -> Record | None:
        return self.partial.pop(id, None)

    def keep_partial(self, id: str, record: Record) -> None:
        """`record` (PARTIAL) is what the next try of `id` continues."""
        self.partial[id] = record

    def tried(self, id: str) -> int:
        """The failed tries of `id` so far in this budget."""
        return self.tries.get(id, 0)

    def count_tries(self, id: str, tries: int) -> None:
        self.tries[id] = tries

    def settled(self, id: str) -> None:
        """`id` has its final record: its tries are no longer counted here."""
        self.tries.pop(id, None)
