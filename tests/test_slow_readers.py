"""Callers that stop reading a streamed answer (issue 18, "slow readers"), against a real daemon.

A raw socket with a tiny receive buffer sends a valid request and never reads. The manager must not
keep producing output for it: a batch starts no new requests while its output waits (their results
would only pile up in memory), and after ``response_write_timeout_s`` without progress the connection
is closed, its unfinished sequences aborted on their instances, and everything it held released.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import async_wait_until

pytestmark = pytest.mark.slow  # every test here starts real processes

WRITE_TIMEOUT_S = 1.5
BATCH = 4000


async def metrics(m: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with m.session.get(m.url + "/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def stalled_request(port: int, path: str, body: Any) -> socket.socket:
    """Send one request from a socket that will never read its answer."""
    raw = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel keeps a couple of kB at most
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (path.encode(), len(raw)) + raw)
    return s


def closed_by_peer(s: socket.socket, timeout_s: float) -> bool:
    """Read what the kernel kept until the manager's close shows (EOF or reset); False at the timeout."""
    s.settimeout(timeout_s)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


async def disconnected(m: Any, endpoint: str) -> bool:
    return metric(await metrics(m), "rollout_manager_slow_reader_disconnects_total", endpoint=endpoint) == 1


async def released(m: Any) -> bool:
    st = await m.status()
    adm = st["admission"]
    return (adm["in_flight"], adm["requests_waiting"], adm["held_by_batches"]) == (0, 0, 0) and \
        all(i["in_flight"] == 0 for i in st["instances"])


async def engines_idle(session: Any, engines: list[Any]) -> bool:
    for e in engines:
        async with session.get(e.url + "/server_info") as r:
            info = (await r.json())["cpu_engine"]
        if info["running"] or info["queued"]:
            return False
    return True


async def still_serves(m: Any) -> None:
    status, out = await m.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(out["output_ids"]) == 2, out


async def test_a_batch_whose_caller_stops_reading_stops_and_is_closed(start_manager, start_engines) -> None:
    engines = await start_engines(*[["--max-running-requests", "32"]] * 2)
    m = await start_manager(response_write_timeout_s=str(WRITE_TIMEOUT_S), max_unsent_output_kb="16")
    await m.register(*engines)
    # About 1.2 kB per result (a long id, eight tokens with log-probs): ~5 MB in all, well past what the
    # loopback socket buffers hold, so the manager's writes block long before the batch could finish.
    body = [[f"{k:06d}" + "x" * 494, {"input_ids": [1 + k % 50, 2, 3], "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 8}}] for k in range(BATCH)]
    port = int(m.url.rsplit(":", 1)[1])
    sock = await asyncio.to_thread(stalled_request, port, "/batch_generate_requests", body)
    try:
        # Stalled: the batch stops starting requests and holds the rest back.
        await async_wait_until(lambda: _held(m), 60, interval_s=0.1, message="the batch to hold requests back")
        await async_wait_until(lambda: disconnected(m, "/batch_generate_requests"), 30, interval_s=0.1,
                               message="the stalled caller to be disconnected")
        assert await asyncio.to_thread(closed_by_peer, sock, 10)
    finally:
        sock.close()
    await async_wait_until(lambda: released(m), 10, message="everything the batch held to be released")
    started = metric(await metrics(m), "rollout_manager_sequences_total")
    assert started is not None and started < BATCH / 2, started  # it never ran ahead of its reader
    await still_serves(m)


async def _held(m: Any) -> bool:
    value = metric(await metrics(m), "rollout_manager_requests_held_by_batches")
    return value is not None and value > 0


async def test_a_stream_whose_caller_stops_reading_is_closed_and_aborted(start_manager, start_engines) -> None:
    # Long sequences (1000 tokens at >= 10 ms each): left alone they would run for over 10 s.
    engines = await start_engines(["--token-delay-s", "0.01"])
    m = await start_manager(response_write_timeout_s=str(WRITE_TIMEOUT_S))
    await m.register(*engines)
    body = {"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "stream_interval": 1}}
    port = int(m.url.rsplit(":", 1)[1])
    sock = await asyncio.to_thread(stalled_request, port, "/generate", body)
    try:
        await async_wait_until(lambda: disconnected(m, "/generate"), 30, interval_s=0.1,
                               message="the stalled caller to be disconnected")
        assert await asyncio.to_thread(closed_by_peer, sock, 10)
    finally:
        sock.close()
    # Aborted on the engine, not left to run to its end.
    await async_wait_until(lambda: engines_idle(m.session, engines), 5, message="the engine to be idle")
    await async_wait_until(lambda: released(m), 5, message="the manager to hold nothing for the caller")
    await still_serves(m)
