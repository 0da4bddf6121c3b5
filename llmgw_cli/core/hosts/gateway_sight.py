"""Whether the installed gateway can run the llmgw its unit names (pure: the probe's
script, and its output and the unit in, the problems out).

``llmgw-gateway.service`` runs ``gateway.llmgw_bin`` (else the ``llmgw`` on the host's
PATH) as the gateway's own account, inside the unit's sandbox. Root seeing that file
proves nothing: a virtual environment under ``/var/tmp`` is hidden by ``PrivateTmp=``,
one under ``/root`` is unreadable to any other account. Such a gateway never starts
(``203/EXEC``, or a Python that cannot import llmgw), so ``plan`` and ``apply`` look
first, before anything is changed, at every file the service needs: the executable and
what it resolves to, its interpreter (the ``#!`` line, resolved), and the folders Python
imports llmgw and its libraries from, as the gateway's account imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_cli.core.hosts.sandbox import unseen

# Run as root on the gateway host: ``sh -s -- LLMGW_BIN ACCOUNT``. One line per finding,
# "KIND<TAB>VALUE": the paths to hold against the sandbox (executable, interpreter,
# package, library), the account the runs were made as (stand-in: the gateway's account
# does not exist yet, an unprivileged one stood in), and what that account could not do
# (denied). runuser applies no sandbox: the paths are checked against it here, apart.
SIGHT_SCRIPT = r"""set -u
bin=$1 acct=$2
say() { printf '%s\t%s\n' "$1" "$2"; }
say executable "$bin"
real=$(readlink -f -- "$bin" 2>/dev/null) && [ "$real" != "$bin" ] && say executable "$real"
first=$(head -n 1 -- "$bin" 2>/dev/null | head -c 512)
case $first in '#!'*) set -f; set -- ${first#??}; set +f ;; *) set -- ;; esac
interp=${1:-}
if [ "${interp##*/}" = env ] && [ $# -ge 2 ]; then interp=$(command -v -- "$2" || printf '%s' "$2"); fi
if [ -n "$interp" ]; then
  say interpreter "$interp"
  real=$(readlink -f -- "$interp" 2>/dev/null) && [ "$real" != "$interp" ] && say interpreter "$real"
fi
id -u -- "$acct" >/dev/null 2>&1 || { say stand-in "$acct"; acct=nobody; }
say account "$acct"
cd /
as() { runuser -u "$acct" -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
as test -x "$bin" || say denied "run the executable $bin"
case ${interp##*/} in
  python*)
    probe='import os, sys
import llmgw_cli
print("package\t" + os.path.realpath(os.path.dirname(llmgw_cli.__file__)))
for p in sys.path:
    if p and os.path.isdir(p):
        print("library\t" + os.path.realpath(p))'
    if out=$(as "$interp" -c "$probe" 2>&1); then printf '%s\n' "$out"
    else say denied "import llmgw with $interp: $(printf '%s' "$out" | tail -n 1)"; fi ;;
esac
"""

WHAT = {
    "executable": "the executable",
    "interpreter": "its interpreter",
    "package": "the llmgw package",
    "library": "the Python library folder",
}


@dataclass(frozen=True)
class Sight:
    """What the probe found: the paths the service needs, the account the runs were
    made as (``stand_in``: the gateway's own account, which does not exist yet, when
    another stood in for it), and what that account could not do."""

    paths: tuple[tuple[str, str], ...]
    account: str
    stand_in: str = ""
    denied: tuple[str, ...] = ()


def read_sight(output: str) -> Sight:
    paths: list[tuple[str, str]] = []
    denied: list[str] = []
    account = stand_in = ""
    for line in output.splitlines():
        kind, tab, value = line.partition("\t")
        if not tab:
            continue
        if kind in WHAT and (kind, value) not in paths:
            paths.append((kind, value))
        elif kind == "denied":
            denied.append(value)
        elif kind == "account":
            account = value
        elif kind == "stand-in":
            stand_in = value
    return Sight(tuple(paths), account, stand_in, tuple(denied))


def sight_problems(unit_text: str, sight: Sight) -> list[str]:
    """Why the unit's service could not run llmgw, one line each ([] when it can)."""
    problems = [
        f"{WHAT[what]} {path} is hidden from the service by its unit's {directive}"
        for what, path, directive in unseen(unit_text, sight.paths)
    ]
    who = sight.account
    if sight.stand_in:
        who = f"an unprivileged account ({sight.stand_in} does not exist yet; {sight.account} stood in)"
    problems += [f"{who} cannot {denied}" for denied in sight.denied]
    return problems


def sight_refusal(host: str, llmgw_bin: str, problems: list[str], version: str) -> str:
    """The message that refuses to install a gateway unit that could not run llmgw."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return (
        f"the gateway unit on {host} would run {llmgw_bin}, which it cannot:\n{lines}\n"
        "Nothing was changed. Install llmgw where the service can see it and its account can "
        f"read it (not under /tmp, /var/tmp, /home or /root), e.g. on {host}: "
        f"python3 -m venv /opt/llmgw && /opt/llmgw/bin/pip install llmgw=={version}; "
        "then set gateway.llmgw_bin: /opt/llmgw/bin/llmgw in the cluster file"
    )
