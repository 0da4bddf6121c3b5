"""The access log's queue: ``write`` only queues (a full queue drops the line and counts
it), the writer encodes and writes, ``close`` writes whatever is still queued."""

from __future__ import annotations

import io
import json
import os
import select

from llmgw_cli.gateway.serving.accesslog import FIELDS, AccessLog, encode
from tests.waiting import wait_until


class Broken(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        raise BrokenPipeError("stderr is gone")


def _line(n: int, asked: str = "m") -> tuple[object, ...]:
    values: dict[str, object] = dict.fromkeys(FIELDS, "-")
    values.update(ts=1700000000.123456, status=200, first_byte_ms=1.23456, ms=n + 0.0004, asked=asked)
    values.update(
        stream=False, usage_estimated=False, cut=False, prompt_tokens=5, completion_tokens=3, attempts=1
    )
    return tuple(values[f] for f in FIELDS)


def test_a_full_queue_drops_lines_and_counts_them_once() -> None:
    stream = io.BytesIO()
    log = AccessLog(stream, capacity=3)
    told: list[int] = []
    log.on_drop = told.append
    for n in range(5):
        log.write(_line(n))
    assert (len(log.queue), log.dropped, stream.getvalue()) == (3, 2, b"")  # nothing written yet
    log.flush()
    assert [json.loads(x)["ms"] for x in stream.getvalue().splitlines()] == [0.0, 1.0, 2.0]
    assert told == [2]
    log.write(_line(5))  # room again
    log.flush()
    assert told == [2] and len(stream.getvalue().splitlines()) == 4


def test_a_line_is_encoded_by_the_writer_from_the_values_in_order() -> None:
    stream = io.BytesIO()
    log = AccessLog(stream)
    hostile = 'x"\n{"status":500}\u2028'  # a client's model name: data, on one line
    log.write(_line(7, asked=hostile))
    log.flush()
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert list(record) == list(FIELDS)
    assert (record["asked"], record["status"]) == (hostile, 200)
    assert (record["ts"], record["first_byte_ms"], record["ms"]) == (1700000000.123, 1.235, 7.0)


def test_a_tuple_is_written_as_json_writes_the_dict_of_its_fields() -> None:
    for asked in ("m", 'x"\n\\', "mod\u00e8le", "\ud800", "\x00\x1f\x7f", "</script>"):
        for flag in (True, False):
            values = dict(zip(FIELDS, _line(3, asked=asked), strict=True))
            values.update(stream=flag, usage_estimated=not flag, cut=flag)
            expected = {**values, **{f: round(values[f], 3) for f in ("ts", "first_byte_ms", "ms")}}  # type: ignore[call-overload]
            line = tuple(values.values())
            assert encode(line) == json.dumps(expected, separators=(",", ":")).encode() + b"\n"


def test_lines_a_failed_write_lost_are_counted() -> None:
    log = AccessLog(Broken(), select.PIPE_BUF)  # type: ignore[arg-type]
    told: list[int] = []
    log.on_drop = told.append
    for n in range(10):
        log.write(_line(n))
    log.flush()  # no exception reaches the caller (the writer thread, which must go on)
    assert (log.lost, told, len(log.queue)) == (10, [10], 0)


def test_close_writes_everything_still_queued() -> None:
    stream = io.BytesIO()
    log = AccessLog(stream, select.PIPE_BUF, interval=3600)  # the writer would wait an hour
    log.start()
    for n in range(1000):
        log.write(_line(n))
    log.close()
    lines = stream.getvalue().splitlines()
    assert [json.loads(x)["ms"] for x in lines] == [float(n) for n in range(1000)]
    assert log.dropped == 0


def test_a_filling_queue_wakes_the_writer_before_its_interval() -> None:
    stream = io.BytesIO()
    log = AccessLog(stream, capacity=8, interval=3600)
    log.start()
    try:
        for n in range(3):  # a quarter of the queue (2) was queued when the third came
            log.write(_line(n))
        wait_until(
            lambda: len(stream.getvalue().splitlines()) == 3,
            timeout=30,
            what="the writer to write the lines without waiting its interval",
        )
    finally:
        log.close()


def test_a_workers_pieces_go_to_the_descriptor_in_one_write_each() -> None:
    """Not through the stream's buffer, where another log line could join a piece."""
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "wb")
    log = AccessLog(stream, select.PIPE_BUF)
    try:
        stream.write(b"not flushed: stays in the buffer\n")
        for n in range(100):
            log.write(_line(n))
        log.flush()
        got = b""
        while got.count(b"\n") < 100:
            got += os.read(read_end, 65536)
        assert [json.loads(x)["ms"] for x in got.splitlines()] == [float(n) for n in range(100)]
    finally:
        stream.close()
        os.close(read_end)
