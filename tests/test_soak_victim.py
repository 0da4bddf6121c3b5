"""The soak's choice of a replica to kill (tests/integration/soak.py): the count of
streams surely in their middle on each replica never exceeds the true count, whatever
the replicas the streams run on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.integration.soak import surely_in_middle

LATE = 32
REPLICAS = ["10.0.0.1:8400", "10.0.0.2:8400", "10.0.0.3:8400"]


@given(
    streams=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50)), max_size=12),
    replicas=st.integers(2, 3),
)
def test_the_count_is_never_above_the_truth(streams: list[tuple[int, int]], replicas: int) -> None:
    names = REPLICAS[:replicas]
    placed = [(names[i % replicas], chunks) for i, chunks in streams]
    held = {name: sum(1 for at, _ in placed if at == name) for name in names}
    truth = {name: sum(1 for at, n in placed if at == name and 2 <= n <= LATE) for name in names}
    found = surely_in_middle(held, [n for _, n in placed], LATE)
    assert all(0 <= found[name] <= truth[name] for name in names), (found, truth)


def test_streams_not_begun_or_near_their_end_are_not_counted() -> None:
    a, b = REPLICAS[:2]
    # a: three in the middle, one not begun, one near its end; b: one in the middle
    held = {a: 5, b: 1}
    chunks = [5, 10, 20, 0, 40, 12]
    assert surely_in_middle(held, chunks, LATE) == {a: 3, b: 0}
    # every stream in its middle: each replica's own count
    assert surely_in_middle({a: 3, b: 2}, [5, 6, 7, 8, 9], LATE) == {a: 3, b: 2}
    # nothing in the middle: nothing to aim at
    assert surely_in_middle({a: 2, b: 2}, [0, 1, 33, 48], LATE) == {a: 0, b: 0}
