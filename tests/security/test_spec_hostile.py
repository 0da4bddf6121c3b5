"""Attacks through the cluster file: values that would become new unit directives, shell
words or crashes of the loader. Every answer is a ClusterSpec or a located SpecError."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engine_access import key_flags
from llmgw_cli.core.engine.engines import Member, engine_args, replica_unit
from llmgw_cli.errors import SpecError
from tests.integration.test_replica_units_verify import assert_verifies, scratch_root
from tests.rendered_units import pinned
from tests.security.hostile_values import HOSTILE_ARGS, exec_argv, unit_keys, yaml_quoted

ROOT = Path(__file__).resolve().parents[2]

# Line 1..8 of every document below; the hostile value is always on line 9.
BASE = """\
cluster: {name: t}
fabrics:
  ib: {kind: infiniband}
nodes:
  - {name: n1, address: 10.0.0.1, fabric: ib, gpus: {class: H100, count: 8}}
profiles:
  p: {engine: vllm}
models:
"""
MODEL = "  - {name: m, source: org/m, profile: p, "


def problems(text: str | bytes) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_cluster(text, "c.yaml")
    return [str(p) for p in info.value.problems]


def strings_of(value: Any) -> list[str]:
    """Every string in a dumped spec, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings_of(k), *strings_of(v))]
    if isinstance(value, list):
        return [s for item in value for s in strings_of(item)]
    return []


CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")

# (YAML escape, what the message calls it)
CHARACTERS = [
    ("\\n", "a newline (U+000A)"),
    ("\\r", "a carriage return (U+000D)"),
    ("\\0", "a NUL byte (U+0000)"),
    ("\\t", "a tab (U+0009)"),
    ("\\e", "a control character (U+001B)"),
    ("\\x7f", "a control character (U+007F)"),
    ("\\N", "a control character (U+0085)"),
    ("\\L", "a control character (U+2028)"),
]

# (a line with X where the hostile string goes, in the only double-quoted value; where)
PLACES = [
    (MODEL + 'args: [--a, "--x=aXb"]}', "models[0].args[1]"),
    (MODEL + 'env: {A: "aXb"}}', "models[0].env.A"),
    (MODEL + 'gpu_class: "aXb"}', "models[0].gpu_class"),
    ('  - {name: m, source: "/w/aXb", profile: p}', "models[0].source"),
    ('  - {name: "aXb", source: org/m, profile: p}', "models[0].name"),
]
PROFILE_PLACES = [
    ('  q: {engine: vllm, args: ["aXb"]}', "profiles.q.args[0]"),
    ('  q: {engine: vllm, command: [/bin/vllm, "aXb"]}', "profiles.q.command[1]"),
    ('  q: {engine: vllm, env: {A: "aXb"}}', "profiles.q.env.A"),
    ('  q: {engine: vllm, user: "aXb"}', "profiles.q.user"),
    ('  q: {engine: vllm, readiness: {path: "/aXb"}}', "profiles.q.readiness.path"),
]


@pytest.mark.parametrize(("escape", "name"), CHARACTERS, ids=[c[1] for c in CHARACTERS])
@pytest.mark.parametrize(
    ("line", "where"), PLACES + PROFILE_PLACES, ids=[p[1] for p in PLACES + PROFILE_PLACES]
)
def test_control_character_that_would_start_a_unit_directive_is_refused_at_its_line_and_column(
    line: str, where: str, escape: str, name: str
) -> None:
    """`--x=a\\nExecStartPre=+/bin/sh` in a model arg must never reach a unit file."""
    if line in [p[0] for p in PLACES]:
        text = BASE + line.replace("X", escape) + "\n"
        expected_line = 9
    else:
        expected_line = 8
        text = BASE.replace("models:\n", line.replace("X", escape) + "\nmodels: []\n")
    column = line.index('"') + 1
    found = problems(text)
    assert len(found) == 1, found
    assert found[0].startswith(f"c.yaml:{expected_line}:{column}: {where}: "), found
    assert f"holds {name}" in found[0]
    assert "remove it" in found[0]


def test_forged_directive_in_an_arg_never_loads() -> None:
    text = BASE + MODEL + "args: [\"--x\\nExecStartPre=+/bin/sh -c 'id > /root/pwned'\"]}\n"
    (message,) = problems(text)
    assert message.startswith("c.yaml:9:49: models[0].args[0]: holds a newline")


@pytest.mark.parametrize(
    "where",
    [
        'nodes:\n  - {name: n2, address: 10.0.0.2, labels: {"k\\n": v}}',
        'nodes:\n  - {name: n2, address: 10.0.0.2, weights: ["/data\\nx"]}',
        'nodes:\n  - {name: n2, address: 10.0.0.2, hcas: ["mlx5_0\\r"]}',
        'ssh: {identity_file: "/k\\nx"}',
        'ssh: {known_hosts: "/k\\x00"}',
        'gateway: {state_dir: "/var/lib/x\\ny"}',
    ],
)
def test_every_other_string_field_refuses_control_characters(where: str) -> None:
    found = problems(BASE + "  []\n" + where + "\n")
    assert any("holds a" in f or "unknown key" in f for f in found), found
    assert all(re.match(r"c\.yaml:\d+:\d+: ", f) for f in found), found


@pytest.mark.parametrize(
    ("user", "hint"),
    [
        ("$(touch /tmp/pwned)", "is not a user name"),
        ("llmgw; id", "is not a user name"),
        ("-llmgw", "is not a user name"),
        ("Llmgw", "is not a user name"),
        ("a" * 40, "is not a user name"),
        ("root", "engines never run as root"),
    ],
)
def test_engine_user_that_is_not_a_posix_name_or_is_root_is_refused(user: str, hint: str) -> None:
    text = BASE.replace("p: {engine: vllm}", f"p: {{engine: vllm, user: '{user}'}}") + "  []\n"
    (message,) = problems(text)
    assert message.startswith("c.yaml:7:27: profiles.p.user: ")
    assert hint in message


def test_only_posix_names_other_than_root_run_engines() -> None:
    for user in ("llmgw", "_engine", "svc-vllm2", "machine$"):
        text = BASE.replace("p: {engine: vllm}", f"p: {{engine: vllm, user: '{user}'}}") + "  []\n"
        assert parse_cluster(text).profiles["p"].user == user
    assert parse_cluster(BASE + "  []\nssh: {user: root}\n").ssh.user == "root"  # logging in as root is fine
    root = BASE.replace("p: {engine: vllm}", "p: {engine: vllm, user: root}") + "  []\n"
    assert "engines never run as root" in problems(root)[0]


@pytest.mark.parametrize(
    "setting",
    [
        "ssh: {user: '$(id)'}",
        "nodes:\n  - {name: n2, address: 10.0.0.2, ssh: {user: 'a b'}}",
        "ssh: {jump_host: 'x$(id)@bastion'}",
    ],
)
def test_login_user_with_shell_syntax_is_refused(setting: str) -> None:
    found = problems(BASE + "  []\n" + setting + "\n")
    assert any("is not a user name" in f for f in found), found


@pytest.mark.parametrize(
    ("setting", "hint"),
    [
        ("gateway: {listen: '0.0.0.0:99999'}", "port 99999 is out of range"),
        ("gateway: {admin_listen: '127.0.0.1:0'}", "port 0 is out of range"),
        ("gateway: {metrics_listen: '[::1]:65536'}", "port 65536 is out of range"),
        ("ssh: {jump_host: 'bastion:70000'}", "port 70000 is out of range"),
        ("nodes:\n  - {name: n2, address: 10.0.0.2, hcas: ['mlx5_0:300']}", "less than or equal to 255"),
    ],
)
def test_port_out_of_range_is_refused(setting: str, hint: str) -> None:
    text = BASE.replace("profiles:\n  p: {engine: vllm}\n", "") + "  []\n" + setting + "\n"
    found = problems(text)
    assert any(hint in f for f in found), found


@pytest.mark.parametrize("name", ["A B", "1X", "X-Y", "X=Y", "$(id)", "LD_PRELOAD "])
def test_environment_variable_name_that_systemd_would_not_read_is_refused(name: str) -> None:
    (message,) = problems(BASE + MODEL + f"env: {{'{name}': v}}}}\n")
    assert "is not an environment variable name" in message
    assert message.startswith("c.yaml:9:")


def test_secret_env_name_that_systemd_would_not_read_is_refused() -> None:
    (message,) = problems(BASE + MODEL + "env: {A: v}, secret_env: ['A B']}\n")
    assert (
        message.startswith("c.yaml:9:")
        and "secret_env[0]: 'A B' is not an environment variable name" in message
    )


@pytest.mark.parametrize("program", ["+/bin/sh", "-/opt/vllm", "!/bin/vllm", "@/bin/sh", ":/x", ""])
def test_program_read_by_systemd_as_a_privilege_flag_is_refused(program: str) -> None:
    """`command: ['+/bin/sh', ...]` would run as root whatever User= says."""
    text = BASE.replace("p: {engine: vllm}", f"p: {{engine: vllm, command: ['{program}', serve]}}") + "  []\n"
    (message,) = problems(text)
    assert "profiles.p.command: the program" in message


@pytest.mark.parametrize(
    "setting",
    [
        "nodes:\n  - {name: n2, address: '-oProxyCommand=touch /tmp/pwned'}",
        "nodes:\n  - {name: n2, address: 'a b'}",
        "ssh: {jump_host: '-oProxyCommand=id'}",
        "gateway: {host: '$(id)'}",
        "gateway: {listen: '-x:80'}",
        "fabrics:\n  f: {kind: roce, socket_interface: 'eth0 -x'}",
        "gateway: {state_dir: '/var/lib/a b'}",
        "gateway: {llmgw_bin: '/usr/bin/llmgw --x'}",
        "gateway: {llmgw_bin: '/opt/%n/llmgw'}",
    ],
)
def test_host_and_word_that_could_smuggle_an_option_is_refused(setting: str) -> None:
    found = problems(BASE.replace("fabrics:\n  ib: {kind: infiniband}\n", "") + "  []\n" + setting + "\n")
    assert found and all(re.match(r"c\.yaml:\d+:\d+: ", f) for f in found), found
    assert any(("is not" in f or "one word" in f) for f in found), found


@pytest.mark.parametrize(
    ("setting", "hint"),
    [
        ("gateway: {timeouts: {idle: '" + "9" * 400 + "s'}}", "longer than a year"),
        ("gateway: {drain_timeout: 400d}", "longer than a year"),
        ("gateway: {max_request_size: '" + "9" * 400 + "GiB'}", "larger than 1024TiB"),
        ("gateway: {model_queue: " + "9" * 40 + "}", "less than or equal to"),
        ("gateway: {model_concurrency: " + "9" * 40 + "}", "less than or equal to"),
    ],
)
def test_huge_numbers_are_refused_not_crashed_on(setting: str, hint: str) -> None:
    found = problems(BASE + "  []\n" + setting + "\n")
    assert any(hint in f for f in found), found


@pytest.mark.parametrize(
    ("text", "start"),
    [
        (b"cluster: {name: t\xff}\n", "c.yaml:1:18: byte 0xff is not UTF-8"),
        ("cluster: {name: t}\n\x01\n", "c.yaml:2:1: the file holds control character U+0001"),
        (
            "cluster: {name: 2024-02-30}\n",
            "c.yaml:1:17: cluster.name: cannot read this value as a YAML timestamp",
        ),
        ("cluster: {name: !!int x}\n", "c.yaml:1:17: cluster.name: cannot read this value as a YAML int"),
        ("cluster: {name: !!bool x}\n", "c.yaml:1:17: cluster.name: cannot read this value"),
        ("a: &a [*a]\n", "c.yaml:1:4: a"),
        ("a: &a {<<: *a}\n", "c.yaml:1:4: a"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "c.yaml:1:1: values are nested"),
        ("? [a, b]\n: 1\n", "c.yaml:1:3: a key must be a plain value"),
    ],
)
def test_input_that_crashed_the_loader_is_a_located_problem(text: str | bytes, start: str) -> None:
    (message,) = problems(text)
    assert message.startswith(start), message


def test_billion_laughs_is_refused_quickly() -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    (message,) = problems("\n".join(lines) + "\n")
    assert "the file expands to more than" in message


# --- fuzzing: whatever the input, a ClusterSpec or located problems, never a traceback --

HOSTILE = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "$(id)",
            "`id`",
            "%n",
            "%%",
            "${LLMGW_ENGINE_KEY}",
            "'",
            '"',
            "\\",
            ";",
            "a\nExecStartPre=+/bin/sh",
            "\x00",
            "\r",
            "\u2028",
            "[/x]",
            "-oProxyCommand=id",
            "root",
            "99999",
        ]
    ),
)
TOKENS = st.sampled_from(
    [
        "cluster:",
        "nodes:",
        "models:",
        "profiles:",
        "gateway:",
        "name:",
        "{",
        "}",
        "[",
        "]",
        ",",
        "- ",
        ": ",
        "\n",
        "  ",
        "&a ",
        "*a",
        "<<: ",
        "!!int ",
        "!!timestamp ",
        "!!python/name:os.system ",
        "? ",
        "'",
        '"',
        "\\",
        "#",
        "---\n",
        "|\n",
        ">\n",
        "99999999999999999999999",
        "-1",
        "1e400",
        "2024-02-30",
        ".nan",
        "~",
        "yes",
        "\t",
        "\x00",
        "\x85",
        "\ufeff",
        "%YAML 1.1\n",
        "!",
    ]
)


def located_or_spec(text: str | bytes) -> ClusterSpec | None:
    try:
        spec = parse_cluster(text, "c.yaml")
    except SpecError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.file == "c.yaml"
            assert problem.line >= 1 and problem.column >= 1, problem
            assert problem.message
        return None
    for s in strings_of(spec.model_dump(mode="json", by_alias=True)):
        assert not CONTROL.search(s), s
    return spec


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(TOKENS | HOSTILE, max_size=40))
def test_fuzz_yaml_ish_text_never_crashes_the_loader(parts: list[str]) -> None:
    located_or_spec("".join(parts))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_never_crash_the_loader(data: bytes) -> None:
    located_or_spec(b"cluster: {name: t}\n" + data)


SLOTS = [
    "  - {name: m, source: org/m, profile: p, args: [%s]}",
    "  - {name: m, source: org/m, profile: p, env: {A: %s}}",
    "  - {name: m, source: org/m, profile: p, env: {%s: v}}",
    "  - {name: %s, source: org/m, profile: p}",
    "  - {name: m, source: %s, profile: p}",
    "  - {name: m, source: org/m, profile: p, gpu_class: %s}",
    "  - {name: m, source: org/m, profile: p, scaling: {min: 0, max: %s}}",
    "  - {name: m, source: org/m, profile: p, nodes: %s}",
]
PROFILE_SLOTS = [
    "  q: {engine: vllm, user: %s}",
    "  q: {engine: vllm, command: [%s]}",
    "  q: {engine: vllm, ports: %s}",
    "  q: {engine: llama-server, args: [%s, %s]}",
]
TOP_SLOTS = [
    "gateway: {listen: %s}",
    "gateway: {host: %s}",
    "gateway: {state_dir: %s}",
    "ssh: {user: %s, jump_host: %s}",
    "nodes:\n  - {name: n2, address: %s}",
    "nodes:\n  - {name: n2, address: 10.0.0.2, labels: {%s: %s}}",
]


@FUZZ
@given(st.data())
def test_fuzz_structured_documents_with_hostile_strings(data: st.DataObject) -> None:
    values = st.one_of(HOSTILE.map(yaml_quoted), st.integers(-(2**70), 2**70).map(str), HOSTILE)
    kind = data.draw(st.sampled_from(["model", "profile", "top"]))
    if kind == "model":
        slot = data.draw(st.sampled_from(SLOTS))
        text = BASE + slot % tuple(data.draw(values) for _ in range(slot.count("%s"))) + "\n"
    elif kind == "profile":
        slot = data.draw(st.sampled_from(PROFILE_SLOTS))
        line = slot % tuple(data.draw(values) for _ in range(slot.count("%s")))
        text = BASE.replace("models:\n", line + "\nmodels: []\n")
    else:
        slot = data.draw(st.sampled_from(TOP_SLOTS))
        text = BASE + "  []\n" + slot % tuple(data.draw(values) for _ in range(slot.count("%s"))) + "\n"
    located_or_spec(text)


@FUZZ
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x3000), min_size=1, max_size=20))
def test_fuzz_any_string_in_a_model_arg_loads_only_without_control_characters(value: str) -> None:
    spec = located_or_spec(
        BASE + "  - {name: m, source: org/m, profile: p, args: [" + yaml_quoted(value) + "]}\n"
    )
    if CONTROL.search(value) or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        assert spec is None
    else:
        assert spec is not None and spec.models[0].args == [value]


# --- hostile but legal values: a unit systemd accepts, no extra directive, same argv -----


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("profile", ["vllm", "llama-cpp"])
def test_hostile_but_legal_args_render_a_unit_systemd_accepts_with_no_extra_directive(
    profile: str, tmp_path: Path
) -> None:
    inventory = (ROOT / "inventories/single-box.yaml").read_text()
    clean = pinned(parse_cluster(inventory))
    args = "[" + ", ".join(yaml_quoted(a) for a in HOSTILE_ARGS) + "]"
    hostile = pinned(
        parse_cluster(
            inventory.replace("profile: llama-cpp\n", "profile: llama-cpp\n    args: " + args + "\n").replace(
                "profile: vllm\n    scaling: {min: 1",
                "profile: vllm\n    args: " + args + "\n    scaling: {min: 1",
            )
        )
    )
    name = "qwen2.5-7b-instruct" if profile == "vllm" else "smollm2-135m"
    assert hostile.model(name).args == HOSTILE_ARGS
    root = scratch_root(tmp_path, hostile)
    member = Member(hostile.nodes[0], 0, ("GPU-0",))
    units = []
    for spec in (clean, hostile):
        model = spec.model(name)
        units.append(
            replica_unit(spec, model, replica=0, member=member, port=8100, members=(member,), dist_port=0)
        )
    clean_unit, unit = units
    assert unit_keys(unit.text) == unit_keys(clean_unit.text)
    assert unit.text.count("\n") == clean_unit.text.count("\n")
    (exec_line,) = [line for line in unit.text.splitlines() if line.startswith("ExecStart=")]
    argv = exec_argv(exec_line.removeprefix("ExecStart="))
    model = hostile.model(name)
    intended = engine_args(hostile, model, member, port=8100, head=member.node, dist_port=0)
    intended += key_flags(hostile.profiles[model.profile].engine, hostile.profiles[model.profile].user)
    assert argv == intended
    start = argv.index(HOSTILE_ARGS[0])
    assert argv[start : start + len(HOSTILE_ARGS)] == HOSTILE_ARGS
    assert_verifies(root, unit)
