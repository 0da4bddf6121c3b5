"""Which replica of a model serves a request, decided alike in every gateway process
without shared state (pure).

Engines keep a prefix cache: a request whose prompt starts like an earlier one on the same
replica skips recomputing that start. So requests that share a prompt prefix go to the
same replica, chosen by rendezvous hashing on a key of that prefix: every process that
sees the same ready replicas picks the same one, and a replica that leaves moves only
the keys it held. A replica that is overloaded yields to the next in the key's order
(consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, 2016).

The key (``prefix_key``) is computed on a canonical text of the request body:

- chat (``messages``): for each message in order, its role, U+001F, its text, U+001E.
  A string content is its text; a list of content parts renders each part in order: a
  ``text`` part as its text, any other part as ``[`` + its type + ``]`` (so two requests
  that differ only in an image share a key: they land together, which is harmless);
- completions (``prompt``): a string as is; a list of strings or of token-id lists, its
  items rendered and joined with U+001E; a token id list as ids joined by spaces;
- any other body (embeddings' ``input``, a missing or malformed field): no key.

The text is cut into blocks of ``block_chars`` characters; only whole blocks count, up
to ``max_blocks``. The key is a BLAKE2b digest of those blocks' text, a function of
exactly those blocks as a chain of block hashes is. Fewer than ``min_blocks`` whole
blocks: no key. A conversation keeps its key while it grows once its start fills the
``max_blocks`` blocks; below that the key changes each time a block fills.

By default the key covers 4 blocks of 256 characters: the rendered prompt's first 1 KiB.
A longer cap would move every conversation shorter than the cap to a new key (and likely
a new replica, losing its prefix cache) each time a block fills; with 1 KiB most chat
requests (a system prompt and a turn or two) are past the cap from the start and keep
their key for the whole conversation. Conversations whose first KiB is the same (a shared
system prompt) share a key and land together; bounded load spreads them when that
replica fills.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from llmgw_cli.core.serving.engine_signals import Signals

BLOCK_CHARS = 256
MAX_BLOCKS = 4  # the key is the prompt's first 1 KiB (module docstring)
MIN_BLOCKS = 1
_UNIT = "\x1f"  # between a message's role and its text
_RECORD = "\x1e"  # after each message or prompt item


class Policy(StrEnum):
    prefix = "prefix"  # affinity on the prompt's prefix (or session), bounded by load
    least_load = "least_load"
    round_robin = "round_robin"


class Reason(StrEnum):
    affinity = "affinity"  # the key's first replica
    overloaded = "overloaded"  # the key's first replica was overloaded: another took it
    no_prefix = "no_prefix"  # no key: least loaded
    least_load = "least_load"
    round_robin = "round_robin"


class Candidate(NamedTuple):
    """A ready replica as the choice sees it: ``in_flight`` is the gateway's own count of
    requests outstanding on it (RoutedReplica.outstanding); ``signals`` the engine's
    last scrape, None when there is none fresh. A tuple: made for each ready replica on
    every request, where a frozen dataclass costs several times more to build."""

    address: str
    in_flight: int
    signals: Signals | None = None


@dataclass(frozen=True)
class Thresholds:
    """When a replica counts as overloaded: its engine queues more than ``max_waiting``
    requests, its KV cache is fuller than ``max_kv_usage``, or the gateway has more
    than (1 + ``epsilon``) x the mean in-flight of the candidates, plus one, on it."""

    max_waiting: float = 4.0
    max_kv_usage: float = 0.9
    epsilon: float = 0.25


class Choice(NamedTuple):
    address: str
    reason: Reason


def session_of(body: Mapping[str, object], header: str | None) -> str | None:
    """The session a request pins to: the ``x-session-id`` header's value, else the
    body's ``user`` field; None when neither is a non-empty string."""
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def request_key(
    body: Mapping[str, object],
    session: str | None,
    *,
    block_chars: int = BLOCK_CHARS,
    max_blocks: int = MAX_BLOCKS,
    min_blocks: int = MIN_BLOCKS,
) -> str | None:
    """The routing key: the session's when there is one, else the prompt prefix's."""
    if session:
        return "s:" + _digest(session)
    return prefix_key(body, block_chars=block_chars, max_blocks=max_blocks, min_blocks=min_blocks)


def prefix_key(
    body: Mapping[str, object],
    *,
    block_chars: int = BLOCK_CHARS,
    max_blocks: int = MAX_BLOCKS,
    min_blocks: int = MIN_BLOCKS,
) -> str | None:
    """The key of the body's prompt prefix (module docstring), or None when the body has
    no prompt or it is shorter than ``min_blocks`` whole blocks."""
    if block_chars < 1 or max_blocks < 1:
        raise ValueError("block_chars and max_blocks must be positive")
    limit = block_chars * max_blocks
    text = _render(body, limit)
    if text is None:
        return None
    blocks = min(len(text), limit) // block_chars
    if blocks < max(min_blocks, 1):
        return None
    return "p:" + _digest(text[: blocks * block_chars])


def rendezvous(key: str, addresses: Sequence[str]) -> list[str]:
    """The addresses in the key's order: highest weight first, the weight a stable hash
    of (key, address); ties (only for equal addresses) keep address order."""
    return sorted(addresses, key=lambda a: (-_weight(key, a), a))


def choose(
    policy: Policy | str,
    key: str | None,
    candidates: Sequence[Candidate],
    thresholds: Thresholds = Thresholds(),
    turn: int = 0,
) -> Choice | None:
    """The replica for one request and why, or None when there is no candidate.

    ``turn`` is the caller's request counter: it picks the round-robin replica and
    breaks ties between equally loaded ones, so the function keeps no state."""
    if not candidates:
        return None
    if not isinstance(policy, Policy):
        policy = Policy(policy)
    if len(candidates) == 1:
        return _only(policy, key, candidates[0], thresholds)
    if policy is Policy.round_robin:
        ordered = sorted(candidates, key=lambda c: c.address)
        return Choice(ordered[turn % len(ordered)].address, Reason.round_robin)
    if policy is Policy.least_load:
        return Choice(least_loaded(candidates, turn).address, Reason.least_load)
    if key is None:
        return Choice(least_loaded(candidates, turn).address, Reason.no_prefix)
    return _bounded(key, candidates, thresholds, turn)


def _only(policy: Policy, key: str | None, only: Candidate, thresholds: Thresholds) -> Choice:
    """The choice among one candidate, with the reason the general walk would give (the
    request path's common case: a model with one ready replica). Its in-flight count can
    never pass the bounded-load limit, (1 + epsilon) x itself + 1; its engine's signals can."""
    if policy is Policy.round_robin:
        return Choice(only.address, Reason.round_robin)
    if policy is Policy.least_load:
        return Choice(only.address, Reason.least_load)
    if key is None:
        return Choice(only.address, Reason.no_prefix)
    busy = overloaded(only, thresholds, (1 + thresholds.epsilon) * only.in_flight + 1)
    return Choice(only.address, Reason.overloaded if busy else Reason.affinity)


def _bounded(key: str, candidates: Sequence[Candidate], thresholds: Thresholds, turn: int) -> Choice:
    mean = sum(c.in_flight for c in candidates) / len(candidates)
    limit = (1 + thresholds.epsilon) * mean + 1
    by_address = {c.address: c for c in candidates}
    for rank, address in enumerate(rendezvous(key, list(by_address))):
        if not overloaded(by_address[address], thresholds, limit):
            return Choice(address, Reason.affinity if rank == 0 else Reason.overloaded)
    return Choice(least_loaded(candidates, turn).address, Reason.overloaded)


def overloaded(candidate: Candidate, thresholds: Thresholds, in_flight_limit: float) -> bool:
    """Whether the replica should not take one more request of its keys: its engine's
    queue or KV cache is past the threshold, or the gateway's in-flight is past the
    bounded-load limit."""
    s = candidate.signals
    if s is not None and s.waiting is not None and s.waiting > thresholds.max_waiting:
        return True
    if s is not None and s.kv_usage is not None and s.kv_usage > thresholds.max_kv_usage:
        return True
    return candidate.in_flight > in_flight_limit


def least_loaded(candidates: Sequence[Candidate], turn: int = 0) -> Candidate:
    """The candidate with the least load by its engine's signals: fewest waiting, then
    fewest running plus in flight, then least KV usage. A signal the engine did not give
    counts as 0, so a replica without signals is judged by its in-flight count alone.
    Equal loads: the candidate at ``turn`` in address order, or the next one after it."""
    ordered = sorted(candidates, key=lambda c: c.address)
    n = len(ordered)
    best = min(range(n), key=lambda i: (_load(ordered[i]), (i - turn) % n))
    return ordered[best]


def _load(c: Candidate) -> tuple[float, float, float]:
    s = c.signals or Signals()
    return (s.waiting or 0.0, (s.running or 0.0) + c.in_flight, s.kv_usage or 0.0)


def _weight(key: str, address: str) -> int:
    h = hashlib.blake2b(f"{key}\x00{address}".encode(errors="surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).hexdigest()


def _render(body: Mapping[str, object], limit: int) -> str | None:
    """The canonical text's first ``limit`` characters or more (rendering stops once
    past it); None when the body has no prompt of a known shape."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _render_messages(messages, limit)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _render_prompt_list(prompt, limit)
    return None


def _render_messages(messages: list[object], limit: int) -> str | None:
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, Mapping):
            return None
        role = message.get("role")
        piece = f"{role if isinstance(role, str) else ''}{_UNIT}{_content(message.get('content'))}{_RECORD}"
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(parts)


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
            out.append(text if isinstance(text, str) else "")
        elif isinstance(part, Mapping):
            out.append(f"[{part.get('type')}]")
    return "".join(out)


def _render_prompt_list(prompt: list[object], limit: int) -> str | None:
    if prompt and all(isinstance(t, int) for t in prompt):
        return _token_ids(prompt, limit)
    parts: list[str] = []
    size = 0
    for item in prompt:
        if isinstance(item, str):
            piece = item
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            piece = _token_ids(item, limit)
        else:
            return None
        parts.append(piece + _RECORD)
        size += len(piece) + 1
        if size >= limit:
            break
    return "".join(parts) if parts else None


def _token_ids(ids: list[object], limit: int) -> str:
    # A token id renders as at least 2 characters (digit and space): `limit` ids suffice.
    return " ".join(str(t) for t in ids[:limit])
