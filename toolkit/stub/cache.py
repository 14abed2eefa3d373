"""The prefix cache behind `meta_info.cached_tokens`."""

from __future__ import annotations


class PrefixCache:
    """SGLang's radix cache of one data-parallel rank, as far as `meta_info.cached_tokens` shows
    it: a prompt's tokens already computed for an earlier request with the same leading tokens. At
    most len(prompt) - 1 count (the last one is always computed, for its logits). Prompts are cached
    when admitted, and a finished (or aborted) request's prompt + output once it ends, so that a
    continuation (prompt + output so far) sent to the same rank finds all of it; `/flush_cache`
    empties it, and past `capacity` prefixes it is emptied too (eviction, coarsely).
    """

    def __init__(self, capacity: int = 4_000_000):
        self.capacity = capacity
        # hashes of every cached prefix (prefix-closed: all shorter ones are in)
        self._seen: set[int] = set()

    def admit(self, prompt: list[int]) -> int:
        """The number of cached tokens of `prompt`, which is then cached itself."""
        if len(self._seen) + len(prompt) > self.capacity:
            self._seen.clear()
        seen, h, cached, hit = self._seen, 0, 0, True
        for k, token in enumerate(prompt):
            h = hash((h, token))
            if hit and h in seen:
                cached = k + 1
            else:
                hit = False
                seen.add(h)
        return min(cached, len(prompt) - 1)

    def clear(self) -> None:
        self._seen.clear()
