"""`llmgw keys` and `llmgw usage`: where the store is reached from (PostgreSQL directly,
SQLite here or on the gateway host), and the gateway host's JSON answers parsed as another
machine's output: anything but what was asked for is an error, never printed."""

from __future__ import annotations

import json

import pytest

from llmgw_cli.cli.store_access import (
    KeyUse,
    keys_json,
    parse_keys,
    parse_usage,
    parse_usage_limits,
    parse_use,
    usage_json,
)
from llmgw_cli.cli.usage import _day
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.serving.keys import ApiKey, parse_expiry
from llmgw_cli.core.serving.limits import NO_LIMITS, Budget, Limits, Priority
from llmgw_cli.errors import LlmgwError, UsageError
from llmgw_cli.gateway.store.sqlite import Usage
from llmgw_cli.remote.gateway_store import remote_command, shown, store_host, this_machine

BASE = """\
cluster: {name: t}
nodes:
  - {name: here, address: 127.0.0.1}
  - {name: self, address: 198.51.100.1, connection: local}
  - {name: far, address: 198.51.100.2}
"""


def cluster(gateway: str) -> str:
    return BASE + f"gateway: {gateway}\n"


def test_the_store_is_reached_from_here_unless_it_is_sqlite_on_another_host() -> None:
    for host in ("localhost", "127.0.0.1", "here", "self"):
        spec = parse_cluster(cluster(f"{{host: {host}}}"))
        assert this_machine(spec, host) and store_host(spec) is None, host
    far = parse_cluster(cluster("{host: far}"))
    assert not this_machine(far, "far") and store_host(far) == "far"
    assert store_host(parse_cluster(cluster("{host: 198.51.100.9}"))) == "198.51.100.9"
    shared = parse_cluster(cluster("{hosts: [far, 198.51.100.9], store: 'postgresql://u@db.example/llmgw'}"))
    assert store_host(shared) is None  # PostgreSQL: directly, from anywhere


def test_the_gateway_hosts_command_runs_as_the_folders_owner_with_every_word_quoted() -> None:
    spec = parse_cluster(
        cluster("{host: far, state_dir: /var/lib/llmgw-gw/, llmgw_bin: /opt/llmgw/bin/llmgw}")
    )
    command = remote_command(spec, ["keys", "revoke"], ["--", "$(touch /tmp/pwned); x"])
    assert command.endswith(
        'exec runuser -u "$o" -- "$b" keys revoke --store-dir /var/lib/llmgw-gw -- \'$(touch /tmp/pwned); x\''
    )
    assert "d=/var/lib/llmgw-gw; b=/opt/llmgw/bin/llmgw;" in command
    on_path = remote_command(parse_cluster(cluster("{host: far}")), ["usage"], ["--json"])
    assert 'b="$(command -v llmgw)"' in on_path and "usage --store-dir /var/lib/llmgw --json" in on_path


def test_keys_go_and_come_back_as_json_without_their_digest() -> None:
    keys = [
        ApiKey(
            "team-a", "d" * 64, ("m1", "m2"), parse_expiry("2027-01-31"), parse_expiry("2026-12-01T10:00")
        ),
        ApiKey("ops", "e" * 64, (), None, None, revoked=True, admin=True),
    ]
    text = keys_json(keys)
    assert "d" * 64 not in text and "e" * 64 not in text
    assert parse_keys(text) == [
        ApiKey("team-a", "", ("m1", "m2"), keys[0].expires, keys[0].created),
        ApiKey("ops", "", (), None, None, revoked=True, admin=True),
    ]


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "not json",
        "{}",
        "[1]",
        '[{"name": 5, "models": [], "expires": null, "created": null, "revoked": false, "admin": false}]',
        '[{"name": "x", "models": "all", "expires": null, "created": null, "revoked": false, "admin": false}]',
        '[{"name": "x", "models": [], "expires": "tomorrow", "created": null, "revoked": false, "admin": false}]',
        '[{"name": "x", "models": [], "expires": null, "created": null, "revoked": "no", "admin": false}]',
        json.dumps(
            [
                {
                    "name": "x" * 201,
                    "models": [],
                    "expires": None,
                    "created": None,
                    "revoked": False,
                    "admin": False,
                }
            ]
        ),
    ],
)
def test_a_bad_keys_answer_is_an_error_that_does_not_show_it(answer: str) -> None:
    with pytest.raises(LlmgwError) as bad:
        parse_keys(answer)
    assert "gateway host" in str(bad.value) and (not answer or answer not in str(bad.value))


def test_usage_goes_and_comes_back_as_json() -> None:
    rows = [
        Usage("2026-12-01", "team-a", "m", 4, 100, 40, 1, 200.0),
        Usage("2026-12-02", "ops", "m", 0, 0, 0, 0, 0.0),
    ]
    back = parse_usage(usage_json(rows))
    assert back == rows  # the latency sum comes back from the mean and the count
    for bad in (
        '[{"day": "2026-12-01", "key": "k", "model": "m", "requests": -1, "prompt_tokens": 0, '
        '"completion_tokens": 0, "errors": 0, "mean_latency_ms": 0}]',
        '[{"day": "2026-12-01", "key": "k", "model": "m", "requests": true, "prompt_tokens": 0, '
        '"completion_tokens": 0, "errors": 0, "mean_latency_ms": 0}]',
        '[{"day": "2026-12-01", "key": "k", "model": "m", "requests": 1, "prompt_tokens": 0, '
        '"completion_tokens": 0, "errors": 0, "mean_latency_ms": "NaN"}]',
        '[{"day": "a very long day", "key": "k", "model": "m", "requests": 1, "prompt_tokens": 0, '
        '"completion_tokens": 0, "errors": 0, "mean_latency_ms": 1}]',
    ):
        with pytest.raises(LlmgwError, match="bad usage row"):
            parse_usage(bad)


def test_since_is_a_day() -> None:
    assert _day(None) is None
    assert _day("2026-12-01") == "2026-12-01"
    for bad in ("2026-12-1", "yesterday", "2026-13-01", "2026-12-01T00:00", "2026-12-01' OR 1=1"):
        with pytest.raises(UsageError, match="YYYY-MM-DD"):
            _day(bad)


def test_another_machines_message_is_printable_text_only() -> None:
    assert (
        shown("error: \x1b[31mred\x1b[0m\x07 [bold]x[/bold]\nsecond")
        == "error: [31mred[0m [bold]x[/bold]\nsecond"
    )
    assert len(shown("x" * 5000)) == 2000


def test_keys_limits_and_use_go_and_come_back_as_json() -> None:
    limits = Limits(
        rpm=60, tpm=100_000, max_parallel=4, budget=Budget(100_000, "day"), priority=Priority.high
    )
    keys = [ApiKey("team-a", "d" * 64, limits=limits), ApiKey("free", "e" * 64)]
    use = {"team-a": KeyUse("m:29441760", 12, 3400, "d:2026-12-05", 52_000)}
    text = keys_json(keys, use)
    assert [k.limits for k in parse_keys(text)] == [limits, NO_LIMITS]
    assert parse_use(text) == use
    rows = json.loads(text)
    assert rows[0]["limits"] == {
        "rpm": 60,
        "tpm": 100000,
        "max_parallel": 4,
        "budget": "100000/day",
        "priority": "high",
    }
    assert rows[1]["use"] is None
    # an llmgw there from before the limits: keys without limits, no use
    older = [{k: v for k, v in row.items() if k not in ("limits", "use")} for row in rows]
    assert [k.limits for k in parse_keys(json.dumps(older))] == [NO_LIMITS, NO_LIMITS]
    assert parse_use(json.dumps(older)) == {}


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"limits": {"rpm": -1}}, "bad key (rpm)"),
        ({"limits": {"budget": "1/week"}}, "bad key (budget)"),
        ({"limits": "none"}, "bad key (limits)"),
        (
            {"use": {"minute": "m:1", "requests": -1, "tokens": 0, "period": None, "budget": 0}},
            "bad key (requests)",
        ),
        ({"use": {"minute": 5, "requests": 0, "tokens": 0, "period": None, "budget": 0}}, "bad key (minute)"),
        ({"use": []}, "bad key (use)"),
    ],
)
def test_a_keys_answer_with_bad_limits_or_use_is_an_error(change: dict[str, object], what: str) -> None:
    row = json.loads(keys_json([ApiKey("k", "")]))[0] | change
    with pytest.raises(LlmgwError) as bad:
        parse_keys(json.dumps([row]))
        parse_use(json.dumps([row]))
    assert what in str(bad.value)


def test_usage_rows_carry_their_keys_limits() -> None:
    rows = [
        Usage("2026-12-01", "team-a", "m", 4, 100, 40, 1, 200.0),
        Usage("2026-12-01", "gone", "m", 1, 1, 1, 0, 1.0),
    ]
    text = usage_json(rows, {"team-a": Limits(rpm=5)})
    assert parse_usage(text) == rows
    assert parse_usage_limits(text) == {"team-a": Limits(rpm=5)}  # a key the store does not know: none
    assert json.loads(text)[1]["limits"] is None
    with pytest.raises(LlmgwError, match="bad usage row"):
        parse_usage_limits(text.replace('"rpm": 5', '"rpm": 0'))
