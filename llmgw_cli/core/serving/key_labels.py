"""Which API keys the metrics name (pure): a bounded ``key`` label.

Every key while there are at most ``limit`` of them (the usual case: each gets its own
series from its first request); beyond that, the ``limit`` keys that used the most tokens
over the store's last days of usage, ties by name, and every other key is ``other``. Each
gateway process computes it from the same store, so all of them name the same keys (a
process that has not re-read the usage yet lags by one refresh).
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"


def labelled_keys(
    names: Iterable[str], usage: Iterable[tuple[str, int]], limit: int
) -> frozenset[str] | None:
    """None when every key of ``names`` may be named; else the ``limit`` named ones.
    ``usage``: (key name, tokens) rows, several per key allowed (days, models)."""
    known = set(names)
    if len(known) <= limit:
        return None
    spent: dict[str, int] = dict.fromkeys(known, 0)
    for name, tokens in usage:
        if name in spent:
            spent[name] += tokens
    ranked = sorted(known, key=lambda name: (-spent[name], name))
    return frozenset(ranked[:limit])


def key_label(name: str, labelled: frozenset[str] | None) -> str:
    """The ``key`` label of a request by ``name`` ("-": no key; it stays "-")."""
    if labelled is None or name == "-" or name in labelled:
        return name
    return OTHER
