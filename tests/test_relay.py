"""The lean ``/generate`` relay (rollout_manager.sglang.relay): keep-alive pools, the retry of a kept
connection the server closed, what is never reused, and its failures, against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from rollout_manager.sglang import relay as rl
from rollout_manager.sglang.client import (
    CallBounds,
    EngineFailed,
    EngineRejected,
    generate_once,
    stream_generate,
)
from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.generate_request import SequenceBody, encode
from rollout_manager.sglang.local_limits import LocalLimits
from rollout_manager.sglang.sse import sse_frame
from rollout_manager.sglang.wire import DONE_FRAME

BOUNDS = CallBounds(connect_timeout_s=2.0, stall_timeout_s=5.0)
FINAL = {"text": "", "output_ids": [7], "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 1},
                                                      "prompt_tokens": 1, "completion_tokens": 1}}


def chunked(*parts: bytes, end: bool = True) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return body + (b"0\r\n\r\n" if end else b"")


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
STREAM = STREAM_HEAD + chunked(sse_frame(FINAL), DONE_FRAME)
ONCE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def once_answer(extra: bytes = b"") -> bytes:
    import json
    body = json.dumps(FINAL).encode()
    return ONCE.replace(b"\r\n\r\n", extra + b"\r\n\r\n") % len(body) + body


Handler = Callable[[int, int, bytes, asyncio.StreamWriter], Awaitable[None]]


class Engine:
    """A scripted engine: ``handler(connection number, request number on it, request body, writer)`` answers
    each request; counts connections."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []  # of the requests, as received
        self.closed = asyncio.Event()  # a connection of ours saw the client close it
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        try:
            for i in range(1000):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed.set()
                    return
                self.heads.append(head)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await self.handler(n, i, await reader.readexactly(length), writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    async def start(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@contextlib.asynccontextmanager
async def relayed(handler: Handler, **relay_args: Any) -> AsyncIterator[tuple[Engine, aiohttp.ClientSession, rl.Relay]]:
    engine = await Engine(handler).start()
    relay = rl.Relay(**relay_args)
    session = aiohttp.ClientSession()
    rl.attach(session, relay)
    try:
        yield engine, session, relay
    finally:
        relay.close()
        await session.close()
        await engine.stop()


ONE = SequenceBody.of({"input_ids": [1]})


async def ids(session: aiohttp.ClientSession, url: str, bounds: CallBounds = BOUNDS) -> list[list[int]]:
    return [c.ids for c in [c async for c in stream_generate(session, url, ONE, bounds)]]


async def poll(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_calls_to_one_instance_share_a_kept_alive_connection() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(once_answer() if b'"once"' in body else STREAM)

    async with relayed(answer) as (engine, session, relay):
        assert await ids(session, engine.url) == [[7]]
        await poll(lambda: bool(relay.idle))  # the stream's end may come after its [DONE] frame
        chunk = await generate_once(session, engine.url, SequenceBody.of({"input_ids": [1], "rid": "once"}), BOUNDS)
        assert list(chunk.ids) == [7]
        assert await ids(session, engine.url) == [[7]]
        assert engine.connections == 1
        # Three at once need three; all three are kept for the next calls (up to max_idle).
        assert await asyncio.gather(*(ids(session, engine.url) for _ in range(3))) == [[[7]]] * 3
        assert engine.connections == 3
        await poll(lambda: sum(map(len, relay.idle.values())) == 3)


async def test_at_most_max_idle_connections_are_kept_per_instance() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(once_answer())

    async with relayed(answer, max_idle=2) as (engine, session, relay):
        await asyncio.gather(*(generate_once(session, engine.url, ONE, BOUNDS) for _ in range(4)))
        assert engine.connections == 4
        assert [len(c) for c in relay.idle.values()] == [2]


async def test_a_kept_connection_the_server_closed_is_retried_once_on_a_fresh_one() -> None:
    """As uvicorn does at its keep-alive timeout: the connection closes just as the next request goes
    out, before any byte of an answer. The request goes again on a fresh connection and succeeds."""
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        if n == 1 and i == 1:
            writer.close()  # the second request on the first connection: closed without an answer
            return
        writer.write(once_answer())

    async with relayed(answer) as (engine, session, relay):
        await generate_once(session, engine.url, ONE, BOUNDS)
        chunk = await generate_once(session, engine.url, ONE, BOUNDS)
        assert list(chunk.ids) == [7] and engine.connections == 2


async def test_a_fresh_connection_closed_without_an_answer_is_the_instances_failure() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with relayed(answer) as (engine, session, relay):
        with pytest.raises(EngineFailed) as failed:
            await ids(session, engine.url)
        assert str(failed.value).startswith("the instance closed the connection without an answer (the engine died")
        assert engine.connections == 1  # no retry: a fresh connection proves the instance closed it


async def test_answers_that_said_connection_close_or_were_not_read_to_the_end_are_not_reused() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            writer.write(once_answer(b"\r\nConnection: close"))  # and keeps the socket open
        elif n == 2:
            writer.write(STREAM_HEAD + chunked(sse_frame({**FINAL, "meta_info": {"id": "r"}}), end=False))
        else:
            writer.write(once_answer())

    async with relayed(answer) as (engine, session, relay):
        await generate_once(session, engine.url, ONE, BOUNDS)
        assert not relay.idle
        async with contextlib.aclosing(stream_generate(session, engine.url, ONE, BOUNDS)) as chunks:
            async for _ in chunks:
                break  # the caller stops after one chunk: the rest of the answer is still owed
        assert not relay.idle
        await generate_once(session, engine.url, ONE, BOUNDS)
        assert engine.connections == 3


async def test_idle_connections_close_before_the_servers_keep_alive_and_with_the_relay() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(once_answer())

    assert rl.IDLE_TIMEOUT_S < 5.0  # uvicorn's default keep-alive, SGLang's too
    async with relayed(answer, idle_timeout_s=0.2) as (engine, session, relay):
        await generate_once(session, engine.url, ONE, BOUNDS)
        assert relay.idle
        await asyncio.wait_for(engine.closed.wait(), 5)  # the server saw the relay close it
        assert not relay.idle
    async with relayed(answer) as (engine, session, relay):
        await generate_once(session, engine.url, ONE, BOUNDS)
        assert relay.idle
        relay.close()
        await asyncio.wait_for(engine.closed.wait(), 5)
        assert not relay.idle


async def test_a_stall_on_a_reused_connection_is_bounded_and_the_connection_dropped() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        if i == 0:
            writer.write(once_answer())
        else:
            writer.write(STREAM_HEAD)  # then nothing

    bounds = CallBounds(connect_timeout_s=2.0, stall_timeout_s=0.3)
    async with relayed(answer) as (engine, session, relay):
        await generate_once(session, engine.url, ONE, bounds)
        with pytest.raises(EngineFailed) as failed:
            await ids(session, engine.url, bounds)
        assert str(failed.value).startswith("no first chunk after 0.")
        assert not relay.idle and engine.connections == 1
        await asyncio.wait_for(engine.closed.wait(), 5)


async def test_a_reset_before_the_answer_and_a_non_200_with_a_body() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        if n == 1:  # a reset: RST instead of FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif n == 2:
            error = b'{"error": {"message": "bad sampling params"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error))
        else:
            error = b"engine on fire"
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error))

    async with relayed(answer, max_idle=0) as (engine, session, relay):
        with pytest.raises(EngineFailed) as failed:
            await ids(session, engine.url)
        assert str(failed.value).startswith("connection to the instance failed (ConnectionResetError"), failed.value
        with pytest.raises(EngineRejected) as rejected:
            await ids(session, engine.url)
        assert rejected.value.status == 400 and rejected.value.error == EngineError(400, "bad sampling params")
        with pytest.raises(EngineFailed, match="HTTP 503: engine on fire"):
            await generate_once(session, engine.url, ONE, BOUNDS)


async def test_the_managers_own_out_of_descriptors_waits_and_blames_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM)

    async with relayed(answer, idle_timeout_s=60) as (engine, session, relay):
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        failures = [OSError(errno.EMFILE, "Too many open files")] * 2

        async def limited(*args: Any, **kwargs: Any) -> Any:
            if failures:
                raise failures.pop()
            return await real(*args, **kwargs)

        other = await Engine(answer).start()
        assert await ids(session, other.url) == [[7]]
        await poll(lambda: bool(relay.idle))  # kept: it gives its descriptor back when the manager runs out
        monkeypatch.setattr(loop, "create_connection", limited)
        limits = LocalLimits()
        bounds = CallBounds(connect_timeout_s=2.0, stall_timeout_s=5.0, limits=limits)
        assert await ids(session, engine.url, bounds) == [[7]]
        assert limits.events == 2 and (limits.last_error or "").startswith("EMFILE")
        await asyncio.wait_for(other.closed.wait(), 5)
        assert not relay.idle or list(relay.idle) == [("http", "127.0.0.1", int(engine.url.rsplit(":", 1)[1]))]
        await other.stop()


async def test_connect_refused_is_the_instances_failure() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineFailed, match=r"^cannot connect to the instance \(ConnectionRefusedError"):
            await ids(session, f"http://127.0.0.1:{port}")


async def test_a_closed_connection_is_freed_without_waiting_for_the_garbage_collector() -> None:
    """The daemon collects garbage rarely (osutil.tune_gc): a connection and its parser, which refer
    to each other, must not wait for a collection to give back their memory."""
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM)

    def alive() -> int:
        return sum(type(o) is rl.Connection for o in gc.get_objects())

    gc.collect()
    before = alive()
    gc.disable()
    try:
        async with relayed(answer, max_idle=0) as (engine, session, relay):
            for _ in range(3):
                assert await ids(session, engine.url) == [[7]]
            await poll(lambda: alive() == before)
    finally:
        gc.enable()


async def test_the_request_carries_the_base_urls_path_host_and_headers() -> None:
    async def answer(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(once_answer())

    async with relayed(answer) as (engine, session, relay):
        bounds = CallBounds(connect_timeout_s=2.0, stall_timeout_s=5.0,
                            headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        await generate_once(session, engine.url + "/under", ONE, bounds)
        host = engine.url.removeprefix("http://").encode()
        assert engine.heads == [b"POST /under/generate HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: "
                                b"application/json\r\nAuthorization: Bearer k\r\nContent-Length: "
                                + str(len(encode(ONE))).encode() + b"\r\n\r\n"]


def answered_when_set() -> tuple[asyncio.Event, Callable[..., Awaitable[None]]]:
    """An engine handler that answers every call with STREAM only once the event is set."""
    answer = asyncio.Event()

    async def late(n: int, i: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        await answer.wait()
        writer.write(STREAM)
        await writer.drain()

    return answer, late


async def test_a_call_waiting_for_its_answer_keeps_no_copy_of_the_encoded_body() -> None:
    """orjson's output sits in a 4 KiB buffer whatever its length: 50 calls waiting for their answers'
    heads keep only the request they sent (head and body, exact size), not the encoded body beside it."""
    import tracemalloc

    answer, late = answered_when_set()

    async with relayed(late) as (engine, session, _):
        tracemalloc.start(16)
        try:
            # Patient bounds: tracemalloc slows everything, and this test is about memory, not timing (on a
            # loaded machine the default 5 s for the first byte ran out before the answer was let go).
            patient = CallBounds(connect_timeout_s=2.0, stall_timeout_s=120.0)
            calls = [asyncio.ensure_future(ids(session, engine.url, patient)) for _ in range(50)]
            await poll(lambda: len(engine.heads) == 50)  # every request sent, no answer yet
            held = sum(t.size for t in tracemalloc.take_snapshot().traces
                       if any(f.filename.endswith("generate_request.py") for f in t.traceback))
        finally:
            tracemalloc.stop()
        answer.set()
        assert await asyncio.gather(*calls) == [[[7]]] * 50
    assert held < 50 * 1024, f"{held} bytes of encoded bodies held by 50 waiting calls"


async def test_calls_waiting_for_their_heads_hold_no_closures_and_no_frame_of_open_stream() -> None:
    """What lives only while thousands of calls connect and wait for their heads is left as holes in
    Python's allocator once they stream: a call waiting for its head holds no closure of the relay's and
    no coroutine of ``open_stream`` or of a wait of its own, and none keeps its request once it was sent."""
    import types

    answer, late = answered_when_set()

    async with relayed(late) as (engine, session, relay):
        calls = [asyncio.ensure_future(ids(session, engine.url)) for _ in range(20)]
        await poll(lambda: len(engine.heads) == 20)  # every request sent, no answer yet
        gc.collect()
        live = gc.get_objects()  # by exact type: isinstance would read __class__ of every object (torch warns)
        closures = [o for o in live if type(o) is types.FunctionType and o.__code__.co_filename == rl.__file__
                    and "<" in o.__qualname__]  # lambdas and nested functions, not the module's own
        frames = [o.cr_code.co_name for o in live if type(o) is types.CoroutineType]
        conns = [o for o in live if type(o) is rl.Connection and o.relay is relay]
        assert closures == []
        assert frames.count("open_stream") == 0 and frames.count("_wait") == 0
        assert sum(o.cr_code is rl.Relay.open.__code__ for o in live if type(o) is types.CoroutineType) == 20
        assert len(conns) == 20 and all(c.request is None for c in conns)
        answer.set()
        assert await asyncio.gather(*calls) == [[[7]]] * 20
