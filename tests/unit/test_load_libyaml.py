"""The cluster file is composed by libyaml when it cannot nest deep, by PyYAML's Python
composer otherwise: both must read every file alike (the same spec, or the same problems
at the same places), and a file that could nest deep enough to exhaust libyaml's C stack
never reaches it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw_cli.core.clusterfile import load
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    [
        *(ROOT / "inventories").glob("*.yaml"),
        *(ROOT / "tests/data/good-configs").glob("*.yaml"),
        *(ROOT / "tests/data/bad-configs").glob("*.yaml"),
        ROOT / "tests/data/five-mistakes.yaml",
    ]
)


def outcome(text: str) -> object:
    try:
        return parse_cluster(text).model_dump(mode="json")
    except SpecError as exc:
        return [str(p) for p in exc.problems]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_both_composers_read_a_file_alike(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = path.read_text()
    assert load._shallow(text), "every example is shallow: libyaml reads it"
    with_libyaml = outcome(text)
    monkeypatch.setattr(load, "_shallow", lambda _text: False)
    assert outcome(text) == with_libyaml


def test_libyaml_is_there() -> None:
    assert yaml.__with_libyaml__  # else every file takes the slower path, silently


def test_a_file_that_could_nest_deep_goes_to_the_python_composer() -> None:
    deep = "cluster: {name: x}\nnodes: " + "[" * 100_000 + "]" * 100_000 + "\n"
    assert not load._shallow(deep)
    with pytest.raises(SpecError) as refused:
        parse_cluster(deep)
    assert "nested more than" in str(refused.value.problems[0])
    long_line = "cluster: {name: x}\nnodes: " + "- " * 5_000 + "x\n"
    assert not load._shallow(long_line)
    with pytest.raises(SpecError):
        parse_cluster(long_line)


def test_a_syntax_error_is_said_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "cluster: {name: x\nnodes: []\n"
    with pytest.raises(SpecError) as fast:
        parse_cluster(text)
    monkeypatch.setattr(load, "_shallow", lambda _text: False)
    with pytest.raises(SpecError) as slow:
        parse_cluster(text)
    assert [str(p) for p in fast.value.problems] == [str(p) for p in slow.value.problems]
    assert "YAML syntax error" in str(fast.value.problems[0])
