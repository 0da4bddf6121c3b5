"""The pure decisions behind model aliases and fallbacks (core/serving/aliases.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_cli.core.serving.aliases import (
    alias_table,
    cycles,
    fallback_order,
    fallback_orders,
    tables,
    usable,
)


@dataclass(frozen=True)
class M:
    name: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = field(default=())


def test_each_alias_names_its_model() -> None:
    table = alias_table([M("qwen", ("gpt-4o-mini", "small")), M("llama", ("gpt-4o",)), M("plain")])
    assert table == {"gpt-4o-mini": "qwen", "small": "qwen", "gpt-4o": "llama"}


def test_a_model_name_or_an_alias_given_before_keeps_its_first_meaning() -> None:
    """The cluster file refuses both; the table stays unambiguous all the same."""
    table = alias_table([M("a", ("b", "x")), M("b", ("x",))])
    assert table == {"x": "a"}


def test_fallbacks_follow_depth_first_each_model_once() -> None:
    graph = {"a": ("b", "c"), "b": ("d", "c"), "d": ("a",)}
    assert fallback_order(graph, "a") == ("b", "d", "c")
    assert fallback_order(graph, "b") == ("d", "a", "c")
    assert fallback_order(graph, "c") == ()


def test_a_cycle_ends_the_order_where_it_closes() -> None:
    assert fallback_order({"a": ("b",), "b": ("a",)}, "a") == ("b",)
    assert fallback_order({"a": ("a", "b")}, "a") == ("b",)


def test_orders_keep_catalog_models_only_and_only_models_that_have_fallbacks() -> None:
    models = [
        M("a", fallbacks=("ghost", "b")),
        M("b", fallbacks=("c",)),
        M("c"),
        M("d", fallbacks=("ghost",)),
    ]
    assert fallback_orders(models) == {"a": ("b", "c"), "b": ("c",)}
    assert tables(models) == ({}, {"a": ("b", "c"), "b": ("c",)})


def test_a_key_skips_the_fallbacks_it_may_not_use_and_tries_the_rest() -> None:
    allowed = {"a", "c"}
    assert usable(("b", "c", "d"), allowed.__contains__) == ("c",)
    assert usable(("b", "d"), allowed.__contains__) == ()
    assert usable(("b", "c"), lambda _name: True) == ("b", "c")


def test_no_cycle_without_one() -> None:
    assert cycles({"a": ("b", "c"), "b": ("c",), "c": ("d",), "e": ("a",)}) == []
    assert cycles({}) == []


def test_a_two_model_cycle() -> None:
    assert cycles({"a": ("b",), "b": ("a",)}) == [("a", "b", "a")]


def test_a_cycle_through_a_longer_chain_and_a_self_loop() -> None:
    graph = {"a": ("x", "b"), "b": ("c",), "c": ("d",), "d": ("b",), "s": ("s",)}
    assert cycles(graph) == [("b", "c", "d", "b"), ("s", "s")]


def test_a_cycle_reached_from_outside_is_found_once() -> None:
    graph = {"e": ("a",), "f": ("a",), "a": ("b",), "b": ("a",)}
    assert cycles(graph) == [("a", "b", "a")]


def test_a_long_chain_needs_no_recursion_and_cycles_are_bounded() -> None:
    n = 50_000  # far past Python's recursion limit
    chain = {f"m{i}": (f"m{i + 1}",) for i in range(n)}
    assert cycles(chain) == []
    chain[f"m{n}"] = ("m0",)
    (found,) = cycles(chain)
    assert found[0] == found[-1] == "m0" and len(found) == n + 2
    assert len(fallback_order(chain, "m0")) == n
    many = {f"m{i}": tuple(f"m{j}" for j in range(i)) for i in range(1, 40)} | {"m0": ("m39",)}
    assert len(cycles(many, limit=5)) == 5
