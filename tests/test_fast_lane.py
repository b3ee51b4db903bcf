"""The fast lane for plain non-streaming POST /generate (``api.fast_lane``): it answers exactly what
aiohttp's path answers, hands everything else to aiohttp with every byte, and keeps order, keep-alive,
``Connection: close`` and a caller's disconnect as aiohttp does."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import pytest
from support import async_wait_until

from rollout_manager.api.lane_head import HeadReader, parse_head
from rollout_manager.cpu_engine.model import build_model, reference_generate

TOKEN = "lane-t0ken"
PLAIN = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 12"


@pytest.fixture(scope="module")
def model():
    return build_model(0)


@pytest.mark.parametrize("head, taken", [
    (PLAIN, True),
    (PLAIN + b"\r\nconnection: close\r\nX-Trajectory-Key:  t1 \t\r\nAuthorization: Bearer x", True),
    (PLAIN + b"\r\nX-Content-Length: 5\r\nUpgrade-Insecure-Requests: 1", True),  # other fields, alike names
    (PLAIN.replace(b"HTTP/1.1", b"HTTP/1.0"), False),  # keep-alive rules of 1.0: aiohttp's business
    (PLAIN.replace(b"/generate", b"/generate?x=1"), False),
    (PLAIN.replace(b"POST", b"PUT"), False),
    (PLAIN + b"\r\nTransfer-Encoding: chunked", False),
    (PLAIN + b"\r\nExpect: 100-continue", False),
    (PLAIN + b"\r\nupgrade: h2c", False),
    (PLAIN + b"\r\nContent-Encoding: gzip", False),  # aiohttp would decode the body
    (PLAIN + b"\r\nX-Trajectory-Key: a\r\nx-trajectory-key: b", False),  # which one? aiohttp decides
    (PLAIN + b"\r\nContent-Length: 12", False),  # duplicated framing
    (PLAIN + b"\r\nHost: y", False),  # two Hosts: aiohttp answers 400
    (PLAIN.replace(b"Host: x\r\n", b""), False),  # no Host: aiohttp answers 400
    (PLAIN + b"".join(b"\r\nX-%d: v" % i for i in range(126)), False),  # 129 fields: aiohttp's limit is 128
    (PLAIN + b"".join(b"\r\nX-%d: v" % i for i in range(125)), True),  # 128
    (PLAIN + b"\r\n folded: value", False),  # obsolete line folding
    (PLAIN + b"\r\nBad Name: v", False),
    (PLAIN + b"\r\nX: a\x01b", False),  # a control byte
    (PLAIN + b"\r\nX: a\nY: b", False),  # a bare LF
    (PLAIN.replace(b"Content-Length: 12", b"Content-Length: +12"), False),
    (PLAIN.replace(b"Content-Length: 12", b"Content-Length: " + b"1" * 4301), False),
    (PLAIN.replace(b"Content-Length: 12", b"Content-Length: 99999"), False),  # over the body limit
    (PLAIN.replace(b"\r\nContent-Length: 12", b""), False),
])
def test_the_lane_takes_only_the_plain_request(head, taken):
    parsed = parse_head(head + b"\r\n\r\n", max_body=1000)
    assert (parsed is not None) == taken
    if parsed is not None:
        assert parsed.length == 12 and parsed.fields["content-length"] == "12"
        assert parsed.size == len(head) + 4
        if b"Bearer" in head:
            assert parsed.fields == {"host": "x", "content-length": "12", "connection": "close",
                                     "x-trajectory-key": "t1", "authorization": "Bearer x"}
            assert not parsed.keep_alive


@pytest.mark.parametrize("start, verdict", [
    (b"G", False),  # another route: aiohttp's from the first byte
    (b"POST /generate HTTP/1.1\nHost: x\n\n", False),  # bare LF: aiohttp's at once, not at the header timeout
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nX: a\n", False),
    (b"POST /gen", None),  # may still be a lane request: wait
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nX-A: b", None),
])
def test_a_head_is_handed_over_as_soon_as_its_bytes_show_it_is_not_the_lanes(start, verdict):
    assert HeadReader(1000).feed(bytearray(start)) is verdict


def test_a_head_fed_a_byte_at_a_time_is_read_as_one_fed_at_once():
    reader = HeadReader(1000)
    data = PLAIN + b"\r\nAuthorization: Bearer x\r\n\r\n{}"
    buf = bytearray()
    got = None
    while got is None:
        buf.append(data[len(buf)])
        got = reader.feed(buf)
    assert got is not False and got.size == len(buf) == len(PLAIN) + 29
    assert got.fields == parse_head(data, 1000).fields


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length body (what both paths give non-streaming callers)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
    return int(lines[0].split()[1]), headers, body


def request(body: Any, *, extra: bytes = b"", token: str = TOKEN) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
    return (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth + extra
            + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def generate_body(prompt: list[int], n: int = 6) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}}


async def open_raw(m: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", int(m.url.rsplit(":", 1)[1]))


@pytest.mark.slow
async def test_pipelined_requests_keep_their_order_and_the_first_other_route_goes_to_aiohttp(
        start_manager, start_engines, model):
    m = await start_manager(auth_token=TOKEN)
    engines = await start_engines([])
    await m.register(*engines)
    reader, writer = await open_raw(m)
    try:
        writer.write(request(generate_body([5, 6, 7], 9)) + request(generate_body([8])) +
                     b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + request(generate_body([9, 9], 4)))
        answers = [await read_answer(reader) for _ in range(4)]
    finally:
        writer.close()
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert json.loads(answers[0][2])["output_ids"] == reference_generate(model, [5, 6, 7], 9)[0]
    assert json.loads(answers[1][2])["output_ids"] == reference_generate(model, [8], 6)[0]
    assert json.loads(answers[2][2])["status"] == "healthy"
    assert json.loads(answers[3][2])["output_ids"] == reference_generate(model, [9, 9], 4)[0]
    # the lane answered the first two; aiohttp (which names itself) the rest of the connection
    assert [("server" in headers) for _, headers, _ in answers] == [False, False, True, True]
    samples = await scrape(m)
    assert samples[("rollout_manager_fast_lane_requests_total", ())] == 2
    assert samples[("rollout_manager_fast_lane_handovers_total", ())] >= 1  # this one, and the admin calls'
    assert samples[("rollout_manager_client_connections", (("phase", "busy"),))] >= 1  # the scrape itself
    assert samples[("rollout_manager_client_connections_closed_total", (("reason", "refused"),))] == 0


async def scrape(m: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    async with m.session.get(m.url + "/metrics", headers=m.headers) as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


CASES: list[tuple[str, bytes]] = [
    ("plain", request(generate_body([1, 2, 3]))),
    ("no token", request(generate_body([1]), token="")),
    ("wrong token", request(generate_body([1]), token="nope")),
    ("not JSON", request(b'{"input_ids": [1,')),
    ("empty", request(b"")),
    ("bad field", request({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}})),
    ("bad item", request({"input_ids": [1, "a"], "sampling_params": {}})),
    ("too deep", request({"input_ids": [1], "sampling_params": {"custom_params": json.loads("[" * 200 + "]" * 200)}})),
    ("long trajectory key", request(generate_body([1]), extra=b"X-Trajectory-Key: " + b"k" * 5000 + b"\r\n")),
    ("prompt too long for the engine", request(generate_body(list(range(1, 5000)), 8))),
]


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False])
async def test_every_answer_is_the_one_aiohttps_path_gives(start_manager, start_engines, fast):
    """The same requests, one keep-alive connection, with the lane on and off: same statuses and errors,
    and the connection keeps working after each refusal."""
    m = await start_manager(auth_token=TOKEN, http_fast_generate=str(fast).lower())
    engines = await start_engines(["--context-length", "256"])
    await m.register(*engines)
    reader, writer = await open_raw(m)
    got = {}
    try:
        for name, raw in CASES:
            writer.write(raw)
            status, _, body = await read_answer(reader)
            answer = json.loads(body)
            got[name] = (status, answer.get("error"))
    finally:
        writer.close()
    assert got["plain"] == (200, None)
    assert got["no token"][0] == got["wrong token"][0] == 401
    assert got["not JSON"][0] == got["empty"][0] == 400
    assert got["bad field"][0] == 400 and "max_new_tokens" in got["bad field"][1]
    assert got["bad item"][0] == 400 and "input_ids" in got["bad item"][1]
    assert got["too deep"][0] == 400 and "custom_params" in got["too deep"][1]
    assert got["long trajectory key"][0] == 400 and "X-Trajectory-Key" in got["long trajectory key"][1]
    assert got["prompt too long for the engine"][0] == 400
    test_every_answer_is_the_one_aiohttps_path_gives.seen[fast] = got  # type: ignore[attr-defined]
    if len(test_every_answer_is_the_one_aiohttps_path_gives.seen) == 2:  # type: ignore[attr-defined]
        on, off = (test_every_answer_is_the_one_aiohttps_path_gives.seen[k] for k in (True, False))  # type: ignore[attr-defined]
        assert on == off


test_every_answer_is_the_one_aiohttps_path_gives.seen = {}  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_connection_close_is_honoured_and_a_streaming_request_is_streamed(start_manager, start_engines, model):
    m = await start_manager()
    engines = await start_engines([])
    await m.register(*engines)
    reader, writer = await open_raw(m)
    try:
        writer.write(request({**generate_body([4, 4], 5), "stream": True}, token=""))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        stream = b""
        while b"data: [DONE]" not in stream:
            stream += await asyncio.wait_for(reader.read(65536), 30)
    finally:
        writer.close()
    reader, writer = await open_raw(m)
    try:
        writer.write(request(generate_body([4, 4], 5), extra=b"Connection: close\r\n", token=""))
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers.get("connection") == "close"
        assert json.loads(body)["output_ids"] == reference_generate(model, [4, 4], 5)[0]
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the manager closed it
    finally:
        writer.close()


@pytest.mark.slow
async def test_a_caller_that_leaves_has_its_sequence_aborted_on_the_instance(start_manager, start_engines):
    m = await start_manager()
    (engine,) = await start_engines(["--token-delay-s", "0.05"])
    await m.register(engine)

    reader, writer = await open_raw(m)
    writer.write(request(generate_body([3], 400), token=""))
    await async_wait_until(lambda: running_on(m, engine, 1), message="the sequence running on the engine")
    writer.close()
    await async_wait_until(lambda: running_on(m, engine, 0), message="the engine aborted it")
    inst = (await m.status())["instances"][0]
    assert inst["in_flight"] == 0


async def running_on(m: Any, engine: Any, n: int) -> bool:
    """Whether ``engine`` runs exactly ``n`` sequences now (its /server_info)."""
    async with m.session.get(engine.url + "/server_info") as r:
        return (await r.json())["cpu_engine"]["running"] == n


@pytest.mark.slow
async def test_an_idle_lane_connection_is_closed_after_the_keepalive_timeout(start_manager, start_engines, model):
    m = await start_manager(http_keepalive_timeout_s="1")
    engines = await start_engines([])
    await m.register(*engines)
    reader, writer = await open_raw(m)
    try:
        writer.write(request(generate_body([2, 7], 3), token=""))
        status, headers, body = await read_answer(reader)
        assert status == 200 and "server" not in headers  # the lane's answer
        assert json.loads(body)["output_ids"] == reference_generate(model, [2, 7], 3)[0]
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then closed by the guard, idle
    finally:
        writer.close()


@pytest.mark.slow
async def test_sigterm_answers_a_lane_request_that_outlives_the_grace_with_503(start_manager, start_engines):
    m = await start_manager(shutdown_grace_s="1")
    (engine,) = await start_engines(["--token-delay-s", "0.05"])
    await m.register(engine)

    reader, writer = await open_raw(m)
    try:
        writer.write(request(generate_body([1], 400), token=""))  # ~20 s: outlives the grace
        await async_wait_until(lambda: running_on(m, engine, 1), message="the sequence running on the engine")
        m.proc.signal(signal.SIGTERM)
        status, _, body = await read_answer(reader)
    finally:
        writer.close()
    assert status == 503 and "shutting down" in json.loads(body)["error"]
    assert m.proc.wait(20) == 0
