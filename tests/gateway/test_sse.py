"""Reading engine answers as bytes (``gateway/serving/sse.py``): usage, and the stream a client gets.

The property tests split one valid stream into reads every which way: the client must get
the same bytes and the meter the same usage as from the stream in one read.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_cli.gateway.serving.sse import (
    TAIL_BYTES,
    StreamRelay,
    StreamUsage,
    body_usage,
    stream_usage,
    without_usage_event,
)

pytestmark = pytest.mark.any_loop  # pure code: bytes in, bytes and usage out

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def relayed(reads: list[bytes], *, hide_usage: bool, prompt_estimate: int = 0) -> tuple[bytes, StreamUsage]:
    relay = StreamRelay(hide_usage=hide_usage)
    sent = b"".join(relay.feed(read) for read in reads) + relay.rest()
    return sent, relay.usage(prompt_estimate)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def test_stream_usage_reads_the_last_usage_chunk() -> None:
    tail = (
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert stream_usage(tail) == (7, 3)
    assert stream_usage(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') == (0, 0)
    assert stream_usage(b'ge":{"prompt_tokens":7}}\n\ndata: [DONE]\n\n') == (0, 0)  # cut-off start


def test_body_usage_reads_the_usage_object_without_parsing() -> None:
    answer = {
        "object": "list",
        "data": [{"embedding": [0.1] * 50, "index": 0}],
        "usage": {"prompt_tokens": 12, "total_tokens": 12},
    }
    assert body_usage(json.dumps(answer).encode()) == (12, 0)
    chat = {
        "choices": [{"message": {"content": '"usage": {"prompt_tokens": 99}'}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 9},
    }
    assert body_usage(json.dumps(chat).encode()) == (4, 9)
    assert body_usage(b'{"error": {"message": "bad"}}') == (0, 0)


def test_the_usage_event_asked_for_by_the_gateway_is_taken_out() -> None:
    assert without_usage_event(CONTENT + USAGE + DONE) == CONTENT + DONE
    assert without_usage_event(USAGE) == b""
    assert without_usage_event(CONTENT) == CONTENT
    # usage inside the text of a normal chunk is content, not the usage event
    text = b'data: {"choices":[{"delta":{"content":"\\"usage\\": []"}}],"usage":null}\n\n'
    assert without_usage_event(text) == text
    # an event without its blank line is not recognised: the relay hands over whole ones
    assert without_usage_event(DONE + USAGE[:-2]) == DONE + USAGE[:-2]


def test_a_usage_event_split_across_reads_is_taken_out() -> None:
    at = USAGE.index(b"usage") + 2  # the key itself split
    sent, usage = relayed([CONTENT + USAGE[:at], USAGE[at:] + DONE], hide_usage=True)
    assert sent == CONTENT + DONE
    assert usage == StreamUsage(5, 3, estimated=False, done=True)


def test_a_stream_without_usage_is_estimated_from_its_events() -> None:
    sent, usage = relayed([CONTENT * 4, DONE], hide_usage=True, prompt_estimate=9)
    assert sent == CONTENT * 4 + DONE
    assert usage == StreamUsage(9, 4, estimated=True, done=True)  # [DONE] is no token
    _, cut = relayed([CONTENT * 2, CONTENT[:10]], hide_usage=True, prompt_estimate=9)
    assert cut == StreamUsage(9, 3, estimated=True, done=False)


def test_usage_is_found_after_a_long_stream_in_small_reads() -> None:
    stream = CONTENT * (2 * TAIL_BYTES // len(CONTENT)) + USAGE + DONE
    reads = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    sent, usage = relayed(reads, hide_usage=True)
    assert sent == stream.replace(USAGE, b"")
    assert (usage.prompt, usage.completion) == (5, 3)


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ['"usage"', '{"choices":[]}', "\n\n", "data: [DONE]", "\\", "data:"]
)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, bytes, tuple[int, int] | None, int, bool]:
    """A stream as vLLM, SGLang or llama-server write it, what a client that did not ask
    for usage gets of it, its usage event's figures (None: none), its `data:` events, and
    whether it reached [DONE]."""
    events: list[bytes] = []
    for text in draw(st.lists(TEXT, max_size=8)):
        chunk: dict[str, object] = {"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]}
        if draw(st.booleans()):
            chunk["usage"] = None  # vLLM's continuous usage field, off
        ascii_only = draw(st.booleans())
        events.append(b"data: " + json.dumps(chunk, ensure_ascii=ascii_only).encode() + b"\n\n")
    shown = list(events)
    figures = None
    if draw(st.booleans()):
        figures = (draw(st.integers(1, 10**6)), draw(st.integers(0, 10**6)))  # 0, 0 reads as none
        usage = {"prompt_tokens": figures[0], "completion_tokens": figures[1], "total_tokens": sum(figures)}
        events.append(b"data: " + json.dumps({"id": "c", "choices": [], "usage": usage}).encode() + b"\n\n")
    done = draw(st.booleans())
    if done:
        events.append(DONE)
        shown.append(DONE)
    return b"".join(events), b"".join(shown), figures, len(events), done


@settings(max_examples=400, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10**6), max_size=12), hide_usage=st.booleans())
def test_any_split_into_reads_gives_the_same_bytes_and_usage(
    stream: tuple[bytes, bytes, tuple[int, int] | None, int, bool], cuts: list[int], hide_usage: bool
) -> None:
    data, shown, figures, events, done = stream
    whole = relayed([data] if data else [], hide_usage=hide_usage, prompt_estimate=11)
    assert relayed(split(data, cuts), hide_usage=hide_usage, prompt_estimate=11) == whole
    sent, usage = whole
    assert sent == (shown if hide_usage else data)
    if figures is not None:
        assert usage == StreamUsage(*figures, estimated=False, done=done)
    else:
        assert usage == StreamUsage(11, events - done, estimated=True, done=done)


@settings(max_examples=200, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_every_whole_event_reaches_the_client_with_its_read(
    stream: tuple[bytes, bytes, tuple[int, int] | None, int, bool], cuts: list[int]
) -> None:
    """Holding back a split event delays nothing a client could use: after each read, the
    client has every event that read completed (an SSE client acts at the blank line)."""
    data = stream[0]
    relay = StreamRelay(hide_usage=True)
    sent, seen = b"", 0
    for read in split(data, cuts):
        sent += relay.feed(read)
        seen += len(read)
        whole = data[: data.rfind(b"\n\n", 0, seen) + 2] if b"\n\n" in data[:seen] else b""
        assert sent == relayed([whole], hide_usage=True)[0]


@settings(max_examples=100, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_a_stream_with_crlf_line_ends_passes_through(
    stream: tuple[bytes, bytes, tuple[int, int] | None, int, bool], cuts: list[int]
) -> None:
    data = stream[0].replace(b"\n\n", b"\r\n\r\n")
    relay = StreamRelay(hide_usage=True)
    sent, seen = b"", 0
    for read in split(data, cuts):
        sent += relay.feed(read)
        seen += len(read)
        # only a first line that is not whole yet is held
        assert sent == (data[:seen] if b"\n" in data[:seen] else b"")
    assert sent + relay.rest() == data
