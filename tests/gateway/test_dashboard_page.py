"""The /admin page's template with hostile values everywhere a name or a message goes:
each stays text (attribute values and element text the browser reads back unchanged),
and the per-model charts are inline SVG with the model's name escaped in their title.
The real gateway's page: tests/gateway/test_observability.py."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.views.summary import summarize
from llmgw_cli.gateway.serving.admin import page
from llmgw_cli.gateway.serving.recent import MINUTES

pytestmark = pytest.mark.any_loop  # a template: no event loop

HOSTILE = '<script>alert("x")</script>"\' onmouseover="alert(1)'
SPEC = parse_cluster(
    """\
cluster: {name: t}
nodes:
  - {name: a, address: 10.0.0.1}
profiles: {vllm: {engine: vllm}}
models:
  - {name: quiet, source: org/quiet, fetch: engine, profile: vllm}
  - {name: chat, source: org/chat, fetch: engine, profile: vllm}
"""
)


class Page(HTMLParser):
    """Tags, their attributes and the text, as a browser's parser reads them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def rows(self, attribute: str) -> list[str | None]:
        return [a[attribute] for t, a in self.tags if t == "tr" and attribute in a]


def report() -> dict[str, object]:
    """What `_report` gives, with a hostile model, key, address, node error and reason."""
    summary = summarize(SPEC, {"a": NodeFacts(node="a", error=HOSTILE)}).model_dump(mode="json")
    summary["models"][1]["name"] = HOSTILE
    summary["models"][1]["state"] = "ready"
    summary["replicas"] = [
        {
            "model": HOSTILE,
            "address": HOSTILE,
            "health": "ready",
            "in_flight": 0,
            "idle_seconds": 4000.0,
            "idle": True,
            "load": {"read": True, "waiting": 3.0, "running": 2.0, "kv_usage": 0.25, "age_seconds": 1.5},
        }
    ]
    summary["keys"] = [
        {
            "key": HOSTILE,
            "requests_hour": 3,
            "tokens_hour": 30,
            "requests_day": 3,
            "tokens_day": 30,
            "models": [HOSTILE],
        }
    ]
    requests = [0] * (MINUTES - 2) + [1, 2]
    return {
        "cluster": "t",
        "probing": True,
        "probe_age_seconds": {"a": 3.0},
        "queued": {},
        "actions": [{"time": 0.0, "model": HOSTILE, "action": "start", "reason": HOSTILE, "ago": 5.0}],
        "last_hour": {
            "quiet": {"requests": [0] * MINUTES, "tokens": [0] * MINUTES},
            HOSTILE: {"requests": requests, "tokens": [10 * r for r in requests]},
        },
        **summary,
    }


def test_hostile_names_stay_text_and_every_model_has_its_charts() -> None:
    html = page(report(), "now")
    parsed = Page(html)
    tags = [t for t, _ in parsed.tags]
    assert "script" not in tags and "<script>" not in html
    assert not any("onmouseover" in attrs for _, attrs in parsed.tags)
    # Every row names its model exactly, however hostile the name.
    assert parsed.rows("data-model").count(HOSTILE) == 4  # models, last hour, actions, replicas
    assert parsed.rows("data-key") == [HOSTILE]
    assert sum(HOSTILE in text for text in parsed.text) >= 6
    # Two charts per model of the last hour: requests and tokens, each with its title.
    assert tags.count("svg") == 2 * 2
    titles = [t for t in parsed.text if "per minute, last hour" in t]
    assert titles == [
        "quiet: requests per minute, last hour; max 0",
        "quiet: tokens per minute, last hour; max 0",
        f"{HOSTILE}: requests per minute, last hour; max 2",
        f"{HOSTILE}: tokens per minute, last hour; max 20",
    ]


def test_no_model_no_charts() -> None:
    r = report()
    r["last_hour"] = {}
    parsed = Page(page(r, "now"))
    assert [t for t, _ in parsed.tags].count("svg") == 0
    assert any(a.get("id") == "last-hour" for t, a in parsed.tags if t == "p")


def test_each_replicas_engine_load_is_shown_read_stale_or_unknown() -> None:
    """Fresh values as numbers, a stale reading by its age only, none as "—" (never 0)."""
    r = report()
    base = {"model": "chat", "health": "ready", "in_flight": 0, "idle_seconds": 1.0, "idle": False}
    r["replicas"] = [
        {**base, "address": "h:1", "load": {"read": True, "waiting": 0.0, "running": 2.0,
                                            "kv_usage": 0.995, "age_seconds": 2.0}},
        {**base, "address": "h:2", "load": {"read": False, "waiting": None, "running": None,
                                            "kv_usage": None, "age_seconds": 95.0}},
        {**base, "address": "h:3", "load": {"read": False, "waiting": None, "running": None,
                                            "kv_usage": None, "age_seconds": None}},
    ]  # fmt: skip
    html = page(r, "now")
    cells = {}
    for address in ("h:1", "h:2", "h:3"):
        row = html.split(f'data-address="{address}"', 1)[1].split("</tr>", 1)[0]
        cells[address] = [t.strip() for t in Page(row).text if t.strip()]
    assert cells["h:1"][-4:] == ["0", "2", "100%", "read 2s ago"]
    assert cells["h:2"][-4:] == [
        "\u2014",
        "\u2014",
        "\u2014",
        "stale: last read 1m 35s ago",
    ]
    assert cells["h:3"][-4:] == ["\u2014", "\u2014", "\u2014", "not read"]
