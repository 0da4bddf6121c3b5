"""Admission by priority, and each key's cap on its requests in flight (the queue's
fairness between keys and its limits are in test_store.py)."""

from __future__ import annotations

import asyncio
import random

from llmgw_cli.core.serving.limits import Priority
from llmgw_cli.gateway.serving.admission import Admission, Admit


async def settled() -> None:
    """Let every task that can run, run (a handed slot resumes its waiter)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_high_priority_waiter_gets_the_next_freed_slot_over_a_low_flood() -> None:
    async def scenario() -> None:
        gate = Admission()
        served: list[str] = []

        async def request(name: str, key: str, priority: Priority) -> None:
            assert await gate.enter("m", 100, key, priority=priority)
            served.append(name)
            await asyncio.sleep(0)
            gate.leave("m")

        assert await gate.enter("m", 100, "first")
        tasks = [asyncio.create_task(request(f"low-{i}", f"bulk-{i % 3}", Priority.low)) for i in range(20)]
        await settled()
        tasks.append(asyncio.create_task(request("normal", "n", Priority.normal)))
        tasks.append(asyncio.create_task(request("high", "h", Priority.high)))
        await settled()
        assert gate.queued() == {"m": 22}
        gate.leave("m")  # the next freed slot: the high one's, then the normal one's
        await asyncio.gather(*tasks)
        assert served[:2] == ["high", "normal"] and len(served) == 22
        # The low ones, their keys taking turns.
        assert served[2:5] == ["low-0", "low-1", "low-2"]
        assert gate.active["m"] == 0

    asyncio.run(scenario())


def test_two_keys_of_one_priority_alternate_below_a_higher_one() -> None:
    async def scenario() -> None:
        gate = Admission()
        served: list[str] = []

        async def request(name: str, key: str, priority: Priority) -> None:
            assert await gate.enter("m", 100, key, priority=priority)
            served.append(name)
            await asyncio.sleep(0)
            gate.leave("m")

        assert await gate.enter("m", 100, "x")
        tasks = []
        for name, key, priority in [
            ("a1", "a", Priority.low),
            ("a2", "a", Priority.low),
            ("a3", "a", Priority.low),
            ("b1", "b", Priority.low),
            ("b2", "b", Priority.low),
            ("h1", "h", Priority.high),
            ("h2", "h", Priority.high),
        ]:
            tasks.append(asyncio.create_task(request(name, key, priority)))
            await asyncio.sleep(0)
        gate.leave("m")
        await asyncio.gather(*tasks)
        assert served == ["h1", "h2", "a1", "b1", "a2", "b2", "a3"]

    asyncio.run(scenario())


def test_a_key_at_its_parallel_cap_waits_and_others_pass_it() -> None:
    async def scenario() -> None:
        gate = Admission(default=10)
        assert await gate.enter("m", 10, "capped", key_parallel=2)
        assert await gate.enter("m", 10, "capped", key_parallel=2)
        third = asyncio.create_task(gate.enter("m", 10, "capped", key_parallel=2))
        await settled()
        assert not third.done() and gate.queued() == {"m": 1}  # waits, though slots are free
        assert await gate.enter("m", 10, "other")  # another key is not held up by it
        assert gate.active["m"] == 3 and gate.key_active == {"capped": 2}
        gate.leave("m", "other")
        await settled()
        assert not third.done()
        gate.leave("m", "capped")  # one of its own leaves: its waiter goes in
        await settled()
        assert third.result() is Admit.entered and gate.key_active == {"capped": 2}
        assert gate.active["m"] == 2 and gate.queued() == {"m": 0}
        gate.leave("m", "capped")
        gate.leave("m", "capped")
        assert gate.active["m"] == 0 and gate.key_active == {}

    asyncio.run(scenario())


def test_the_parallel_cap_counts_every_model_of_the_key() -> None:
    """A request that leaves one model lets the key's waiter for another one in."""

    async def scenario() -> None:
        gate = Admission(default=4)
        assert await gate.enter("a", 10, "k", key_parallel=1)
        waiting = asyncio.create_task(gate.enter("b", 10, "k", key_parallel=1))
        await settled()
        assert not waiting.done() and gate.active.get("b", 0) == 0
        gate.leave("a", "k")
        await settled()
        assert waiting.result() and gate.active == {"a": 0, "b": 1} and gate.key_active == {"k": 1}

    asyncio.run(scenario())


def test_a_capped_key_behind_its_slot_does_not_block_the_slot_for_others() -> None:
    """The model's one slot is freed while the next waiter's key is at its cap: the slot
    goes to the next key that may use it."""

    async def scenario() -> None:
        gate = Admission(default=1)
        assert await gate.enter("a", 10, "k", key_parallel=1)  # k's one request in flight
        assert await gate.enter("m", 10, "x")
        capped = asyncio.create_task(gate.enter("m", 10, "k", key_parallel=1, priority=Priority.high))
        free = asyncio.create_task(gate.enter("m", 10, "y"))
        await settled()
        gate.leave("m", "x")
        await settled()
        assert free.done() and not capped.done()
        gate.leave("a", "k")  # k may have one more, but m's slot is y's now
        await settled()
        assert not capped.done()
        gate.leave("m", "y")  # the slot goes to the high-priority waiter of k
        await settled()
        assert capped.done() and gate.key_active == {"k": 1}

    asyncio.run(scenario())


def test_refusals_say_why() -> None:
    async def scenario() -> None:
        gate = Admission(default=1)
        assert await gate.enter("m", 3, "a", key_queue=2, key_parallel=5)
        waiters = [
            asyncio.create_task(gate.enter("m", 3, "a", key_queue=2, key_parallel=5)) for _ in range(2)
        ]
        await settled()
        assert await gate.enter("m", 3, "a", key_queue=2, key_parallel=5) is Admit.key_queue_full
        waiters.append(asyncio.create_task(gate.enter("m", 3, "b", key_queue=2)))
        await settled()
        assert await gate.enter("m", 3, "c", key_queue=2) is Admit.queue_full
        # At its cap in flight with nowhere to wait: its own cap is the reason.
        assert await gate.enter("n", 0, "one", key_parallel=1) is Admit.entered
        assert await gate.enter("n2", 0, "one", key_parallel=1) is Admit.key_parallel
        assert await gate.enter("n2", 0, "two", key_parallel=1) is Admit.entered
        assert not Admit.key_parallel and not Admit.queue_full and Admit.entered
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(scenario())


def test_a_cancelled_waiter_of_a_capped_key_leaves_no_count_behind() -> None:
    async def scenario() -> None:
        gate = Admission(default=1)
        assert await gate.enter("m", 5, "k", key_parallel=2)
        waiting = asyncio.create_task(gate.enter("m", 5, "k", key_parallel=2))
        await settled()
        gate.leave("m", "k")  # the slot is handed to the waiter...
        waiting.cancel()  # ...which is cancelled before it runs: it passes the slot on
        await asyncio.gather(waiting, return_exceptions=True)
        assert gate.active["m"] == 0 and gate.key_active == {}

    asyncio.run(scenario())


CAPS = {"a": 1, "b": 2, "c": None, "d": None}
PRIORITIES = {"a": Priority.high, "b": Priority.low, "c": Priority.normal, "d": Priority.low}
MODELS = ("m", "n")


class Traffic:
    """Requests that hold their slot until told to leave, counting themselves inside."""

    def __init__(self, gate: Admission) -> None:
        self.gate = gate
        self.inside: dict[str, int] = {}  # requests holding a slot, by model and by key
        self.holding: list[tuple[asyncio.Task[Admit], asyncio.Event]] = []
        self.every: list[asyncio.Task[Admit]] = []
        self.allowed = dict.fromkeys(MODELS, gate.default)  # the limit, or more when lowered

    def start(self, model: str, key: str) -> None:
        done = asyncio.Event()
        self.every.append(asyncio.create_task(self.request(model, key, done)))
        self.holding.append((self.every[-1], done))

    async def request(self, model: str, key: str, done: asyncio.Event) -> Admit:
        admitted = await self.gate.enter(model, 6, key, 4, priority=PRIORITIES[key], key_parallel=CAPS[key])
        if admitted:
            self.count(model, key, 1)
            try:
                await done.wait()
            finally:
                self.count(model, key, -1)
                self.gate.leave(model, key)
        return admitted

    def count(self, model: str, key: str, n: int) -> None:
        self.inside[model] = self.inside.get(model, 0) + n
        self.inside[key] = self.inside.get(key, 0) + n

    def check(self) -> None:
        gate = self.gate
        for model in MODELS:
            in_flight = self.inside.get(model, 0)
            assert in_flight == gate.active.get(model, 0) <= self.allowed[model]
            self.allowed[model] = max(gate.limit(model), in_flight)  # over the limit: never grows
            if in_flight < gate.limit(model):  # a free slot: nobody waits who could take it
                for key, cap in CAPS.items():
                    if gate.key_waiting(model, key):
                        assert cap is not None and self.inside.get(key, 0) >= cap
        for key, cap in CAPS.items():
            if cap is not None:
                assert self.inside.get(key, 0) == gate.key_active.get(key, 0) <= cap


async def quiet() -> None:
    """Long enough for a chain of hand-overs (each waiter may leave as soon as it enters)."""
    for _ in range(100):
        await asyncio.sleep(0)


def test_random_traffic_keeps_every_count_and_the_invariant() -> None:
    """Requests of keys with and without caps and of every priority enter, leave, are
    cancelled while waiting, and the limits change, in a seeded random order: no model
    holds more than its limit (nor more than it held when the limit was lowered), no key
    more than its cap, a model with a free slot has no waiter that could take it, and
    everything ends at zero."""

    async def scenario(seed: int) -> None:
        rng = random.Random(seed)
        gate = Admission(default=2)
        traffic = Traffic(gate)
        for _ in range(400):
            action = rng.random()
            if action < 0.5:
                traffic.start(rng.choice(MODELS), rng.choice(list(CAPS)))
            elif action < 0.85 and traffic.holding:
                task, done = traffic.holding.pop(rng.randrange(len(traffic.holding)))
                if rng.random() < 0.3:
                    task.cancel()
                done.set()
            elif action < 0.9:
                model = rng.choice(MODELS)
                gate.resize(model, rng.randint(1, 4))
                traffic.allowed[model] = max(gate.limit(model), traffic.inside.get(model, 0))
            await quiet()
            traffic.check()
        for _, done in traffic.holding:
            done.set()
        await asyncio.gather(*traffic.every, return_exceptions=True)
        assert all(v == 0 for v in gate.active.values()) and gate.key_active == {}
        assert all(v == 0 for v in gate.queued().values())

    for seed in range(10):
        asyncio.run(scenario(seed))
