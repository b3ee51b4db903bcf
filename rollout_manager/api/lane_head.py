"""The head of a fast-lane request, read by llhttp (``httptools``) as its bytes arrive.

The lane takes a request only when aiohttp would take it the same way (``fast_lane``), so its head is
parsed by llhttp in strict mode, the parser aiohttp's own server is built on, and on top of it the rules
aiohttp adds (``aiohttp/_http_parser.pyx``): a ``Host`` field in every HTTP/1.1 request, at most 128
fields, singleton fields at most once. Then the lane's own narrower rules: the request line exactly
``POST /generate HTTP/1.1``, one ``Content-Length`` within the body limit, none of the fields that ask
for something the lane does not implement. A head is handed to aiohttp as soon as its bytes show it is
not one of these (a bare LF, another route: at the first byte that differs), never after a wait.
``tests/test_lane_head.py`` checks with hypothesis that every head taken here parses the same in
aiohttp's parser.
"""

from __future__ import annotations

from typing import Final, Literal

import httptools

REQUEST_LINE: Final = b"POST /generate HTTP/1.1\r\n"
MAX_HEAD: Final = 8190  # aiohttp's line and field limit: a longer head is aiohttp's to answer
MAX_FIELDS: Final = 128  # aiohttp's max_headers: one more and it answers 400
# The fields the lane and the route read (names lower-cased), each taken at most once.
READ: Final = frozenset({b"host", b"content-length", b"connection", b"authorization", b"x-trajectory-key"})
# Fields that ask for what the lane does not do (a decoded body, a protocol switch, a 100 Continue):
# aiohttp's path answers them.
DECLINED: Final = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade",
                             b"sec-websocket-key1"})
# aiohttp refuses a second one of these (``http_parser.SINGLETON_HEADERS``).
SINGLETONS: Final = frozenset({b"content-length", b"content-location", b"content-range", b"content-type",
                               b"etag", b"host", b"max-forwards", b"server", b"transfer-encoding",
                               b"user-agent"})
ONCE: Final = READ | SINGLETONS
MAX_LENGTH_DIGITS: Final = 18  # the most a Content-Length may have, here and on aiohttp's path (api.http)

HAND_OVER: Final = False  # what :meth:`HeadReader.feed` returns for a request that aiohttp must answer


class LaneHead:
    """A complete head the lane takes: the fields read (lower-case names, values as aiohttp decodes
    them), where the body starts, its length, and whether the connection stays open after it."""

    __slots__ = ("fields", "size", "length", "keep_alive")

    def __init__(self, fields: dict[str, str], size: int, length: int, keep_alive: bool) -> None:
        self.fields, self.size, self.length, self.keep_alive = fields, size, length, keep_alive


class _Fields:
    """What llhttp reports of a head (its ``on_header`` callbacks). Apart from :class:`HeadReader` so
    that the parser, which holds it, is not in a reference cycle that only the collector would free."""

    __slots__ = ("fields", "seen", "count", "complete", "declined")

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}
        self.seen: set[bytes] = set()
        self.count = 0
        self.complete = False
        self.declined = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.count += 1
        key = name.lower()
        if key in ONCE:
            if key in self.seen:
                self.declined = True
            self.seen.add(key)
            if key in READ:  # llhttp strips the whitespace before a value, aiohttp the one after it too
                self.fields[key.decode("ascii")] = value.rstrip(b" \t").decode("utf-8", "surrogateescape")
        elif key in DECLINED:
            self.declined = True

    def on_headers_complete(self) -> None:
        self.complete = True


class HeadReader:
    """One request's head, fed as it arrives."""

    __slots__ = ("parser", "got", "max_body", "fed")

    def __init__(self, max_body: int) -> None:
        self.got = _Fields()
        self.parser = httptools.HttpRequestParser(self.got)
        self.max_body = max_body
        self.fed = 0  # bytes of the buffer already given to the parser

    def feed(self, buf: bytearray) -> LaneHead | Literal[False] | None:
        """``buf`` holds this request from its first byte (and whatever follows). The head when it is
        complete and the lane takes it, ``HAND_OVER`` as soon as the bytes show it is not one the lane
        takes, None while it may still be."""
        fed = self.fed
        if fed < len(REQUEST_LINE):
            n = min(len(buf), len(REQUEST_LINE))
            if buf[:n] != REQUEST_LINE[:n]:
                return HAND_OVER
        end = buf.find(b"\r\n\r\n", max(fed - 3, 0), MAX_HEAD + 4)
        stop = end + 4 if end >= 0 else min(len(buf), MAX_HEAD + 4)
        if stop > fed:  # only the head: the body is the lane's to count, and what follows is not this request
            try:
                self.parser.feed_data(buf[fed:stop])
            except httptools.HttpParserError:
                return HAND_OVER
            self.fed = stop
        got = self.got
        if end < 0:
            return HAND_OVER if len(buf) > MAX_HEAD or got.count > MAX_FIELDS or got.declined else None
        if not got.complete or got.declined or got.count > MAX_FIELDS or b"host" not in got.seen:
            return HAND_OVER
        text = got.fields.get("content-length", "")  # llhttp let through only digits (and no overflow)
        if not (0 < len(text) <= MAX_LENGTH_DIGITS and text.isascii() and text.isdigit()):
            return HAND_OVER
        length = int(text)
        if length > self.max_body:
            return HAND_OVER
        return LaneHead(got.fields, stop, length, self.parser.should_keep_alive())


def parse_head(data: bytes, max_body: int) -> LaneHead | None:
    """The head at the start of ``data`` if the lane takes it, else None (tests and the benchmark)."""
    head = HeadReader(max_body).feed(bytearray(data))
    return head if isinstance(head, LaneHead) else None
