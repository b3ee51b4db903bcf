"""Differential: every head the fast lane takes (``api.lane_head``) is one aiohttp's own server parser
takes the same way: one request, the same method, path, version, body length, fields and keep-alive,
no decoding, no chunking, no upgrade. The lane is only a shortcut, so this is its whole contract."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpRequestParser
from aiohttp.web_protocol import RequestPayloadError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_manager.api.lane_head import MAX_HEAD, parse_head

MAX_BODY = 1000
# Names the lane reads, declines or counts once, in several spellings, and others.
NAMES = [b"Host", b"host", b"HOST", b"Content-Length", b"content-length", b"Authorization", b"Connection",
         b"X-Trajectory-Key", b"Transfer-Encoding", b"Content-Encoding", b"Expect", b"Upgrade",
         b"Sec-WebSocket-Key1", b"Content-Type", b"User-Agent", b"ETag", b"Max-Forwards", b"X-Other",
         b"Bad Name", b"", b"X\x00", b"X\x7f", b"X(", b"\xff"]
VALUES = [b"x", b"12", b"012", b" 12 ", b"+12", b"-1", b"12, 12", b"1" * 25, b"close", b"keep-alive",
          b"Close", b"upgrade", b"close, upgrade", b"chunked", b"gzip", b"identity", b"Bearer t",
          b"\t v \t", b"", b"h2c", b"100-continue", b"\xc3\xa9", b"\xff\xfe", b"a\x00b", b"a\x7fb", b"a\x01b"]
LINES = [b"POST /generate HTTP/1.1", b"POST /generate HTTP/1.0", b"POST /generate?x=1 HTTP/1.1",
         b"post /generate HTTP/1.1", b"POST  /generate HTTP/1.1", b"POST /generate HTTP/1.1 ",
         b"POST /generate HTTP/2.0", b"POST /generate#f HTTP/1.1", b"POST //generate HTTP/1.1"]
EOLS = [b"\r\n"] * 8 + [b"\n", b"\r", b"\r\r\n", b"\n\r"]

def mostly(common: bytes, *others: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """``common`` three times in four, else one of ``others``."""
    return st.integers(0, 3).flatmap(lambda n: st.just(common) if n else st.one_of(*others))


field = st.tuples(mostly(b"X-Other", st.sampled_from(NAMES), st.binary(min_size=1, max_size=5)),
                  mostly(b": ", st.sampled_from([b":", b" :", b":\t", b"::"])),
                  st.sampled_from(VALUES) | st.binary(max_size=8),
                  mostly(b"\r\n", st.sampled_from(EOLS)))


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """Mostly plain heads with a few fields added, altered or repeated, so both verdicts come often."""
    fields = [(b"Host", b": ", b"x", b"\r\n"), (b"Content-Length", b": ", b"12", b"\r\n")]
    for extra in draw(st.lists(field, max_size=4)):
        fields.insert(draw(st.integers(0, len(fields))), extra)
    if draw(st.integers(0, 9)) == 0:  # near aiohttp's limit of 128 fields
        fields += [(b"X-F%d" % i, b": ", b"v", b"\r\n") for i in range(draw(st.integers(120, 130)))]
    if draw(st.integers(0, 4)) == 0:
        del fields[draw(st.integers(0, len(fields) - 1))]
    line = draw(st.sampled_from(LINES)) if draw(st.integers(0, 3)) == 0 else LINES[0]
    out = line + draw(st.sampled_from(EOLS))
    for name, sep, value, eol in fields:
        out += name + sep + value + eol
    return out + draw(mostly(b"\r\n", st.sampled_from(EOLS)))


def aiohttp_parse(data: bytes) -> Iterator[tuple[object, bytes]]:
    """Each request aiohttp's server parser reads from ``data`` with the server's limits: (message, body)."""
    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(BaseProtocol(loop), loop, 2**16, max_line_size=8190, max_headers=128,
                                   max_field_size=8190, payload_exception=RequestPayloadError,
                                   auto_decompress=True)
        messages, upgraded, tail = parser.feed_data(data)
        assert not upgraded and not tail
        for message, payload in messages:
            yield message, payload.read_nowait(-1)
    finally:
        loop.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
def test_every_head_the_lane_takes_aiohttp_takes_the_same_way(head):
    if parse_head(head, MAX_BODY) is not None:
        assert_aiohttp_reads_it_the_same_way(head)


def assert_aiohttp_reads_it_the_same_way(head: bytes) -> None:
    taken = parse_head(head, MAX_BODY)
    assert taken is not None
    body = b"b" * taken.length  # after the first empty line: what follows it in ``head`` is not this head
    parsed = list(aiohttp_parse(head[:taken.size] + body))  # raises (400 on aiohttp's server) if it refuses
    assert len(parsed) == 1
    message, got_body = parsed[0]
    assert (message.method, message.path, message.version) == ("POST", "/generate", (1, 1))
    assert not message.chunked and not message.upgrade and message.compression is None
    assert message.should_close == (not taken.keep_alive)
    assert got_body == body
    assert taken.size <= min(len(head), MAX_HEAD + 4) and head[taken.size - 4:taken.size] == b"\r\n\r\n"
    for name, value in taken.fields.items():
        assert message.headers.getall(name) == [value]
    assert "host" in taken.fields and int(message.headers["Content-Length"]) == taken.length


@pytest.mark.parametrize("head", [
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nhost: \r\ncontent-length: 012\r\nConnection: close, te\r\nX: \xc3\xa9 \t\r\n\r\n",
])
def test_the_differential_test_sees_taken_heads(head):
    """The property above is empty if the lane takes nothing: these heads it must take."""
    assert_aiohttp_reads_it_the_same_way(head)
