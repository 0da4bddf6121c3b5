"""The engines' flag tables and the walk that finds the flags a version does not accept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_cli.core.engine.engine_flags import FlagTable, has_tables, release, table, unknown_flags

VLLM = table("vllm", "0.32.0")
SGLANG = table("sglang", "0.5.23")
assert VLLM is not None and SGLANG is not None


def test_tables_are_found_by_the_release_part_of_a_version() -> None:
    assert table("vllm", "0.32.0+cpu") == VLLM
    assert release("0.32.0+cu128") == "0.32.0"
    assert table("vllm", "0.31.0") is None
    assert table("vllm", "../sglang-0.5.23") is None
    assert table("llama-server", "0.5.0-dev") is None
    assert has_tables("vllm") and has_tables("sglang") and not has_tables("llama-server")


def test_flags_real_vllm_refuses_are_found() -> None:
    argv = ["/m", "--host", "h", "--swap-space", "4", "--disable-log-requests", "--task", "embed"]
    assert unknown_flags(VLLM, argv) == [(3, "--swap-space"), (5, "--disable-log-requests"), (6, "--task")]
    assert unknown_flags(VLLM, ["/m", "--runner", "pooling", "--swap-space=4"]) == [(3, "--swap-space=4")]


def test_vllm_reads_underscores_as_dashes_and_dotted_keys_as_their_flag() -> None:
    argv = ["--max_model_len", "4096", "--compilation-config.mode", "3", "--enforce_eager", "m"]
    assert unknown_flags(VLLM, argv) == []
    assert unknown_flags(VLLM, ["--swap_space", "4", "--nope.key", "1"]) == [
        (0, "--swap_space"),
        (2, "--nope.key"),
    ]
    # SGLang's parser is plain argparse: no such spellings
    assert unknown_flags(SGLANG, ["--model_path", "/m"]) == [(0, "--model_path")]


def test_a_value_that_starts_with_a_dash_is_the_flags_value() -> None:
    assert unknown_flags(VLLM, ["--host", "--swap-space", "--port", "-1"]) == []
    # a list takes its first word whatever it is, then words that are not flags
    assert unknown_flags(VLLM, ["--served-model-name", "-x", "b", "--nope"]) == [(3, "--nope")]
    # an optional flag takes the next word only when it is no flag
    optional = FlagTable("x", "1", {"--o": "optional", "--v": "value"})
    assert unknown_flags(optional, ["--o", "--q", "--o", "w", "--v", "--q"]) == [(1, "--q")]


def test_positional_words_negative_numbers_and_words_after_a_double_dash_are_no_flags() -> None:
    assert unknown_flags(VLLM, ["m", "-", "-5", "-0.5", "--", "--nope"]) == []
    assert unknown_flags(VLLM, ["- a word with spaces"]) == []


def test_a_unique_prefix_of_a_long_flag_is_that_flag_as_argparse_reads_it() -> None:
    # what an operator may write: argparse reads --tp as --tp-size
    assert unknown_flags(SGLANG, ["--tp", "2", "--mem-frac", "0.5"]) == []
    assert unknown_flags(VLLM, ["--max-model", "4096", "--max_model=1"]) == []
    # a prefix of several flags is ambiguous: refused
    assert unknown_flags(VLLM, ["--enable", "x"]) == [(0, "--enable")]


def test_short_aliases_are_flags_too() -> None:
    assert unknown_flags(VLLM, ["-tp", "2", "-pp=2"]) == []
    assert unknown_flags(SGLANG, ["-tp", "2"]) == [(0, "-tp")]


KNOWN = sorted(VLLM.flags.items())
WORD = st.text(min_size=1, max_size=8)
PLAIN = st.from_regex(r"\A[a-z0-9/.]{1,8}\Z")  # never a flag


@st.composite
def accepted(draw: st.DrawFn) -> list[str]:
    """A command line of flags vLLM accepts, each with what it takes (a value may start
    with a dash), between positional words."""
    argv: list[str] = []
    for flag, takes in draw(st.lists(st.sampled_from(KNOWN), max_size=12)):
        argv += draw(st.lists(PLAIN, max_size=1))
        if takes == "switch":
            argv.append(flag)
        elif takes == "value" and draw(st.booleans()):
            argv.append(f"{flag}={draw(WORD)}")
        elif takes == "value":
            argv += [flag, draw(WORD)]
        elif takes == "list":
            argv += [flag, draw(WORD), *draw(st.lists(PLAIN, max_size=2))]
        else:
            argv += [flag, *draw(st.lists(PLAIN, max_size=1))]
    return argv


@settings(deadline=None)  # a shared machine's pauses are no failure of the walk
@given(accepted())
def test_a_command_line_of_accepted_flags_has_no_unknown_flag(argv: list[str]) -> None:
    assert unknown_flags(VLLM, argv) == []


@settings(deadline=None)
@given(accepted(), accepted(), st.from_regex(r"\A--zz-[a-z]{1,8}\Z"))
def test_an_unknown_flag_between_accepted_ones_is_found_where_it_is(
    before: list[str], after: list[str], flag: str
) -> None:
    # after a flag that takes an optional or list value the unknown flag is still a flag
    argv = [*before, flag, *after]
    assert unknown_flags(VLLM, argv) == [(len(before), flag)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_entry_of_a_table_says_what_it_takes(engine: str) -> None:
    found = table(engine, "0.32.0" if engine == "vllm" else "0.5.23")
    assert found is not None and found.flags
    assert set(found.flags.values()) <= {"value", "switch", "optional", "list"}
    assert all(flag.startswith("-") for flag in found.flags)
