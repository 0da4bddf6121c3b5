"""Admission: each model's concurrency limit and its queue, served by priority and shared
fairly between keys, and each key's cap on its requests in flight.

Contract (concurrency): everything runs on the gateway's asyncio loop; nothing here
awaits except a waiter in ``enter``, so the counts never interleave.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

from llmgw_cli.core.serving.limits import Priority


class Admit(Enum):
    """What ``enter`` answers: ``entered`` (true), or why the request was refused (false)."""

    entered = "entered"
    queue_full = "queue_full"  # the model's queue is full
    key_queue_full = "key_queue_full"  # the key holds its share of the model's queue
    key_parallel = "key_parallel"  # the key has its cap in flight, and no place to wait

    def __bool__(self) -> bool:
        return self is Admit.entered


class _Entry(NamedTuple):
    future: asyncio.Future[None]
    since: float
    parallel: int | None  # the key's cap on requests in flight (None: none)


_Tier = dict[str, deque[_Entry]]


class _Queue:
    """One model's waiters, per priority and per key. Each priority's dict order is its
    keys' turn order: the key served goes to the back while it still waits, so keys of
    one priority take turns for freed slots; a key at its cap in flight is passed over and
    keeps its place."""

    def __init__(self) -> None:
        self.tiers: tuple[_Tier, ...] = tuple({} for _ in Priority)
        self.count = 0

    def push(self, key: str, rank: int, entry: _Entry) -> None:
        self.tiers[rank].setdefault(key, deque()).append(entry)
        self.count += 1

    def pop(self, eligible: Callable[[str, int | None], bool]) -> tuple[str, _Entry] | None:
        """The oldest waiter of the first key in turn, highest priority first, that may
        have a slot (None when none may)."""
        for tier in self.tiers:
            while tier:
                key = next((k for k, w in tier.items() if eligible(k, w[0].parallel)), None)
                if key is None:
                    break
                waiters = tier.pop(key)
                entry = waiters.popleft()
                self.count -= 1
                if waiters:
                    tier[key] = waiters  # to the back of the turn order
                if not entry.future.done():
                    return key, entry
        return None

    def remove(self, key: str, entry: _Entry) -> bool:
        for tier in self.tiers:
            waiters = tier.get(key)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                self.count -= 1
                if not waiters:
                    del tier[key]
                return True
        return False

    def of(self, key: str) -> int:
        if not self.count:
            return 0
        return sum(len(tier[key]) for tier in self.tiers if key in tier)

    def oldest(self) -> float | None:
        return min((w[0].since for tier in self.tiers for w in tier.values()), default=None)


class Admission:
    """Per-model concurrency limit with a bounded queue, served by priority and shared
    fairly between API keys; a per-key cap on requests in flight.

    ``enter`` returns at once (false) when the model's queue is full, or when the caller's
    key already holds its share of that queue (``key_queue`` places); otherwise it returns
    (``Admit.entered``) when the caller holds a slot. ``leave`` hands the slot straight to a
    waiter, so a newcomer never overtakes the queue. Waiters are served by ``priority``
    (``high``, then ``normal``, then ``low``: a request of a higher priority gets the next
    freed slot, whatever waits below it); within a priority waiting keys take turns (each
    key's own requests in order), so one key's backlog cannot starve another key of the
    same priority. ``oldest_wait`` says how long the longest waiter has waited: the
    saturation signal for scale-out.

    ``key_parallel`` caps the key's requests in flight through this process (every model
    together; its share of the key's ``max_parallel``): a request over it waits in the
    queue, passed over until one of the key's requests leaves, rather than being refused;
    when it cannot wait (the queue or the key's share of it is full) the refusal says
    ``key_parallel``. A caller that passes ``key_parallel`` passes the key to ``leave``.

    The limit follows capacity: ``resize`` (called whenever a model's ready count changes)
    lets waiters in at once up to a higher limit; under a lower one, slots freed are not
    handed on until the model is under it again. ``limit`` is ``default`` for a model
    never resized.

    Invariant: while a model has fewer than ``limit`` requests in flight, every request
    waiting for it belongs to a key at its cap.
    """

    def __init__(self, default: int = 1) -> None:
        self.default = default
        self.limits: dict[str, int] = {}
        self.active: dict[str, int] = {}
        self.waiting: dict[str, _Queue] = {}
        self.key_active: dict[str, int] = {}  # requests in flight of keys with a cap

    def limit(self, model: str) -> int:
        return self.limits.get(model, self.default)

    def resize(self, model: str, limit: int) -> None:
        """The model's limit is now ``limit``: waiters up to it get their slot at once."""
        self.limits[model] = limit
        self._fill(model)

    def _eligible(self, key: str, parallel: int | None) -> bool:
        return parallel is None or self.key_active.get(key, 0) < parallel

    def _hand(self, key: str, entry: _Entry) -> None:
        """The slot goes straight to the waiter."""
        if entry.parallel is not None:
            self.key_active[key] = self.key_active.get(key, 0) + 1
        entry.future.set_result(None)

    def _fill(self, model: str) -> None:
        waiters = self.waiting.get(model)
        while waiters is not None and waiters.count and self.active.get(model, 0) < self.limit(model):
            found = waiters.pop(self._eligible)
            if found is None:
                break
            self.active[model] = self.active.get(model, 0) + 1
            self._hand(*found)

    async def enter(
        self,
        model: str,
        queue: int,
        key: str = "",
        key_queue: int | None = None,
        *,
        priority: Priority = Priority.normal,
        key_parallel: int | None = None,
    ) -> Admit:
        waiters = self.waiting.get(model)
        if waiters is None:
            waiters = self.waiting[model] = _Queue()
        free = self._eligible(key, key_parallel)
        if free and self.active.get(model, 0) < self.limit(model) and not waiters.of(key):
            self.active[model] = self.active.get(model, 0) + 1
            if key_parallel is not None:
                self.key_active[key] = self.key_active.get(key, 0) + 1
            return Admit.entered
        mine = waiters.of(key)
        if waiters.count >= queue or (key_queue is not None and mine >= key_queue):
            if not free:
                return Admit.key_parallel
            return Admit.queue_full if waiters.count >= queue else Admit.key_queue_full
        entry = _Entry(asyncio.get_running_loop().create_future(), time.monotonic(), key_parallel)
        waiters.push(key, priority.rank, entry)
        try:
            await entry.future
        except asyncio.CancelledError:
            if not waiters.remove(key, entry) and entry.future.done() and not entry.future.cancelled():
                self.leave(model, key)  # the slot was handed to us as we left: pass it on
            raise
        return Admit.entered

    def key_waiting(self, model: str, key: str) -> int:
        waiters = self.waiting.get(model)
        return waiters.of(key) if waiters is not None else 0

    def leave(self, model: str, key: str = "") -> None:
        released = self._release(key)
        waiters = self.waiting.get(model)
        if self.active[model] <= self.limit(model):
            found = waiters.pop(self._eligible) if waiters is not None and waiters.count else None
            if found is not None:
                self._hand(*found)
                if released:
                    self._fill_for(key)
                return
        self.active[model] -= 1
        if released:
            self._fill_for(key)

    def _release(self, key: str) -> bool:
        """One of ``key``'s requests left: true when the key has a cap in flight."""
        count = self.key_active.get(key)
        if count is None:
            return False
        if count <= 1:
            del self.key_active[key]
        else:
            self.key_active[key] = count - 1
        return True

    def _fill_for(self, key: str) -> None:
        """``key`` may have one more in flight: the free slots of models it waits for."""
        for model, waiters in self.waiting.items():
            if waiters.of(key) and self.active.get(model, 0) < self.limit(model):
                self._fill(model)

    def queued(self) -> dict[str, int]:
        return {m: w.count for m, w in self.waiting.items()}

    def oldest_wait(self, model: str, now: float) -> float:
        """Seconds the longest waiter in ``model``'s queue has waited (0 when none waits)."""
        waiters = self.waiting.get(model)
        oldest = waiters.oldest() if waiters is not None else None
        return 0.0 if oldest is None else now - oldest
