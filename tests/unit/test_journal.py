"""`llmgw logs` and `llmgw restart`: references, the replicas they name, journal lines
as hostile data."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe import journal
from llmgw_cli.core.planning.plan import grow_plan, running_replicas
from llmgw_cli.errors import UsageError
from tests.unit.facts_factory import node_facts, with_units

ROOT = Path(__file__).resolve().parents[2]
SPEC = parse_cluster((ROOT / "inventories/lab.yaml").read_text())


def test_a_reference_names_a_model_or_one_replica() -> None:
    assert journal.parse_ref(SPEC, "smollm2-135m") == journal.Ref("smollm2-135m", None)
    assert journal.parse_ref(SPEC, "smollm2-135m#3") == journal.Ref("smollm2-135m", 3)
    for bad in ("smollm2-135m#x", "smollm2-135m#", "smollm2-135m#-1", "smollm2-135m#\u00b2", "#0", ""):
        with pytest.raises(UsageError, match="expected MODEL or MODEL#N"):
            journal.parse_ref(SPEC, bad)  # "²" is a digit to str.isdigit, not to int()
    with pytest.raises(UsageError, match="did you mean smollm2-135m"):
        journal.parse_ref(SPEC, "smolm2-135m")


def test_only_running_replicas_are_chosen_and_a_missing_one_names_those_that_run() -> None:
    facts = {n.name: node_facts(n.name, gpus=8) for n in SPEC.nodes}
    for _ in range(2):
        (action,) = grow_plan(SPEC, facts, "llama-3.1-8b-instruct").changes
        facts = with_units(facts, [(w.node, w.name, w.text) for w in action.write])
    running = running_replicas(facts)
    every = journal.chosen(journal.Ref("llama-3.1-8b-instruct", None), running)
    assert [r.replica for r in every] == [0, 1]
    assert [r.replica for r in journal.chosen(journal.Ref("llama-3.1-8b-instruct", 1), running)] == [1]
    with pytest.raises(UsageError, match=r"no replica llama-3.1-8b-instruct#7 runs; running: .*#0, .*#1"):
        journal.chosen(journal.Ref("llama-3.1-8b-instruct", 7), running)
    with pytest.raises(UsageError, match=r"no replica smollm2-135m runs$"):
        journal.chosen(journal.Ref("smollm2-135m", None), running)


def test_since_takes_a_span_or_a_time_and_nothing_else() -> None:
    assert journal.since_value("10m") == "10m ago"
    assert journal.since_value("today") == "today"
    assert journal.since_value("2026-12-01 10:00") == "2026-12-01 10:00"
    assert journal.since_value(None) is None
    with pytest.raises(UsageError):
        journal.since_value("10m; rm -rf /")


def test_the_command_quotes_the_unit_and_reads_the_units_own_and_systemds_lines() -> None:
    command = journal.journal_command("llmgw-m-0.service", since="10m ago", lines=50, follow=True)
    assert command == (
        "journalctl _SYSTEMD_UNIT=llmgw-m-0.service + UNIT=llmgw-m-0.service --no-pager --all -o short-unix "
        "--since '10m ago' -n 50 -f"
    )


def test_a_journal_line_is_labelled_and_its_control_characters_are_shown_not_sent() -> None:
    raw = "1764622800.250000 node01 llama-server[812]: loaded \x1b[31mred\x1b[0m\rhidden\tok\x9b"
    line = journal.parse_line("node01 m#0", raw)
    assert line is not None
    assert line.text == "llama-server[812]: loaded \\x1b[31mred\\x1b[0m\\x0dhidden\tok\\x9b"
    assert line.show().endswith(" node01 m#0 | " + line.text)
    assert "\x1b" not in line.show() and "\r" not in line.show()
    assert journal.parse_line("x", "-- No entries --") is None
    assert journal.parse_line("x", "") is None
    odd = journal.parse_line("x", "no stamp \x07here")
    assert odd is not None and odd.at == 0 and odd.text == "no stamp \\x07here"


def test_lines_of_several_units_are_merged_in_time_order() -> None:
    a = [journal.Line(3.0, "a", "3"), journal.Line(1.0, "a", "1")]
    b = [journal.Line(2.0, "b", "2"), journal.Line(3.0, "b", "3b")]
    assert [x.text for x in journal.merged(a + b)] == ["1", "2", "3", "3b"]
