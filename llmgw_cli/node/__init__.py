"""Everything that runs ON A NODE, as root: the node helper and the weights fetcher.

Standard library only, and nothing of llmgw outside this package (a test parses every
module's imports): the node has python3 and nothing else of ours. The control host reads
these sources in one place, ``remote/node_code.py``, and ships them two ways:

- ``helper.py`` alone, as ``/usr/local/libexec/llmgw/node-helper`` (root, 0755, the
  node's python3 in its first line), or piped to ``python3 -I -`` as root by ``apply``
  (``piped``). It imports no other module of this package.
- The fetcher, ``FETCHER_MODULES`` joined in that order into one source (their
  ``from llmgw_cli.node...`` and ``from __future__`` lines dropped, one
  ``from __future__`` put first): installed as ``/usr/local/libexec/llmgw/nodefetch.py``
  (root, 0644), which the helper's ``fetch`` verb runs, or piped to ``python3 -`` with a
  ``main(<job>)`` line. Their imports of each other are for the tests and the type
  checker here; on the node the joined modules share one namespace, so no two of them
  may define the same top-level name (a test checks that too).

The interface: verbs in, JSON out.

Helper (``node-helper VERB ARGS...``, from ``$SSH_ORIGINAL_COMMAND`` or argv; exit status
0 when done, 2 with a line on stderr when refused; see ``helper.py`` for the checks):

- ``probe``: the probe script's sections (text, ``core/observe/parse/probe.py`` reads them);
- ``kernel-xids``: ``@source journal|dmesg|unreadable``, then NVIDIA's XID report lines of
  this boot's kernel log, each behind ``@xid `` (read as root; the probe section ``xids``);
- ``date``: seconds since the epoch;
- ``show UNIT...``: ``systemctl show`` of ``SHOW_PROPERTIES`` (key=value lines);
- ``journal UNIT SINCE LINES``: the unit's journal lines;
- ``stop|start|restart|remove UNIT...``, ``write-unit UNIT`` (unit text on stdin),
  ``daemon-reload``: systemd's own output; ``remove`` deletes the unit's drain marker
  (``/var/lib/llmgw-drain/<unit>``, ``core/planning/drain.py``) with its unit file;
- ``drain-mark UNIT SECONDS``: the replica's drain marker, its deadline this node's clock
  plus SECONDS (printed); ``drain-clear UNIT...``: the markers removed;
- ``held PATH...``: the files of these that exist, not empty, one a line;
- ``exists PATH...``: one JSON line ``{PATH: {"kind", "empty", "unreadable", ...}}``;
- ``fetch``: a JSON job on stdin for the installed fetcher (below), bounded by the
  node's ``/etc/llmgw/node-helper.json``.

Fetcher (a JSON job ``{"mode": M, ...}`` on stdin; JSON lines on stdout, an error as
``{"state": "error", "kind": K, "message": M}``):

- ``fetch`` (``target``, ``url``, ``size``, ``sha256``, ...): ``started``, ``attached``
  or ``present``; ``poll``: ``{"free", "status"}``, the detached job's status file;
  ``verify``: ``absent``, ``mismatch``, ``unchecked``, or ``{"state", "sha256"}``;
- ``serve`` (``file``, ``bind``, ``secret``, ``idle``): ``{"state": "serving", "port",
  "pid"}``;
- ``snapshot``, ``poll-snapshot``, ``verify-snapshot``, ``serve-snapshot`` (``folder``,
  ``repo``, ``commit``, ``files``): the same answers for a whole repository at one commit
  (``core/weights/snapshot.py`` builds these jobs and reads the answers).

Versions: the control host never asks a node which version it runs. It compares the
sha256 of every file it installs with what is on the node (``core/hosts/node_access.py``
``helper_stale``) and installs again on any difference, so a node always runs the
helper and fetcher of the llmgw that last ran ``apply``. ``VERSION`` names the interface
above; the helper and the fetcher carry a copy of it in their text (so a change of it
alone changes their digests), and it goes up when a verb, a mode or an answer changes
in a way an older control host would misread.
"""

VERSION = 1

FETCHER_MODULES = ("repo_path", "fetch_disk", "fetch_http", "fetch_snapshot", "fetch_serve", "fetch_main")
"""The fetcher's modules in the order they are joined: each after those it uses."""
