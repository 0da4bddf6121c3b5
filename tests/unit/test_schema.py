"""The JSON Schema (docs/cluster.schema.json) accepts what the loader accepts, as written.

Editors check a cluster file against the committed schema while a person writes it, so
it is tested on files as a person writes them (``yaml.safe_load`` of the text, shorthands
and all), never on the spec they become: the example inventories, every YAML example in
the documentation, and a corpus of good and bad files that the loader and the schema
must judge alike.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster, where
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.errors import Problem, SpecError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data"
SCHEMA = json.loads((ROOT / "docs/cluster.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
GOOD = sorted((DATA / "good-configs").glob("*.yaml"))
BAD = sorted((DATA / "bad-configs").glob("*.yaml"))
LOADER_ONLY = sorted((DATA / "bad-configs/loader-only").glob("*.yaml"))
TOP_LEVEL_KEYS = {info.alias or name for name, info in ClusterSpec.model_fields.items()}


def schema_errors(data: Any) -> list[jsonschema.ValidationError]:
    return list(VALIDATOR.iter_errors(data))


def loader_problems(text: str, name: str) -> list[Problem]:
    try:
        parse_cluster(text, name)
    except SpecError as error:
        return list(error.problems)
    return []


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    """Its patterns included: the metaschema checks that each one compiles."""
    jsonschema.Draft202012Validator.check_schema(SCHEMA, format_checker=jsonschema.FormatChecker())


# --- the example inventories and the documentation ----------------------------------


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.name)
def test_every_inventory_validates_as_written(path: Path) -> None:
    """The file as a person wrote it: `ports: 8100-8199`, `hcas: [mlx5_0:1]`, `5m`..."""
    errors = schema_errors(yaml.safe_load(path.read_text()))
    assert not errors, [f"{where(tuple(e.absolute_path))}: {e.message}" for e in errors]


# An HTML comment right before a fence marks YAML that is no cluster file at all.
NOT_A_CLUSTER_FILE = "<!-- not a cluster file -->"
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def yaml_examples() -> list[tuple[str, str, str]]:
    """(file:line, the text before the fence, the block) for every ```yaml block of the docs."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if match["lang"].lower() in ("yaml", "yml"):
                line = text.count("\n", 0, match.start()) + 1
                before = text[: match.start()].rstrip().rsplit("\n", 1)[-1].strip()
                found.append((f"{path.name}:{line}", before, textwrap.dedent(match["body"])))
    return found


EXAMPLES = yaml_examples()


def test_the_documentation_has_yaml_examples_to_check() -> None:
    """The fence pattern finds them (configuration.md shows a whole inventory, operations.md
    a fragment), so the test below cannot pass by checking nothing."""
    places = {place.split(":")[0] for place, _, _ in EXAMPLES}
    assert {"configuration.md", "operations.md"} <= places


@pytest.mark.parametrize(("place", "before", "block"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_yaml_example_of_the_docs_is_a_valid_cluster_file_or_fragment(
    place: str, before: str, block: str
) -> None:
    """Each ```yaml block of README.md and docs/ is one of:

    - a cluster file (it has `cluster:`): valid for the schema and the loader as written;
    - a fragment of one: its top-level keys are cluster-file keys (`gateway:`, `models:`...)
      and `cluster:` is left out; valid for the schema once `cluster: {name: example}` is
      added (the loader would also check references to sections the fragment leaves out);
    - marked ``<!-- not a cluster file -->`` on the line before the fence: not checked.

    Anything else fails, so an example that is neither can never go unchecked.
    """
    if before == NOT_A_CLUSTER_FILE:
        return
    data = yaml.safe_load(block)
    assert isinstance(data, dict) and set(data) <= TOP_LEVEL_KEYS, (
        f"{place}: a ```yaml block whose top-level keys are not cluster-file keys "
        f"({', '.join(sorted(TOP_LEVEL_KEYS))}); if it is no cluster file, put "
        f"{NOT_A_CLUSTER_FILE} on the line before the fence"
    )
    if "cluster" in data:
        assert not loader_problems(block, place)
    else:
        data = {"cluster": {"name": "example"}, **data}
    errors = schema_errors(data)
    assert not errors, [f"{place}: {where(tuple(e.absolute_path))}: {e.message}" for e in errors]


# --- the corpus: what both accept, what both refuse ---------------------------------


def expected(path: Path) -> list[str]:
    """The `# loader: ...` lines of a corpus file: a part of each problem the loader reports."""
    return [
        line.removeprefix("# loader: ")
        for line in path.read_text().splitlines()
        if line.startswith("# loader: ")
    ]


def related(a: str, b: str) -> bool:
    """One location is the other or inside it (`models[0]` and `models[0].scaling.min`)."""
    short, long = sorted((a, b), key=len)
    return long == short or not short or long.startswith((short + ".", short + "["))


def test_the_corpus_is_large_enough() -> None:
    assert len(BAD) >= 25 and len(GOOD) >= 5 and LOADER_ONLY


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_configs_are_accepted_by_the_loader_and_the_schema(path: Path) -> None:
    text = path.read_text()
    assert loader_problems(text, path.name) == []
    errors = schema_errors(yaml.safe_load(text))
    assert not errors, [f"{where(tuple(e.absolute_path))}: {e.message}" for e in errors]


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_configs_are_refused_by_the_loader_and_the_schema_at_the_same_place(path: Path) -> None:
    """Each file holds one mistake (its first line says which; its `# loader:` lines, a
    part of each problem the loader reports for it). The schema refuses it too, and
    every schema error lies where the loader's problem does (or around it)."""
    text = path.read_text()
    problems = loader_problems(text, path.name)
    hints = expected(path)
    assert hints, f"{path.name}: say what the loader reports in a `# loader: ...` line"
    assert len(problems) == len(hints), [str(p) for p in problems]
    for hint in hints:
        assert any(hint in p.message for p in problems), (hint, [str(p) for p in problems])
    errors = schema_errors(yaml.safe_load(text))
    assert errors, f"{path.name}: the loader refuses it, the schema accepts it"
    for error in errors:
        at = where(tuple(error.absolute_path))
        assert any(related(at, p.where) for p in problems), (at, error.message, [str(p) for p in problems])


@pytest.mark.parametrize("path", LOADER_ONLY, ids=lambda p: p.name)
def test_what_only_the_loader_can_refuse(path: Path) -> None:
    """Files the loader refuses and the schema accepts, because JSON Schema cannot say so:

    - order between two values (`ports: 8199-8100`, `scaling: {min: 1, max: 0}`) and
      agreement between two keys (`gateway.host` is the first of `gateway.hosts`): a
      schema constrains each value alone and compares none with another;
    - references between sections (a model's profile must exist), uniqueness of one key
      across the items of a list (node names) and what no node could run: checked on the
      whole file by the loader only (core/clusterfile/refs.py);
    - files of two models landing on one path of a node (two URLs of one file name, a URL
      over a `./` source, one repository revision fetched with two selections): a
      comparison across the items of a list, by the loader only (core/clusterfile/refs.py);
    - the total of a duration (at most 365 days, summed over `300d 100d`) and a size's
      bytes (at most 1024TiB, whatever the unit): a pattern cannot do arithmetic;
    - a key written twice: a YAML reader keeps the later one, so the schema never sees it.

    When the schema learns to refuse one of them, this test says so: move that file up
    into bad-configs/.
    """
    text = path.read_text()
    problems = loader_problems(text, path.name)
    hints = expected(path)
    assert len(problems) == len(hints) >= 1, [str(p) for p in problems]
    for hint in hints:
        assert any(hint in p.message for p in problems), (hint, [str(p) for p in problems])
    assert schema_errors(yaml.safe_load(text)) == [], (
        f"the schema refuses {path.name} now: move it to bad-configs/"
    )
