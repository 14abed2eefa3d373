"""Multi-turn order for regenerated conversations (turns.py): turn k waits until turn k-1 has a
record, then is rendered with the answers of the turns before it and handed to the feed ahead of the
other prompts; a failed turn fails the turns after it.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from toolkit.formats.prompts import PromptRef, ShardRefs
from toolkit.formats.records import (
    FAILURES,
    OK,
    PREVIOUS_TURN,
    REJECTED,
    TEMPLATE,
    Record,
    failed_record,
)
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat
from toolkit.job.inputs import PromptReader
from toolkit.job.turns import answer_of, turn_prompt
from toolkit.worker.feed import Feed, Rendered, TodoItem


class Recorder(Protocol):
    """The shard the chains record into (worker.openshard.Shard)."""

    plan: RunPlan

    def add(self, record: Record) -> None: ...


class Chains:
    """Multi-turn regeneration inside one shard (turns.py): turn k of a conversation is rendered
    with the answers of turns 0..k-1, so it waits until turn k-1 has a record. Lives on the event
    loop's thread; the renders of waiting turns run on an executor thread with their own prompt
    reader."""

    def __init__(self, sh: Recorder, feed: Feed, refs: ShardRefs, done: dict[str, Record]):
        self.sh, self.feed, self.refs = sh, feed, refs
        self.plan = sh.plan
        self.tok = self.info = None
        self.answers: dict[tuple, dict[int, Record]] = {}  # conversation -> {turn: its ok record}
        # conversation -> (turn, kind, error, final: given up for the run) of a failed turn
        self.failed: dict[tuple, tuple[int, str, str, bool]] = {}
        self.waiting: dict[tuple, dict[int, TodoItem]] = {}
        self.reader = PromptReader()
        self.loop = asyncio.get_running_loop()
        # resumed: the turns recorded ok (and not to be redone) are the history
        for rec in done.values():
            ref = self.ref_at(rec.index)
            self.answers.setdefault(self.key(ref), {})[ref.turn] = rec

    @staticmethod
    def key(ref: PromptRef) -> tuple[int, int, int]:
        return ref.dataset, ref.line, ref.sample

    def ref_at(self, pos: int) -> PromptRef:
        return self.refs[pos - self.refs.first]

    def dataset_of(self, rec: Record) -> int:
        return self.ref_at(rec.index).dataset

    def arrive(self, items: list[TodoItem]) -> None:
        """Turns > 0 reached by the render thread: rendered now if the turn before has its answer,
        else later."""
        for pos, ref in items:
            self.feed.pending += 1
            self.waiting.setdefault(self.key(ref), {})[ref.turn] = TodoItem(pos, ref)
            self._advance(self.key(ref))

    def recorded(self, rec: Record) -> None:
        ref = self.ref_at(rec.index)
        key = self.key(ref)
        if rec.status == OK:
            self.answers.setdefault(key, {})[ref.turn] = rec
        else:
            transient = FAILURES.get(rec.failure or "", False)
            self.failed[key] = (
                ref.turn,
                PREVIOUS_TURN if transient else (rec.failure or REJECTED),
                f"turn {ref.turn + 1} of this conversation failed ({rec.failure}): {rec.error}",
                rec.final,
            )
        self._advance(key)

    def _advance(self, key: tuple) -> None:
        waiting = self.waiting.get(key)
        if not waiting:
            return
        turn = min(waiting)
        failed = self.failed.get(key)
        if failed is not None and failed[0] < turn:
            pos, ref = waiting.pop(turn)
            self.feed.pending -= 1
            _, kind, why, final = failed  # a turn given up for the run gives up the turns after it
            ds = self.plan.datasets[ref.dataset].name
            # cascades to the turns after it
            self.sh.add(failed_record(ref.id, ds, pos, [], why, 0, kind, final=final))
            return
        known = self.answers.get(key, {})
        if any(t not in known for t in range(turn)):
            return
        pos, ref = waiting.pop(turn)
        history = [known[t] for t in range(turn)]
        fut = self.loop.run_in_executor(self.executor, self._render, pos, ref, history)
        fut.add_done_callback(lambda f: self.feed.later(f.result()) if not f.cancelled() else None)

    @property
    def executor(self):
        if not hasattr(self, "_executor"):
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="turns")
        return self._executor

    def _render(self, pos: int, ref: PromptRef, history: list[Record]) -> Rendered:
        """A turn > 0, rendered with the answers decoded from the turns before it."""
        ds = self.plan.datasets[ref.dataset]
        try:
            prompt = self.reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
            answers = [answer_of(rec, self.tok, self.info) for rec in history]
            return Rendered(
                pos,
                ref,
                chat.render(self.tok, self.plan.spec.model, turn_prompt(prompt, ref.turn, answers)),
                dp_rank=history[-1].dp_rank if history else None,
            )
        except chat.ChatError as e:
            return Rendered(pos, ref, None, (TEMPLATE, f"chat template: {e}"))

    def close(self) -> None:
        if hasattr(self, "_executor"):
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
