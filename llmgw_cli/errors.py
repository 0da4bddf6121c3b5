"""Every error llmgw raises on purpose, and the exit code each one means.

The exit codes of every command (``ExitCode``): 0 done; 1 failed (something went wrong
while doing the work: a node, a replica, a download); 2 bad input (the cluster file or a
command-line argument: fix it and retry); 130 interrupted (Ctrl-C).

Errors that reach the command line::

    LlmgwError                 exit 1: something failed while doing the work
    ├── InputError             exit 2: the user's input is wrong; fix it and retry
    │   ├── SpecError          the cluster file has problems (all of them, located)
    │   └── UsageError         a command-line argument is wrong
    ├── TemplateError          a packaged template is missing or failed to render
    ├── NodeError              one node could not be reached or a command on it failed;
    │                          carries the node and a kind (unreachable, auth, hostkey-...)
    ├── ApplyFailed            ``apply``: some node or replica failed; the others were applied
    ├── DowntimeRefused        ``apply``: the plan leaves a model with no serving replica and
    │                          --allow-downtime was not given; nothing was changed
    ├── FetchFailed            ``fetch``: some weights could not be brought; the others were
    ├── LabError               the lab cluster could not be booted, changed or removed
    │   └── LabUnavailable     exit 2: this machine cannot run the lab (not Linux, not root,
    │                          a tool missing)
    └── Interrupted            exit 130: Ctrl-C (SIGINT) stopped the command where it was

The CLI maps these to messages and exit codes in one place
(``llmgw_cli.cli.main.main``). Anything else escaping is a bug and keeps its
traceback.

Errors handled where they arise, which never reach the command line (so they are not
``LlmgwError``: one escaping is a bug and keeps its traceback)::

    StartFailed                the gateway's controller could not start a replica
    NotLeader                  a gateway process that no longer leads was about to act on
                               the nodes (the fence check failed): the action is refused
    UpstreamError              the gateway could not ask an engine, or got no proper answer
    ├── ConnectFailed          no connection: nothing was sent; another replica may be tried
    ├── Disconnected           closed before any byte of the answer; ``reused``: a pooled
    │                          keep-alive connection (one retry on a fresh one is safe)
    ├── ReadTimeout            no byte for ``read_timeout`` seconds
    ├── BrokenAnswer           closed in the middle of the answer, or the answer is not HTTP
    └── AdapterNotLoaded       the engine refused to load a LoRA adapter the request names
    BadRequest                 a client's request body the gateway refuses (a 400)
    EngineStartError           the lab's simulated engine cannot start (its dying log line)
    RequestError               the lab's simulated engine answers a request with a 4xx

Two kinds of error live beside the code that raises them: those of the programs that run
on a node (``node/``: standard library only, they
cannot import this module), and private ones that one module raises and catches itself
(``_Refused`` in ``core/clusterfile/load.py``, ``_Dropped`` in ``remote/ssh.py``): they never leave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class ExitCode(IntEnum):
    """What the exit status of every llmgw command means."""

    ok = 0
    failed = 1
    bad_input = 2
    interrupted = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped


class LlmgwError(Exception):
    """Base of every deliberate llmgw error."""

    exit_code: ExitCode = ExitCode.failed


class InputError(LlmgwError):
    """The input is wrong; the message says what to change."""

    exit_code = ExitCode.bad_input


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


class ApplyFailed(LlmgwError):
    """``apply``: some node or replica failed; the others were applied."""


class DowntimeRefused(LlmgwError):
    """``apply``: carrying out the plan leaves a model with no serving replica for a while,
    and ``--allow-downtime`` was not given. Nothing was changed."""


class FetchFailed(LlmgwError):
    """``fetch``: some weights could not be brought; the others were."""


class LabError(LlmgwError):
    """The lab cluster (``llmgw lab ...``) failed; the message says which node and why."""


class LabUnavailable(LabError):
    """This machine cannot run the lab: not Linux, not root, or a required tool is missing."""

    exit_code = ExitCode.bad_input


class Interrupted(LlmgwError):
    """Ctrl-C (SIGINT) stopped the command where it was: what it had done stays done."""

    exit_code = ExitCode.interrupted


class StartFailed(Exception):
    """The controller's start of a replica could not happen (no room, a node refused) or
    never became ready."""


class StartBroken(StartFailed):
    """A start that failed after its units were written: where (``address``, ``nodes``),
    so the controller stops what it wrote."""

    def __init__(self, message: str, address: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.address = address
        self.nodes = nodes


class NotLeader(Exception):
    """This gateway process is not (or no longer) the cluster's leader: it must not touch
    the nodes. Raised by the fence check before a node action or under the cluster lock."""


class UpstreamError(Exception):
    """The engine could not be asked, or did not answer properly."""


class ConnectFailed(UpstreamError):
    """No connection (refused, unreachable, connect timeout): nothing was sent."""


class Disconnected(UpstreamError):
    """The connection closed before any byte of the answer; ``reused``: it was a pooled
    keep-alive connection (one retry on a fresh connection is safe)."""

    def __init__(self, message: str, *, reused: bool) -> None:
        super().__init__(message)
        self.reused = reused


class ReadTimeout(UpstreamError):
    """No byte from the engine for ``read_timeout`` seconds."""


class BrokenAnswer(UpstreamError):
    """The connection closed in the middle of the answer, or the answer is not HTTP."""


class AdapterNotLoaded(UpstreamError):
    """The engine did not load the LoRA adapter a request names (its answer says why)."""


class LimitError(ValueError):
    """A key limit's text that is no limit (``core/serving/limits.py``): the message names
    the option and its form."""


class BadRequest(Exception):
    """A client mistake in a request body (``gateway/serving/request_body.py``): answered 400 in
    the OpenAI format with this message, code and param."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


class EngineStartError(Exception):
    """The lab's simulated engine cannot start; the message is the log line it dies with."""


class RequestError(Exception):
    """A request the lab's simulated engine answers with 4xx; ``status`` and message as
    vLLM words them."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class LockTimeout(LlmgwError):
    """The cluster lock stayed held for longer than apply would wait."""


class HubError(Exception):
    """The Hub could not say what to fetch. ``kind``: not-found, revision, gated, auth,
    network, bad-answer, unsafe (a path refused), empty (no file kept by the selection)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Unpinned(ValueError):
    """A fetched repository model whose revision was not resolved to a commit: its
    snapshot folder is not known (``core/weights/pins.py``)."""


class BadSource(ValueError):
    """A repo source (``org/name[@revision]``) that is not one; the message says why."""


class BadPath(ValueError):
    """A repository file path that may not be written on a node; the message says why."""
