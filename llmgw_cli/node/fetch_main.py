"""Runs ON A NODE, not on the control host: download one file, or serve one to peers.

The weights fetcher's entry: ``main`` picks the mode of a job. Standard library only
(the node has python3 and nothing of llmgw). The fetcher is the ``FETCHER_MODULES`` of
``node/__init__.py`` joined into one source, this one last. Its input is data, a JSON
job: the control host pipes that source to ``python3 -`` with one more line,
``main(<job>)``; installed on a node it runs as ``python3 nodefetch.py < job.json``. Either
way the job (a token included) travels on stdin, never on a command line.

``fetch``: the file is written beside its target as ``<target>.part`` and renamed only
when its size and sha256 check out, so a partial file is never visible under the final
name. An interruption resumes with ``Range`` + ``If-Range`` (206 appends, 200 restarts
from zero, 416 finishes or restarts); a resumed file is hashed whole before the rename.
A ``flock`` on a hidden lock file beside the target makes concurrent fetches of one file
on one node one download: the second caller attaches to the first one's status instead of
downloading again. An existing target is accepted only once it matches the pinned
sha256 (a file never checked is hashed by the detached job first, state ``verifying``);
one that does not is downloaded again and replaced only by a verified copy.

The download runs in a detached process (double fork), so it survives the control host
going away; its progress is a small JSON status file beside the target, rewritten twice a
second, which the control host polls (``poll``). Hidden files (``.name.*``) are ignored by
the weights scan.

``verify``: whether an existing target matches a sha256 (``quick``: only from what was
remembered). Hashing a large file takes minutes, so a hashed file is remembered in
``.name.fetch-verified`` together with its inode, size, mtime and ctime; no account but
root can set a ctime back, so a changed file is always hashed again.

``serve``: a read-only HTTP server on an ephemeral port of the job's ``bind`` address
(the node's address on its fabric; never every interface) that answers only
``/<secret>/<name>`` (a secret of at least 32 characters) with that one file (HEAD, GET, single ranges, If-Range), and exits
after ``idle`` seconds without a request, or when killed. Peers copy from it.

``snapshot`` (a whole Hugging Face repository at one commit; not used by ``llmgw fetch``
or ``apply`` yet): the files of the job go into ``<folder>/<commit>/<path>``, each through
the ``fetch`` machinery (partial file, resume, size, sha256 or git blob id, rename), one
after the other in one detached job with one status file; the manifest
``<folder>/<commit>.manifest.json`` is written last, atomically, once every file is in
place and checked, so a snapshot without it is incomplete. The partial files and the
record of what was hashed live in a hidden work folder beside the snapshot folder, which
holds only the repository's names. Every path is checked again here (``check_snapshot_path``)
and every folder of it is entered without following a link. ``verify-snapshot`` says
whether the manifest is there and every file in place (``full``: hashed too);
``poll-snapshot`` reads the job's status as ``poll`` does a file's. With ``peer``, the
job's URLs are another node's ``serve-snapshot``: a 503 there means "not there yet" and is
asked again (``waiting`` in the status) for as long as it lasts; a 404, or a peer that
cannot be reached, fails the job with kind ``peer``. No token goes to a peer.

``serve-snapshot``: ``serve`` for a snapshot's files, ``/<secret>/<quoted repo path>``,
each as soon as it is in place, so peers copy a file while the rest is still coming; a file
not there yet answers 503 with ``Retry-After`` while this node's job of the snapshot runs
(its lock is held), 404 once it does not.

Trust: this runs as root, in folders that other accounts (the engines' account, other
clients of a shared filer) may be able to write. Everything found there is hostile:

- The folder is reached from ``/`` one component at a time (``openat``), never through a
  symbolic link that an account other than root (or the fetcher's own) owns, and every
  folder on the way must be owned by root, the fetcher's account or ``nobody`` (what root
  is mapped to on a root-squashed NFS export) and not writable by group or others unless
  sticky. Anything else is refused with the path and what to change; nothing is written.
- Every file in the folder is opened relative to that folder's descriptor with
  ``O_NOFOLLOW`` (a planted symbolic link fails with ELOOP) and checked after opening:
  a regular file, owned by one of those accounts, with one link (a planted hard link to a
  root file has two). A file is never truncated before that check.
- Renames (``rename(2)``) replace the name itself, never a file a planted link points to.
- A token goes only over https, and only to the scheme, host and port it was given for;
  a redirect to plain http is refused, whatever host it names. A snapshot's token goes to
  its ``token_origin`` (the Hub endpoint) only, over https, or plain http to this node's
  own loopback (a local mirror); the Hub's redirects to its CDN never carry it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from llmgw_cli.node.fetch_http import fetch, poll, verify
from llmgw_cli.node.fetch_serve import serve, serve_snapshot
from llmgw_cli.node.fetch_snapshot import poll_snapshot, snapshot, verify_snapshot

VERSION = 1  # the interface's (node/__init__.py): shipped in this text, so in its digest

MODES = {
    "fetch": fetch,
    "verify": verify,
    "poll": poll,
    "serve": serve,
    "snapshot": snapshot,
    "verify-snapshot": verify_snapshot,
    "poll-snapshot": poll_snapshot,
    "serve-snapshot": serve_snapshot,
}


def main(config: dict[str, Any]) -> None:
    mode = MODES.get(str(config.get("mode")))
    if mode is None:
        raise SystemExit(f"unknown mode {config.get('mode')!r}; one of {', '.join(MODES)}")
    mode(config)


if __name__ == "__main__" and sys.argv[0] != "-":  # piped as `python3 -`, a main() line follows
    main(json.load(sys.stdin))
