"""Rendering of the packaged jinja2 templates (systemd units, scripts).

Templates live in the repository's top-level ``templates/`` folder; the wheel carries
them as ``llmgw_cli/templates``. Both places are looked up, installed copy first, so a
source checkout and an installed package behave alike.
"""

from __future__ import annotations

import shlex
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmgw_cli.errors import TemplateError

if TYPE_CHECKING:
    import jinja2

# jinja2 (about 1 MiB and 40 modules) is imported when a template is first rendered: a
# gateway worker that only routes requests renders none.

_PACKAGE = Path(__file__).resolve().parent.parent.parent


def template_dirs() -> list[Path]:
    """Folders searched for templates, in order."""
    return [d for d in (_PACKAGE / "templates", _PACKAGE.parent / "templates") if d.is_dir()]


@cache
def _environment() -> jinja2.Environment:
    import jinja2  # noqa: PLC0415 (see above)

    dirs = template_dirs()
    if not dirs:
        raise TemplateError(f"no templates folder found next to {_PACKAGE}; reinstall llmgw")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shellquote"] = shlex.quote
    return env


def render(name: str, **context: Any) -> str:
    """Render template ``name`` with ``context``; a missing variable is an error, not blank."""
    import jinja2  # noqa: PLC0415

    try:
        return _environment().get_template(name).render(**context)
    except jinja2.TemplateNotFound:
        raise TemplateError(
            f"template {name!r} not found in {', '.join(map(str, template_dirs()))}"
        ) from None
    except jinja2.UndefinedError as exc:
        raise TemplateError(f"template {name!r}: {exc.message}") from None


def render_text(source: str, **context: Any) -> str:
    """Render the template text ``source`` (a snippet kept beside the code that reads its
    output) with ``context``, under the same rules as ``render``."""
    import jinja2  # noqa: PLC0415

    try:
        return _compiled(source).render(**context)
    except jinja2.UndefinedError as exc:
        raise TemplateError(f"template snippet: {exc.message}") from None


@cache
def _compiled(source: str) -> jinja2.Template:
    """``source`` compiled once per process: a probe of 32 nodes renders the same few
    snippets for each node, and compiling them was a tenth of ``llmgw status``'s CPU."""
    return _environment().from_string(source)
