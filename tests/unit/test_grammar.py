"""Each rule of the JSON Schema against the check of the loader it mirrors.

The corpus (test_schema.py) holds examples; here values are generated around each rule's
edges (ports near 0 and 65535, IPv6 spellings, zones, brackets, durations of every shape)
and put in a cluster file: the loader and the schema must agree on every one.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import json
import random
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from llmgw_cli.core.clusterfile import grammar
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.quantities import parse_duration, parse_size
from llmgw_cli.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs/cluster.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
AGREE = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BASE: dict[str, Any] = {
    "cluster": {"name": "t"},
    "fabrics": {"ib": {"kind": "infiniband"}},
    "nodes": [{"name": "a", "address": "10.0.0.1", "fabric": "ib"}],
    "profiles": {"p": {"engine": "vllm"}},
    "models": [{"name": "m", "source": "org/m", "profile": "p"}],
}


def with_value(path: str, value: Any) -> dict[str, Any]:
    """BASE with ``value`` at ``path`` (dotted; a number is a list index)."""
    data = copy.deepcopy(BASE)
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = data
    for part, after in itertools.pairwise(parts):
        if isinstance(part, str) and part not in node:
            node[part] = [] if isinstance(after, int) else {}
        if isinstance(part, int) and len(node) <= part:
            node.append({} if isinstance(after, str) else [])
        node = node[part]
    last = parts[-1]
    if isinstance(last, int) and len(node) <= last:
        node.append(value)
    else:
        node[last] = value
    return data


def _refused_with(parse: Callable[[str], object], value: str, reason: str) -> bool:
    try:
        parse(value)
    except ValueError as error:
        return reason in str(error)
    return False


def assert_agree(path: str, value: Any) -> None:
    """The file with ``value`` at ``path``, written as YAML: valid for both, or for neither."""
    text = yaml.safe_dump(with_value(path, value), sort_keys=False)
    try:
        parse_cluster(text, "c.yaml")
        loader: list[str] = []
    except SpecError as error:
        loader = [str(p) for p in error.problems]
    schema = [e.message for e in VALIDATOR.iter_errors(yaml.safe_load(text))]
    assert bool(loader) == bool(schema), f"{path}: {value!r}\nloader: {loader}\nschema: {schema}"


# --- the pieces ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (0, 0),
        (0, 9),
        (0, 32),
        (0, 128),
        (0, 255),
        (1, 255),
        (7, 7),
        (10, 99),
        (99, 1000),
        (123, 4567),
        (1, 65535),
        (1024, 65535),
    ],
)
def test_int_range_matches_exactly_the_numbers_from_low_to_high(low: int, high: int) -> None:
    pattern = re.compile(grammar.whole(grammar.int_range(low, high)))
    for n in range(min(100_000, 10 * high + 10)):
        assert bool(pattern.match(str(n))) == (low <= n <= high), n
    assert not pattern.match(f"0{low}") and not pattern.match("")


def _is(kind: type, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


_V6_PARTS = [
    "0",
    "1",
    "ff",
    "abcd",
    "ABCD",
    "12345",
    "g",
    ":",
    "::",
    ".",
    "1.2.3.4",
    "255.0.0.1",
    "01.2.3.4",
    "256.1.1.1",
]


def test_ipv6_is_what_ipaddress_reads() -> None:
    rng = random.Random(7)
    pattern = re.compile(grammar.whole(grammar.IPV6))
    samples = ["".join(rng.choice(_V6_PARTS) for _ in range(rng.randint(0, 12))) for _ in range(10_000)]
    for _ in range(20_000):  # groups around at most one `::`, sometimes an IPv4 tail
        groups = [
            rng.choice(["0", "1", "ff", "abcd", "ABCD", "12345", "g", ""]) for _ in range(rng.randint(0, 9))
        ]
        text = ":".join(groups)
        if rng.random() < 0.5 and ":" in text:
            cut = rng.choice([i for i, c in enumerate(text) if c == ":"])
            text = text[:cut] + "::" + text[cut + 1 :]
        if rng.random() < 0.3:
            text += rng.choice([":", "::", ""]) + rng.choice(
                ["1.2.3.4", "01.2.3.4", "255.255.255.255", "1.2.3"]
            )
        samples.append(text)
    for bits in (2**128 - 1, 0xFFFF << 96, 2**48 - 1, 0, 1):
        address = ipaddress.IPv6Address(rng.getrandbits(128) & bits)
        samples += [str(address), address.exploded, str(address).upper()]
    valid = 0
    for text in samples:
        expected = _is(ipaddress.IPv6Address, text) and "%" not in text
        valid += expected
        assert bool(pattern.match(text)) == expected, text
    assert valid > 1000  # the sample holds plenty of both


def test_networks_are_what_ipaddress_reads_after_a_slash() -> None:
    rng = random.Random(3)
    pattern = re.compile(grammar.whole(grammar.NETWORK))
    addresses = ["10.0.0.0", "10.0.0.1", "::", "fd00::", "1.2.3", "fe80::1%eth0", ""]
    suffixes = [
        "",
        "/",
        "/0",
        "/8",
        "/08",
        "/32",
        "/33",
        "/128",
        "/129",
        "/x",
        "/255.0.0.0",
        "/0.0.255.255",
        "/255.0.255.0",
        "/255.255.255.255",
        "/0.0.0.0",
        "/255.128.0.0",
        "/01.0.0.0",
    ]
    for address in addresses:
        for suffix in suffixes:
            text = address + suffix
            expected = "%" not in text and _is(lambda t: ipaddress.ip_network(t, strict=False), text)
            assert bool(pattern.match(text)) == expected, text
    for _ in range(2000):
        text = f"{rng.randint(0, 255)}.{rng.randint(0, 255)}.0.0/{rng.randint(0, 40)}"
        assert bool(pattern.match(text)) == _is(lambda t: ipaddress.ip_network(t, strict=False), text), text


# --- values in a file, judged by both ------------------------------------------------

_labels = st.from_regex(r"\A[a-z0-9_-]{0,64}\Z").filter(lambda s: len(s) in (0, 1, 2, 62, 63, 64) or s)
host_names = st.builds(
    lambda labels, dot: ".".join(labels) + dot,
    st.lists(_labels, min_size=1, max_size=4) | st.lists(st.just("a" * 63), min_size=4, max_size=5),
    st.sampled_from(["", "."]),
)
zones = st.sampled_from(["", "%eth0", "%2", "%", "%a b", "%a%b", "%en_0.1-x"])
addresses = (
    st.ip_addresses().map(str)
    | st.ip_addresses(v=6).map(lambda a: a.exploded)
    | st.builds(lambda a, z: str(a) + z, st.ip_addresses(v=6), zones)
    | st.builds(lambda a, z: str(a) + z, st.ip_addresses(v=4), zones)
    | st.lists(st.sampled_from(_V6_PARTS), max_size=8).map("".join)
)
hosts = host_names | addresses | st.text(alphabet="az09-_.:%[]@ ", max_size=20)
port_texts = st.integers(-1, 70_000).map(str) | st.sampled_from(["", "x", "007", "0", "065535", "1e3", "٣"])


@AGREE
@given(hosts)
@example("-oProxyCommand=x")
@example("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61)
@example("fe80::1%eth0")
def test_node_address(value: str) -> None:
    assert_agree("nodes.0.address", value)


@AGREE
@given(addresses | host_names)
def test_engine_address(value: str) -> None:
    assert_agree("nodes.0.engine_address", value)


@AGREE
@given(
    st.sampled_from(["", "ops@", "@", "Ops@", "_x$@", "a b@", "u@v@"]),
    hosts | st.builds(lambda a, z: f"[{a}{z}]", st.ip_addresses(v=6), zones) | st.just("[db.example]"),
    st.none() | port_texts,
    st.sampled_from(["", "x"]),
)
def test_jump_host(user: str, host: str, port: str | None, after: str) -> None:
    assert_agree("ssh.jump_host", user + host + ("" if port is None else ":" + port) + after)


@AGREE
@given(
    host_names
    | st.ip_addresses(v=4).map(str)
    | st.builds(lambda a, z: f"[{a}{z}]", st.ip_addresses(v=6), zones)
    | st.sampled_from(["[db.example]", "[::1", "::1", "db_1", ""]),
    st.none() | port_texts,
)
@example("0.0.0.0", "08080")
@example("[::]", "8080")
def test_listener(host: str, port: str | None) -> None:
    assert_agree("gateway.listen", host + ("" if port is None else ":" + port))


@AGREE
@given(
    st.tuples(
        st.sampled_from(["postgresql://", "postgres://", "POSTGRESQL://", "mysql://", "postgresql:/", ""]),
        st.sampled_from(["", "llmgw@", "a:b@", ":@", "a@b@", "@", "u-1.x@"]),
        host_names | st.sampled_from(["[::1]", "[fd00::5]", "[db]", "", "-db", "db_1", "10.0.0.1"]),
        st.sampled_from(["", ":5432", ":0", ":65535", ":65536", ":", ":x", ":05432"]),
        st.sampled_from(["/llmgw", "/", "", "/a/b", "/db/", "/my%20db"]),
        st.sampled_from(["", "?sslmode=require", "?a b", "#frag", "?", "?x=/y"]),
    )
)
def test_store_url(parts: tuple[str, ...]) -> None:
    """scheme, user, host, port, database, options"""
    assert_agree("gateway.store", "".join(parts))


_masks = st.sampled_from(["255.0.0.0", "0.0.255.255", "255.0.255.0", "255.255.255.255", "0.0.0.0"])
networks = (
    st.builds(
        lambda a, n: f"{a}/{n}", st.ip_addresses(), st.integers(-1, 130).map(str) | _masks | st.just("08")
    )
    | addresses
    | st.sampled_from(["localhost", "link-local", "multicast", "Localhost", "gw.example.net"])
    | st.text(alphabet="0123456789./:abcdef%", max_size=20)
)


@AGREE
@given(networks)
def test_firewall_entry(value: str) -> None:
    assert_agree("gateway.engine_clients.0", value)


durations = st.text(alphabet="0123456789.mshd -٣", max_size=12) | st.lists(
    st.builds(
        lambda n, space, unit: n + space + unit,
        st.sampled_from(["0", "1", "10", "1.5", "0.0", ".5", "1.", "007"]),
        st.sampled_from(["", " "]),
        st.sampled_from(["ms", "s", "m", "h", "d", "", "x", "M"]),
    ),
    min_size=1,
    max_size=3,
).map(" ".join)


@AGREE
@given(
    durations,
    st.sampled_from(
        [
            "gateway.load_wait",
            "gateway.client_timeouts.header",
            "ssh.connect_timeout",
            "gateway.discover_every",
        ]
    ),
)
@example("0s", "gateway.client_timeouts.header")
@example("0.001s", "gateway.client_timeouts.body")
@example("0ms", "gateway.health_every")
def test_duration(value: str, path: str) -> None:
    """A total above 365 days is refused by the loader alone (test_schema.py says why)."""
    assume(not _refused_with(parse_duration, value, "longer than a year"))
    assert_agree(path, value)


sizes = st.text(alphabet="0123456789. BKMGTi", max_size=10) | st.builds(
    lambda n, space, unit: n + space + unit,
    st.sampled_from(["0", "1", "80", "1.5", ".5", "007", "1024"]),
    st.sampled_from(["", " ", "  "]),
    st.sampled_from(["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "gb", "PiB", ""]),
)


@AGREE
@given(sizes)
def test_size(value: str) -> None:
    """Above 1024TiB: refused by the loader alone (test_schema.py says why)."""
    assume(not _refused_with(parse_size, value, "larger than 1024TiB"))
    assert_agree("gateway.max_request_size", value)


@AGREE
@given(
    st.text(alphabet="mlx5_0:19x- ", max_size=10)
    | st.builds(lambda n, p: f"mlx5_{n}:{p}", st.integers(0, 9), port_texts)
)
def test_hca_shorthand(value: str) -> None:
    assert_agree("nodes.0.hcas.0", value)


@AGREE
@given(
    st.text(alphabet="0123456789- x", max_size=12)
    | st.builds(
        lambda a, b, sa, sb: f"{sa}{a}{sb}-{sb}{b}{sa}",
        st.integers(0, 70_000) | st.sampled_from([1023, 1024, 65535, 65536]),
        st.integers(0, 70_000) | st.sampled_from([1023, 1024, 65535, 65536]),
        st.sampled_from(["", " ", "0"]),
        st.sampled_from(["", " "]),
    )
)
def test_port_range_shorthand(value: str) -> None:
    """Ports out of order are refused by the loader alone (test_schema.py says why):
    the generated ranges are put in order first."""
    match = re.fullmatch(r"( *0?)([0-9]+)( *- *)([0-9]+)(.*)", value)
    if match and int(match[2]) > int(match[4]):
        value = f"{match[1]}{match[4]}{match[3]}{match[2]}{match[5]}"
    assert_agree("profiles.p.ports", value)


@AGREE
@given(st.text(alphabet="/ab.", max_size=6))
def test_weights_shorthand(value: str) -> None:
    assert_agree("nodes.0.weights.0", value)


@AGREE
@given(
    st.text(alphabet="htps:/.ab-_0", max_size=14)
    | st.builds(
        lambda a, b: a + b,
        st.sampled_from(["https://", "http://", "/", "./", "../", "org/", "-org/", ""]),
        st.sampled_from(["m", "m.gguf", "", "a/b", "-x"]),
    )
    | st.builds(  # revisions: org/name@ref
        lambda repo, at, ref: repo + at + ref,
        st.sampled_from(["o/m", "o/m.git", "o--x/m", "o/_m_", "o/m."]),
        st.sampled_from(["@", ""]),
        st.text(alphabet="ab.-_/@k", max_size=8)
        | st.sampled_from(["a" * 40, "v1.lock", "refs/pr/1", "x" * 256, "a//b", "a..b", "main"]),
    )
)
def test_model_source(value: str) -> None:
    assert_agree("models.0.source", value)


users = st.text(alphabet="rotA_-$ 1", max_size=6) | st.sampled_from(
    ["root", "llmgw", "a" * 32, "a" * 33, "x$"]
)


@AGREE
@given(users, st.sampled_from(["ssh.user", "profiles.p.user", "nodes.0.ssh.user"]))
def test_user_names(value: str, path: str) -> None:
    assert_agree(path, value)


@AGREE
@given(st.none() | st.lists(st.text(alphabet="+-@:!/a ", max_size=4), max_size=3))
def test_profile_command(value: list[str] | None) -> None:
    assert_agree("profiles.p.command", value)


@AGREE
@given(
    st.dictionaries(
        st.text(alphabet="AB_1 -$", max_size=4) | st.integers(0, 3) | st.booleans(), st.just("v"), max_size=2
    )
)
def test_environment_names(value: dict[Any, str]) -> None:
    assert_agree("profiles.p.env", value)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 100_000)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, 1.0, 2.0, 0.5, 8.0, 64.0, 1e300])
    | st.text(alphabet="0123456789.yesnotrue-", max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text("ab", max_size=2), inner, max_size=2),
    max_leaves=3,
)


@AGREE
@given(
    json_values,
    st.sampled_from(
        [
            "ssh.port",
            "ssh.max_parallel",
            "ssh.accept_unknown_hosts",
            "gateway.install",
            "gateway.workers",
            "gateway.key_queue_share",
            "gateway.model_queue",
            "gateway.hosts",
            "nodes.0.gpus",
            "nodes.0.labels",
            "nodes.0.connection",
            "models.0.tensor_parallel",
            "models.0.nodes",
            "models.0.scaling",
            "models.0.args",
            "profiles.p.engine",
            "profiles.p.ports",
            "cluster.name",
        ]
    ),
)
@example(8.0, "models.0.tensor_parallel")
@example("8", "models.0.tensor_parallel")
@example(True, "models.0.nodes")
def test_values_of_every_type_at_typed_keys(value: Any, path: str) -> None:
    """Strict types: a quoted number is no count and a quoted `yes` no boolean, for both."""
    assert_agree(path, value)


@AGREE
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=6))
@example("a\nb")
@example("\u2028")
@example("\x85")
def test_any_text_in_an_argument_or_a_label_key(value: str) -> None:
    assert_agree("models.0.args.0", value)
    assert_agree("nodes.0.labels", {value: "v"})


# --- the same patterns in an editor's regex engine ----------------------------------


def _patterns(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["pattern"]} if isinstance(node.get("pattern"), str) else set()
        return found.union(*(_patterns(v) for k, v in node.items() if k not in ("default", "examples")))
    if isinstance(node, list):
        return set().union(*(_patterns(v) for v in node))
    return set()


def _samples() -> list[str]:
    """Every string written in the inventories and the corpus, and a few more at the edges."""
    found: set[str] = {
        "",
        " ",
        "a",
        "٣s",
        "1h 30m",
        "fe80::1%eth0",
        "[::1]:8080",
        "root",
        "mlx5_0:255",
        "\ufeff",
    }

    def strings(value: Any) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                strings(k)
                strings(v)
        elif isinstance(value, list):
            for v in value:
                strings(v)

    for path in [*(ROOT / "inventories").glob("*.yaml"), *(ROOT / "tests/data").glob("*-configs/**/*.yaml")]:
        try:
            strings(yaml.safe_load(path.read_text()))
        except yaml.YAMLError:
            continue
    return sorted(found)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_patterns_mean_the_same_to_javascript() -> None:
    """Editors run the schema's patterns as ECMA-262 regexes (`u` flag): each compiles and
    matches the same strings as Python's `re`, which the tests above use. Left out: U+FEFF
    (a blank to JavaScript's \\s, not to Python's) and control characters (Python's `$`
    also matches before a final newline; the schema refuses every control character
    separately)."""
    patterns = sorted(_patterns(SCHEMA))
    samples = [s for s in _samples() if "\ufeff" not in s and not re.search(grammar.CONTROL_CHARACTERS, s)]
    script = (
        "const {patterns, samples} = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "console.log(JSON.stringify(patterns.map(p => { const r = new RegExp(p, 'u');"
        " return samples.map(s => r.test(s)); })));"
    )
    result = subprocess.run(
        ["node", "-e", script],
        input=json.dumps({"patterns": patterns, "samples": samples}),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    javascript = json.loads(result.stdout)
    for pattern, matches in zip(patterns, javascript, strict=True):
        python = [re.search(pattern, s) is not None for s in samples]
        differ = [s for s, a, b in zip(samples, python, matches, strict=True) if a != b]
        assert not differ, (pattern, differ[:5])
    assert len(patterns) > 20 and len(samples) > 200
