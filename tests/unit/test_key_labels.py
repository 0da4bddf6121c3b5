"""Which keys the metrics name: every key up to the bound, else the most used ones."""

from __future__ import annotations

from llmgw_cli.core.serving.key_labels import OTHER, key_label, labelled_keys


def test_every_key_is_named_while_they_fit() -> None:
    assert labelled_keys(["a", "b"], [], 2) is None
    assert key_label("a", None) == "a"


def test_beyond_the_bound_the_most_used_are_named_summed_over_rows() -> None:
    usage = [("a", 10), ("b", 7), ("b", 7), ("c", 13), ("gone", 10_000)]
    assert labelled_keys(["a", "b", "c"], usage, 2) == frozenset({"b", "c"})  # b: 14


def test_ties_and_unused_keys_go_by_name() -> None:
    assert labelled_keys(["d", "c", "b", "a"], [], 2) == frozenset({"a", "b"})


def test_a_key_outside_is_other_and_no_key_stays_a_dash() -> None:
    named = frozenset({"a"})
    assert key_label("a", named) == "a"
    assert key_label("z", named) == OTHER
    assert key_label("-", named) == "-"
    assert labelled_keys(["a"], [], 0) == frozenset()
