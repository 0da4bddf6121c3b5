"""Model aliases and fallbacks as decisions on names (pure: no I/O, no clock).

A catalog model may have *aliases*, more names clients may send in ``model``: a request
for one is served by that model (under its name, which the engine checks) and metered
under it. It may have *fallbacks*, catalog models tried in order when it cannot answer.
A fallback's own fallbacks follow it, depth first (``a: [b, c]``, ``b: [d]``: a, then
b, d, c), each model at most once; the cluster file refuses a cycle (``cycles``), and
the order here stops at a model already in it all the same.

The gateway builds ``alias_table`` and ``fallback_orders`` once per cluster file it
loads; on a request it looks the name up once, and works out the fallbacks a key may use
(``usable``) only when the model it asked for failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol


class Named(Protocol):
    """A catalog model as these decisions see it (``clusterfile.spec.Model`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def aliases(self) -> Sequence[str]: ...

    @property
    def fallbacks(self) -> Sequence[str]: ...


def alias_table(models: Iterable[Named]) -> dict[str, str]:
    """Each alias -> the name of its model. A name that is a model's own name, or an alias
    given before, keeps its first meaning (the cluster file refuses both)."""
    models = list(models)
    names = {m.name for m in models}
    table: dict[str, str] = {}
    for model in models:
        for alias in model.aliases:
            if alias not in names:
                table.setdefault(alias, model.name)
    return table


def fallback_graph(models: Iterable[Named]) -> dict[str, tuple[str, ...]]:
    """Each model with fallbacks -> its fallbacks as written."""
    return {m.name: tuple(m.fallbacks) for m in models if m.fallbacks}


def fallback_order(graph: Mapping[str, Sequence[str]], model: str) -> tuple[str, ...]:
    """The models tried after ``model``, in order: its fallbacks, each followed by its own
    (depth first), every model once and never ``model`` itself. Names that are not
    catalog models are the caller's to filter; a cycle ends where it closes."""
    order: list[str] = []
    seen = {model}
    stack = list(reversed(graph.get(model, ())))
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        order.append(name)
        stack.extend(reversed(graph.get(name, ())))
    return tuple(order)


def fallback_orders(models: Iterable[Named]) -> dict[str, tuple[str, ...]]:
    """Each model that has fallbacks -> ``fallback_order`` of it, over catalog models only."""
    models = list(models)
    names = {m.name for m in models}
    graph = fallback_graph(models)
    orders = {name: tuple(f for f in fallback_order(graph, name) if f in names) for name in graph}
    return {name: order for name, order in orders.items() if order}


def usable(order: Sequence[str], allows: Callable[[str], bool]) -> tuple[str, ...]:
    """The models of ``order`` a key may use (``ApiKey.allows``), in order: a fallback the
    key may not use is skipped, and those after it are still tried."""
    return tuple(name for name in order if allows(name))


def cycles(graph: Mapping[str, Sequence[str]], limit: int = 20) -> list[tuple[str, ...]]:
    """The cycles of fallbacks, as the path that closes each (``("a", "b", "a")``), the
    first ``limit`` of them.

    A depth-first walk (without recursion: a hostile file may chain a hundred thousand
    models) reports each edge that leads back to a model on the current path. Names that
    are not keys of ``graph`` (models without fallbacks, unknown names) end a path."""
    done: set[str] = set()
    found: list[tuple[str, ...]] = []
    for start in graph:
        if start in done:
            continue
        path = [start]
        on_path = {start: 0}  # name -> its place in path
        todo = [iter(graph[start])]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                name = path.pop()
                del on_path[name]
                done.add(name)
                continue
            at = on_path.get(nxt)
            if at is not None:
                found.append((*path[at:], nxt))
                if len(found) >= limit:
                    return found
            elif nxt not in done and nxt in graph:
                on_path[nxt] = len(path)
                path.append(nxt)
                todo.append(iter(graph[nxt]))
    return found


def tables(models: Iterable[Named]) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """What the gateway keeps of a catalog, made once per load: ``alias_table`` and
    ``fallback_orders``."""
    models = list(models)
    return alias_table(models), fallback_orders(models)
