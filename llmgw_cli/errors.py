"""Every error llmgw raises on purpose, and the exit code each one means.

Hierarchy::

    LlmgwError                 exit 1: something failed while doing the work
    ├── InputError             exit 2: the user's input is wrong; fix it and retry
    │   ├── SpecError          the cluster file has problems (all of them, located)
    │   └── UsageError         a command-line argument is wrong
    ├── TemplateError          a packaged template is missing or failed to render
    ├── NodeError              one node could not be reached or a command on it failed;
    │                          carries the node and a kind (unreachable, auth, hostkey-...)
    ├── FetchError             weights could not be brought onto a node (404, token needed,
    │                          disk full, checksum mismatch...); carries model, node, kind
    └── LabError               the lab cluster could not be booted, changed or removed
        └── LabUnavailable     exit 2: this machine cannot run the lab (not Linux, not root,
                               a tool missing)

The CLI maps these to messages and exit codes in one place
(``llmgw_cli.cli.main.main``). Anything else escaping is a bug and keeps its
traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class LlmgwError(Exception):
    """Base of every deliberate llmgw error."""

    exit_code = 1


class InputError(LlmgwError):
    """The input is wrong; the message says what to change."""

    exit_code = 2


class UsageError(InputError):
    """A command-line argument is wrong."""


@dataclass(frozen=True)
class Problem:
    """One located problem in a cluster file.

    ``line`` and ``column`` are 1-based; 0 means the position is unknown.
    ``where`` is the dotted path of the offending key, e.g. ``models[2].scaling``.
    """

    file: str
    line: int
    column: int
    where: str
    message: str

    def __str__(self) -> str:
        pos = f"{self.file}:{self.line}:{self.column}" if self.line else self.file
        return f"{pos}: {self.where}: {self.message}" if self.where else f"{pos}: {self.message}"


class SpecError(InputError):
    """A cluster file has one or more problems; ``problems`` lists all of them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        count = len(problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in the cluster file")


class TemplateError(LlmgwError):
    """A packaged template could not be found or rendered."""


class NodeError(LlmgwError):
    """Talking to one node failed. ``kind`` is one of: unreachable, auth, hostkey-changed,
    hostkey-unknown, timeout, command-missing, sudo, failed, bad-output (the node's probe
    output was cut off or not in the probe's format)."""

    def __init__(self, node: str, kind: str, reason: str) -> None:
        self.node, self.kind, self.reason = node, kind, reason
        super().__init__(f"{node}: {reason}")


class FetchError(LlmgwError):
    """Bringing a model's weights onto a node failed. ``kind`` is one of: not-found, auth,
    disk-full, checksum, size, network, tls, http, interrupted, crash, node."""

    def __init__(self, model: str, node: str, kind: str, reason: str) -> None:
        self.model, self.node, self.kind, self.reason = model, node, kind, reason
        super().__init__(f"{model} on {node}: {reason}")


class LabError(LlmgwError):
    """The lab cluster (``llmgw lab ...``) failed; the message says which node and why."""


class LabUnavailable(LabError):
    """This machine cannot run the lab: not Linux, not root, or a required tool is missing."""

    exit_code = 2
