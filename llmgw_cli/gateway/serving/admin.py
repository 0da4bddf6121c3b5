"""The admin listener's pages: the ``/admin`` dashboard, its JSON twin
``/admin/api/summary``, and ``/metrics`` (also on ``metrics_listen``).

The dashboard is server-rendered HTML (a jinja2 template, autoescaped), no scripts, no
build step; it reloads itself every ``REFRESH`` seconds. Its charts of the last hour are
inline SVG from ``core/views/sparkline.py``, which escapes the text it writes. A browser sends the admin key as
the password of HTTP Basic authentication (any user name); scripts send it as a Bearer
token. Both read the same Summary as ``llmgw status`` (``fleet.summary_of``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from llmgw_cli.core.clusterfile.quantities import clock
from llmgw_cli.core.engine.templates import template_dirs
from llmgw_cli.core.serving.keys import bearer, plausible_token
from llmgw_cli.core.views.sparkline import sparkline
from llmgw_cli.core.views.summary import Summary, count_text, share_text
from llmgw_cli.gateway.control.fleet import probe_ages, probing, summary_of
from llmgw_cli.gateway.control.state import Gateway
from llmgw_cli.gateway.serving.proxy import GATEWAY
from llmgw_cli.gateway.serving.recent import MINUTES, PerMinute
from llmgw_cli.gateway.store.usage import merged

if TYPE_CHECKING:
    import jinja2

REFRESH = 10  # seconds between reloads of the dashboard
CHALLENGE = {"WWW-Authenticate": 'Basic realm="llmgw admin", charset="UTF-8"'}


def admin_token(authorization: str | None) -> str | None:
    """The key from ``Bearer <key>`` or from the password of ``Basic base64(user:key)``."""
    token = bearer(authorization)
    if token is not None or not authorization:
        return token
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64 (a non-ASCII header too), not UTF-8: no key, a 401
        return None
    _, sep, password = decoded.partition(":")
    return password if sep and plausible_token(password) else None


async def _summary(gw: Gateway) -> Summary:
    stored = await gw.store.usage()
    return summary_of(gw, merged(stored, gw.meter.pending()))


def last_hour(gw: Gateway) -> dict[str, dict[str, list[int]]]:
    """Every model of the cluster file (in its order): requests and tokens per minute of
    the last hour, ``MINUTES`` each, oldest first (this worker's count)."""
    use = gw.metrics.recent.per_model(time.monotonic())
    none = PerMinute((0,) * MINUTES, (0,) * MINUTES)
    return {
        m.name: {"requests": list(u.requests), "tokens": list(u.tokens)}
        for m in gw.spec.models
        for u in (use.get(m.name, none),)
    }


def _report(gw: Gateway, summary: Summary) -> dict[str, Any]:
    source = probing(gw)
    now = time.time()
    return {
        "cluster": gw.spec.cluster.name,
        "probing": source is not None,
        "probe_age_seconds": probe_ages(source, (n.name for n in summary.nodes)) if source else {},
        "queued": gw.admission.queued(),
        # the model controller's recent actions, oldest first, each with its reason
        "actions": [{**a.as_dict(), "ago": max(0.0, now - a.time)} for a in gw.controller.actions],
        "last_hour": last_hour(gw),
        **summary.model_dump(mode="json"),
    }


async def api_summary(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response(_report(gw, await _summary(gw)))


@cache
def _template() -> jinja2.Template:
    # jinja2 with the first dashboard page: a worker that serves none never loads it
    import jinja2  # noqa: PLC0415

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in template_dirs()]),
        undefined=jinja2.StrictUndefined,
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["duration"] = duration
    # numbers an engine reported: formatted here, never taken as text or markup
    env.filters["count"] = count_text
    env.filters["share"] = share_text
    return env.get_template("dashboard.html.j2")


def duration(seconds: float | None) -> str:
    """``95`` -> ``1m 35s``; None -> ``-``."""
    return "-" if seconds is None else clock(seconds, " ")


def charts(hour: Mapping[str, Mapping[str, Sequence[int]]]) -> list[dict[str, Any]]:
    """Per model of ``hour`` (``last_hour``): its requests and tokens per minute as
    sparklines, and their sums."""
    return [
        {
            "model": model,
            "requests": sparkline(use["requests"], f"{model}: requests per minute, last hour"),
            "requests_total": sum(use["requests"]),
            "tokens": sparkline(use["tokens"], f"{model}: tokens per minute, last hour"),
            "tokens_total": sum(use["tokens"]),
        }
        for model, use in hour.items()
    ]


def page(report: dict[str, Any], now: str) -> str:
    """The dashboard's HTML for a report (``_report``'s shape), as of ``now``."""
    return _template().render(
        r=report,
        refresh=REFRESH,
        now=now,
        loading=[m for m in report["models"] if m["state"] == "starting"],
        idle=[r for r in report["replicas"] if r["idle"]],
        charts=charts(report["last_hour"]),
    )


async def dashboard(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    html = page(_report(gw, await _summary(gw)), time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    return web.Response(text=html, content_type="text/html", headers={"Cache-Control": "no-store"})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = gw.metrics.render()
    if body is None:
        return web.Response(
            status=503,
            text="llmgw: the metrics registry is not built yet (the gateway is starting: "
            "first discovery of replicas and probe of the nodes); try again shortly.\n",
            headers={"Retry-After": "5"},
        )
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, *, admin: bool) -> None:
    """``/metrics`` always; with ``admin`` the dashboard and the summary API too."""
    app.router.add_get("/metrics", metrics)
    if admin:
        app.router.add_get("/admin", dashboard)
        app.router.add_get("/admin/", dashboard)
        app.router.add_get("/admin/api/summary", api_summary)
