"""Prompts to generate, rendered ahead of the requests: the render thread loads the tokenizer,
renders the shard's prompts to input_ids in planned order and hands them, a batch at a time, to the
event loop through a `Feed`, bounded by a `Budget`. Turns > 0 of regenerated conversations go to the
chains (worker.turn_order) instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import msgspec

from toolkit.formats.prompts import PromptRef, ShardRefs
from toolkit.formats.records import TEMPLATE
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat
from toolkit.job.inputs import PromptReader
from toolkit.job.turns import turn_prompt

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger


class TodoItem(NamedTuple):
    """A prompt to generate: its planned position and its ref."""

    pos: int
    ref: PromptRef


class Rendered(NamedTuple):
    """A prompt rendered for a request: its planned position, its ref, and its input_ids, or instead
    the (failure kind, message) of a chat template that could not render it."""

    pos: int
    ref: PromptRef
    ids: list[int] | None
    error: tuple[str, str] | None = None
    # the data-parallel rank holding what it continues (a regenerated turn: the turn before it)
    dp_rank: int | None = None


class LaterTurns(Protocol):
    """Where turns > 0 go (chains.Chains): each waits for the answer of the turn before it."""

    tok: Any
    info: Any

    def arrive(self, items: list[TodoItem]) -> None: ...


@dataclass
class RenderState:
    """What the render thread and the event loop share: the tokenizer and its token info once loaded
    (set by the thread, or beforehand when the worker's session kept them from its previous shard),
    the chains of regenerated conversations (set before it starts), and the stop flag (set by the
    loop)."""

    tok: Any = None
    info: Any = None
    chains: LaterTurns | None = None
    stop: bool = False


class Budget:
    """How many rendered prompts may wait for a request: the render thread blocks in `acquire` past
    `cap`, the event loop releases one per prompt it takes. Keeps the worker's memory flat however
    large the shard."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.closed = cap, 0, False
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.cap and not self.closed:
                self._cond.wait()
            self.used += n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Feed:
    """Rendered prompts in planned order, filled by the render thread; prompts to redo come
    first."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or Budget(1 << 62)
        self.items: deque[Rendered] = deque()
        self.redo: deque[Rendered] = deque()
        self.finished = False
        # prompts that will come later (regenerated turns waiting for the turn before them)
        self.pending = 0
        self.closed = False  # stopping: hand out nothing more
        self.peak = 0  # most rendered prompts waiting at once
        # The readiness probe's input_ids (chat.probe_ids), set by the render thread before its
        # first batch; `first` resolves to them once a prompt is rendered (there is something to
        # send), or to None when none will be.
        self.probe: list[int] | None = None
        self.first = asyncio.get_running_loop().create_future()
        self._event = asyncio.Event()

    def put(self, items: list[Rendered] | None) -> None:
        """Add a batch of rendered prompts, or mark the end (None)."""
        if items is None:
            self.finished = True
        else:
            self.items.extend(items)
            self.peak = max(self.peak, len(self.items))
            if not self.first.done() and any(item.ids is not None for item in items):
                self.first.set_result(self.probe)
        if self.finished and not self.first.done():
            self.first.set_result(None)
        self._event.set()

    def unsent(self) -> int:
        """Prompts still to hand out (1 while the render thread has not finished: more may come)."""
        if self.closed:
            return 0
        return len(self.items) + len(self.redo) + self.pending + (not self.finished)

    def set_probe(self, ids: list[int]) -> None:
        self.probe = ids

    def later(self, item: Rendered) -> None:
        """A prompt that waited (see `pending`) is ready: it goes out before the others."""
        if not self.first.done() and item.ids is not None:
            self.first.set_result(self.probe)
        self.redo.append(item)
        self.pending -= 1
        self._event.set()

    def close(self) -> None:
        """Stopping: hand out nothing more."""
        self.closed = True
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if not self.first.done():
            self.first.set_exception(exc)
        self.finished = True
        self._event.set()

    async def get(self) -> Rendered | None:
        while True:
            if self.closed:
                return None
            if self.redo:
                return self.redo.popleft()
            if self.items:
                self.budget.release()
                return self.items.popleft()
            if self.finished and not self.pending:
                return None
            self._event.clear()
            await self._event.wait()


class Todo:
    """The prompts of a shard to generate, in planned order, a batch at a time: the shard's refs
    read as they are needed (plan.ShardRefs), and which to generate as one bit per prompt (None:
    every one). Nothing else is kept per prompt: a worker's memory does not grow with its shard."""

    def __init__(
        self, refs: ShardRefs, chosen: bytearray | None = None, count: int | None = None
    ) -> None:
        self.refs, self.chosen = refs, chosen
        self.count = len(refs) if chosen is None else count

    def __len__(self) -> int:
        return self.count

    def __contains__(self, i: int) -> bool:
        """Whether the shard's i-th prompt is to be generated."""
        return self.chosen is None or bool(self.chosen[i >> 3] >> (i & 7) & 1)

    def batches(self, size: int) -> Iterator[list[TodoItem]]:
        batch: list[TodoItem] = []
        for i, ref in enumerate(self.refs):
            if i in self:
                batch.append(TodoItem(self.refs.first + i, ref))
                if len(batch) == size:
                    yield batch
                    batch = []
        if batch:
            yield batch


def render_thread(loop, feed: Feed, plan: RunPlan, todo: Todo, state: RenderState) -> None:
    """Load the tokenizer and render every prompt to input_ids, in planned order (runs beside engine
    start)."""
    try:
        _render_all(loop, feed, plan, todo, state)
        loop.call_soon_threadsafe(feed.put, None)
    except BaseException as e:  # surfaced in the event loop, not lost in a thread
        loop.call_soon_threadsafe(feed.fail, e)


def _render_all(loop, feed: Feed, plan: RunPlan, todo: Todo, state: RenderState) -> None:
    """Load the tokenizer (unless the state holds it: a claiming worker's next shard), then render
    `todo` in batches and feed them to the event loop."""
    if state.tok is None:
        tok = chat.load_tokenizer(plan.spec.model)
        info = chat.token_info(tok, plan.spec.model)
        chat.check_model_vocab(tok, info, plan.spec.model)  # before any prompt can reach the engine
        state.info, state.tok = info, tok
    else:
        log.info("tokenizer kept from this task's previous shard: not loaded again")
    tok, info = state.tok, state.info
    chains = state.chains
    if chains is not None:
        chains.tok, chains.info = tok, info
    log.info(
        "tokenizer ready: think-start %d, think-end %d, eos %s, tool-call start %s, template "
        "opens reasoning: %s",
        info.think_start_id,
        info.think_end_id,
        info.eos_ids,
        info.tool_call_start_id,
        info.opens_reasoning,
    )
    # before the first batch
    loop.call_soon_threadsafe(feed.set_probe, chat.probe_ids(tok, plan.spec.model))
    with PromptReader() as reader:
        for batch in todo.batches(chat.BATCH_SIZE):
            feed.budget.acquire(len(batch))  # blocks while enough is rendered ahead of the requests
            if state.stop:
                break
            later = [item for item in batch if item.ref.turn]  # need the answer of the turn before
            if later:
                batch = [item for item in batch if not item.ref.turn]
                feed.budget.release(len(later))
                loop.call_soon_threadsafe(chains.arrive, later)
            prompts = []
            for pos, ref in batch:
                ds = plan.datasets[ref.dataset]
                prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
                prompts.append(turn_prompt(prompt, 0, []) if ds.regenerate else prompt)
            if not prompts:
                continue
            try:
                rendered = [(ids, None) for ids in chat.render_many(tok, plan.spec.model, prompts)]
            except chat.ChatError:  # find which prompts fail; the others still go out
                rendered = []
                for prompt in prompts:
                    try:
                        rendered.append((chat.render(tok, plan.spec.model, prompt), None))
                    except chat.ChatError as e:
                        rendered.append((None, (TEMPLATE, f"chat template: {e}")))
            items = [
                Rendered(pos, ref, ids, err) for (pos, ref), (ids, err) in zip(batch, rendered)
            ]
            loop.call_soon_threadsafe(feed.put, items)  # one wake-up of the event loop per batch


class KeptTokenizer:
    """The tokenizer and its token info a render thread loaded, kept by the engine session for its
    next shards with the same model, tokenizer and template (None, None: the render thread loads
    them)."""

    def __init__(self):
        self._kept: tuple[bytes, Any, Any] | None = None  # (key, tokenizer, token info)

    def get(self, plan: RunPlan) -> tuple[Any, Any]:
        if self._kept is not None and self._kept[0] == _tokenizer_key(plan):
            return self._kept[1], self._kept[2]
        return None, None

    def keep(self, plan: RunPlan, tok, info) -> None:
        if tok is not None and info is not None:
            self._kept = (_tokenizer_key(plan), tok, info)


def _tokenizer_key(plan) -> bytes:
    """What a loaded tokenizer and its token info depend on: the [model] table and the digests of
    its folders."""
    return msgspec.json.encode([plan.spec.model, plan.parts["tokenizer"], plan.parts["template"]])
