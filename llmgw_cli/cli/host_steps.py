"""The whole plan in the shell: the gateway previews as host facts, a saved plan loaded
and checked against what `apply` read (``core/planning/whole_plan.py``), the host steps printed.
What `plan` and `apply` read beside the node probe is gathered in ``cli/apply_steps.py``."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import Plan, facts_digest, make_plan
from llmgw_cli.core.planning.steps import GatewayState, HostFacts, host_lines
from llmgw_cli.core.planning.whole_plan import (
    has_work,
    host_digest,
    host_steps,
    saved_refusal,
    what_changed,
    whole,
)
from llmgw_cli.errors import InputError
from llmgw_cli.remote.gateway_install import GatewayPreviews
from llmgw_cli.remote.replica_health import health_answers


def gateway_states(gateway: GatewayPreviews) -> tuple[GatewayState, ...]:
    """Each gateway host's preview as the plan holds it: how it changes, the files it
    writes (a secret's digest stands for its text, never the text)."""
    return tuple(
        GatewayState(
            host=p.host,
            how="skip" if p.change is None else p.change.how,
            files=() if p.change is None else tuple((Path(f.path).name, f.state) for f in p.change.write),
            said=p.describe(),
        )
        for p in gateway.hosts
    )


def show(plan: Plan, console: Console) -> None:
    """The plan's host steps, one line each kind (``core/planning/steps.py``): yellow when it
    changes something."""
    for line, changes in host_lines(plan.steps):
        console.print(Text(line, style="yellow" if changes else "dim"), highlight=False, soft_wrap=True)


def load_saved(
    path: Path,
    spec: ClusterSpec,
    session: Session,
    facts: dict[str, NodeFacts],
    host: HostFacts,
    *,
    written: ClusterSpec,
) -> Plan | None:
    """The plan saved in ``path``, when it still holds: its format is read here, the
    cluster file is the one it was made from, and the nodes (their facts, helpers, keys,
    gateway files: ``host``) are as it found them. None when they are not but a plan made now
    changes nothing: the saved plan was carried out already. Raises InputError saying
    what changed otherwise."""
    try:
        saved = Plan.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise InputError(
            f"{path}: not a plan saved by `llmgw plan --out`: {str(exc).splitlines()[0]}"
        ) from None
    refused = saved_refusal(saved, written)
    if refused:
        raise InputError(f"{path}: {refused}")
    if saved.facts_digest == facts_digest(facts) and saved.host_digest == host_digest(host):
        return saved
    answers = session.run(health_answers(spec, session.conns, facts))
    now = whole(spec, make_plan(spec, facts, answers=answers), facts, host, written=written)
    if not has_work(now):
        return None
    raise InputError(
        f"{path}: the nodes changed since this plan was made ({what_changed(saved, now)}); "
        "run `llmgw plan` again"
    )


def with_rotation(chosen: Plan, spec: ClusterSpec, facts: dict[str, NodeFacts]) -> Plan:
    """``chosen`` whose engine key steps rotate every reachable node's key."""
    reachable = tuple(n.name for n in spec.nodes if n.name in facts and facts[n.name].reachable)
    rotated = host_steps(spec, chosen, HostFacts(rotate=reachable))
    kept = tuple(s for s in chosen.steps if s.kind != "engine_key")
    return chosen.model_copy(update={"steps": kept + tuple(s for s in rotated if s.kind == "engine_key")})
