"""Admission: each model's concurrency limit and its queue, shared fairly between keys.

Contract (concurrency): everything runs on the gateway's asyncio loop; nothing here
awaits except a waiter in ``enter``, so the counts never interleave.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class _Queue:
    """One model's waiters, per key. The dict's order is the keys' turn order: the key
    served goes to the back while it still waits, so keys take turns for freed slots."""

    def __init__(self) -> None:
        self.by_key: dict[str, deque[tuple[asyncio.Future[None], float]]] = {}
        self.count = 0

    def push(self, key: str, entry: tuple[asyncio.Future[None], float]) -> None:
        self.by_key.setdefault(key, deque()).append(entry)
        self.count += 1

    def pop(self) -> asyncio.Future[None] | None:
        """The oldest waiter of the key whose turn it is (None when nobody waits)."""
        while self.by_key:
            key = next(iter(self.by_key))
            waiters = self.by_key.pop(key)
            future, _ = waiters.popleft()
            self.count -= 1
            if waiters:
                self.by_key[key] = waiters  # to the back of the turn order
            if not future.done():
                return future
        return None

    def remove(self, key: str, entry: tuple[asyncio.Future[None], float]) -> bool:
        waiters = self.by_key.get(key)
        if waiters is None or entry not in waiters:
            return False
        waiters.remove(entry)
        self.count -= 1
        if not waiters:
            del self.by_key[key]
        return True

    def of(self, key: str) -> int:
        waiters = self.by_key.get(key)
        return len(waiters) if waiters else 0

    def oldest(self) -> float | None:
        return min((w[0][1] for w in self.by_key.values()), default=None)


class Admission:
    """Per-model concurrency limit with a bounded queue shared fairly between API keys.

    ``enter`` returns False at once when the model's queue is full, or when the caller's
    key already holds its share of that queue (``key_queue`` places); otherwise it returns
    when the caller holds a slot. ``leave`` hands the slot straight to a waiter, so a
    newcomer never overtakes the queue; waiting keys take turns (each key's own requests in
    order), so one key's backlog cannot starve another key. ``oldest_wait`` says how long
    the longest waiter has waited: the saturation signal for scale-out.

    The limit follows capacity: ``resize`` (called whenever a model's ready count changes)
    lets waiters in at once up to a higher limit; under a lower one, slots freed are not
    handed on until the model is under it again. ``limit`` is ``default`` for a model
    never resized.
    """

    def __init__(self, default: int = 1) -> None:
        self.default = default
        self.limits: dict[str, int] = {}
        self.active: dict[str, int] = {}
        self.waiting: dict[str, _Queue] = {}

    def limit(self, model: str) -> int:
        return self.limits.get(model, self.default)

    def resize(self, model: str, limit: int) -> None:
        """The model's limit is now ``limit``: waiters up to it get their slot at once."""
        self.limits[model] = limit
        waiters = self.waiting.get(model)
        while waiters is not None and self.active.get(model, 0) < limit:
            future = waiters.pop()
            if future is None:
                break
            self.active[model] = self.active.get(model, 0) + 1
            future.set_result(None)

    async def enter(self, model: str, queue: int, key: str = "", key_queue: int | None = None) -> bool:
        waiters = self.waiting.get(model)
        if waiters is None:
            waiters = self.waiting[model] = _Queue()
        if self.active.get(model, 0) < self.limit(model) and not waiters.count:
            self.active[model] = self.active.get(model, 0) + 1
            return True
        if waiters.count >= queue or (key_queue is not None and waiters.of(key) >= key_queue):
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, time.monotonic())
        waiters.push(key, entry)
        try:
            await future
        except asyncio.CancelledError:
            if not waiters.remove(key, entry) and future.done() and not future.cancelled():
                self.leave(model)  # the slot was handed to us as we left: pass it on
            raise
        return True

    def key_waiting(self, model: str, key: str) -> int:
        waiters = self.waiting.get(model)
        return waiters.of(key) if waiters is not None else 0

    def leave(self, model: str) -> None:
        waiters = self.waiting.get(model)
        if self.active[model] <= self.limit(model):
            future = waiters.pop() if waiters is not None else None
            if future is not None:
                future.set_result(None)  # the slot goes straight to the waiter
                return
        self.active[model] -= 1

    def queued(self) -> dict[str, int]:
        return {m: w.count for m, w in self.waiting.items()}

    def oldest_wait(self, model: str, now: float) -> float:
        """Seconds the longest waiter in ``model``'s queue has waited (0 when none waits)."""
        waiters = self.waiting.get(model)
        oldest = waiters.oldest() if waiters is not None else None
        return 0.0 if oldest is None else now - oldest
