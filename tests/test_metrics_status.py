"""GET /metrics (Prometheus) and the live status page at GET /, against real daemons and CPU engines.

The page is checked the way a person would see it: headless Chromium renders it (the JS polls the
manager), dumps the DOM and takes a screenshot, which is decoded here and must not be blank.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import struct
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from support import Box, free_port

from rollout_manager.api import status_page
from rollout_manager.cpu_engine.model import build_model
from rollout_manager.metrics import LATENCY_BUCKETS, EventHistogram
from rollout_manager.weights.sender_agent import SenderAgent

CHROMIUM = "/usr/bin/chromium"
SENDER_IPS = ["127.0.0.1", "127.0.0.2"]
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium) to test the status page",
)


# ------------------------------------------------------------------ helpers
async def scrape(m) -> tuple[str, dict[str, list]]:
    """GET /metrics -> (content type, {sample name: [(labels, value), ...]}), parsed by prometheus_client."""
    async with m.session.get(m.url + "/metrics") as r:
        assert r.status == 200
        ctype, text = r.headers["Content-Type"], await r.text()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("rollout_manager_") and family.documentation, family
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return ctype, samples


def value(samples: dict[str, list], name: str, **labels: str) -> float | None:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


@pytest.fixture
async def rig(start_manager, tmp_path):
    """A manager with one sender (two groups, one per loopback IP) and a way to add rollout boxes."""
    sender_port = free_port()
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8",
                            weight_transport="tcp")
    sender = SenderAgent(SENDER_IPS, sender_port).start()
    boxes: list[Box] = []

    async def add_boxes(n: int) -> list[Box]:
        new = [Box(tmp_path) for _ in range(n)]
        boxes.extend(new)
        await asyncio.gather(*(b.ready() for b in new))
        await m.register(*new)
        return new

    try:
        status, _ = await m.put_senders([SENDER_IPS], 2, engines=1)
        assert status == 200
        yield m, sender, add_boxes
    finally:  # boxes first: nothing may outlive the test, whatever failed
        for box in boxes:
            box.stop()
        sender.stop()


async def push_version(m, sender: SenderAgent, version: int) -> None:
    await asyncio.to_thread(sender.stage, build_model(100 + version).state_dict(), version)
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
    assert status == 200 and not res["timed_out"], res


async def generate(m, input_ids, n: int) -> object:
    status, out = await m.post("/generate", {"input_ids": input_ids,
                                             "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    assert status == 200, out
    return out


# ------------------------------------------------------------------ /metrics
@pytest.mark.slow
async def test_metrics_show_instances_generation_latency_versions_and_pushes(rig):
    m, sender, add_boxes = rig
    boxes = await add_boxes(2)
    ctype, s = await scrape(m)
    assert ctype.startswith("text/plain; version=0.0.4")
    assert value(s, "rollout_manager_instances", state="active", kind="remote") == 2
    assert value(s, "rollout_manager_instances", state="pending", kind="remote") == 0
    assert value(s, "rollout_manager_generated_tokens_total") == 0
    assert value(s, "rollout_manager_sequence_latency_seconds_count", outcome="ok") == 0

    batched = await generate(m, [[1, 2, 3], [4, 5], [6]], 12)  # 3 sequences
    single = [await generate(m, [7, 8, 9], 5) for _ in range(2)]  # 2 more
    outputs = [*batched, *single]
    ctype, s = await scrape(m)
    assert value(s, "rollout_manager_sequences_total") == 5
    tokens = sum(len(o["output_ids"]) for o in outputs)
    assert tokens > 0 and value(s, "rollout_manager_generated_tokens_total") == tokens
    assert value(s, "rollout_manager_sequence_latency_seconds_count", outcome="ok") == 5
    assert value(s, "rollout_manager_sequence_latency_seconds_count", outcome="error") == 0
    assert value(s, "rollout_manager_sequence_latency_seconds_bucket", outcome="ok", le="+Inf") == 5
    assert 0 < value(s, "rollout_manager_sequence_latency_seconds_sum", outcome="ok") < 60
    assert value(s, "rollout_manager_sequence_completion_tokens_sum") == tokens
    assert value(s, "rollout_manager_continuations_total") == 0
    assert value(s, "rollout_manager_failed_sequences_total") == 0
    assert value(s, "rollout_manager_preempted_sequences_total") == 0
    assert value(s, "rollout_manager_weight_version") == 0
    for box in boxes:
        assert value(s, "rollout_manager_instance_weight_version", endpoint=box.endpoint) == 0
        assert value(s, "rollout_manager_instance_weight_version_lag", endpoint=box.endpoint) == 0
        assert value(s, "rollout_manager_instance_in_flight_requests", endpoint=box.endpoint) == 0
        assert value(s, "rollout_manager_instance_info", endpoint=box.endpoint, state="active", kind="remote") == 1
    assert value(s, "rollout_manager_local_budget_seconds") > 0
    assert value(s, "rollout_manager_instance_transitions_total", to="active") == 2
    assert value(s, "rollout_manager_requests_waiting_for_instance") == 0
    assert value(s, "rollout_manager_streamed_tokens_total") == tokens
    st = await m.status()
    assert st["generation"]["streamed_tokens"] == tokens and st["requests_waiting_for_instance"] == 0
    # the manager's own stalls (none need have happened; each longest block is part of the total)
    blocked, longest = (value(s, "rollout_manager_event_loop_blocked_seconds_total"),
                        value(s, "rollout_manager_event_loop_longest_block_seconds"))
    assert blocked >= longest >= 0 and st["manager"]["event_loop_blocked_s"] >= blocked - 0.001

    await push_version(m, sender, 1)
    ctype, s = await scrape(m)
    assert value(s, "rollout_manager_weight_version") == 1
    groups = {(b["sender"], b["group"]) for b in (await m.status())["instances"]}
    assert groups == {(0, 0), (0, 1)}  # one box per group
    for group in ("0", "1"):
        assert value(s, "rollout_manager_weight_push_seconds_count", sender="0", group=group) == 1
        assert value(s, "rollout_manager_weight_push_seconds_sum", sender="0", group=group) > 0
        assert value(s, "rollout_manager_weight_push_last_gbps", sender="0", group=group) > 0
        assert value(s, "rollout_manager_weight_push_bytes_total", sender="0", group=group) > 0
    for box in boxes:
        assert value(s, "rollout_manager_instance_weight_version", endpoint=box.endpoint) == 1
        assert value(s, "rollout_manager_instance_weight_version_lag", endpoint=box.endpoint) == 0
        # staged activation (the default): each box paused only to load version 1, and never left service
        assert 0 < value(s, "rollout_manager_instance_weight_paused_seconds", endpoint=box.endpoint, version="1") < 5
    assert value(s, "rollout_manager_instance_transitions_total", to="syncing") == 0


@pytest.mark.slow
async def test_requests_waiting_for_an_instance_show_in_status_and_metrics(rig):
    m, sender, add_boxes = rig  # no instance yet: a request must wait inside the manager
    waiting = asyncio.ensure_future(generate(m, [1, 2, 3], 4))
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while (await m.status())["requests_waiting_for_instance"] != 1:
            assert asyncio.get_running_loop().time() < deadline, "the waiting request never showed in the status"
            assert not waiting.done(), waiting
            await asyncio.sleep(0.05)
        _, s = await scrape(m)
        assert value(s, "rollout_manager_requests_waiting_for_instance") == 1
        await add_boxes(1)
        out = await asyncio.wait_for(waiting, 60)
    finally:
        waiting.cancel()
    assert out["output_ids"]
    assert (await m.status())["requests_waiting_for_instance"] == 0
    _, s = await scrape(m)
    assert value(s, "rollout_manager_requests_waiting_for_instance") == 0


# ------------------------------------------------------------------ the status page
async def chromium(tmp_path: Path, url: str, *mode: str) -> bytes:
    """Run headless Chromium on ``url``; return its stdout. Its whole process group is killed after."""
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--window-size=1280,800", *mode, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """A minimal PNG decoder (8-bit RGB/RGBA, not interlaced): (width, height, rows of pixel bytes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert ihdr is not None
    width, height, depth, color, _, _, interlace = ihdr
    assert depth == 8 and color in (2, 6) and interlace == 0, ihdr
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i] for i in range(len(r)) if i % bpp < 3) for r in rows]  # RGB only


def tbody(dom: str, element_id: str) -> str:
    found = re.search(rf'<tbody id="{element_id}">(.*?)</tbody>', dom, re.S)
    assert found, f"no tbody #{element_id} in the rendered DOM"
    return found.group(1)


@pytest.mark.slow
@needs_chromium
async def test_status_page_renders_live_instances_in_headless_chromium(rig, tmp_path):
    m, sender, add_boxes = rig
    (box,) = await add_boxes(1)
    await generate(m, [[1, 2, 3], [4, 5]], 16)
    await push_version(m, sender, 1)

    async with m.session.get(m.url + "/") as r:
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
        assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page must load nothing external"

    dom = (await chromium(tmp_path, m.url + "/", "--dump-dom")).decode()
    rows = tbody(dom, "instances")
    assert box.endpoint in rows and 'class="badge st-active">active<' in rows, rows  # rendered by the JS
    assert "v1" in rows
    assert box.endpoint in tbody(dom, "pushes") and "registered (remote)" in tbody(dom, "events")
    assert text_of(dom, "n-instances") == "(1 active)"
    assert "last updated" in dom and '<div id="banner" role="alert" class="">' in dom

    shot = tmp_path / "status_page.png"
    await chromium(tmp_path, m.url + "/", f"--screenshot={shot}")
    assert shot.exists() and 10_000 < shot.stat().st_size < 5_000_000
    width, height, rows_px = read_png(shot)
    assert (width, height) == (1280, 800)
    colors = {row[x:x + 3] for row in rows_px[::4] for x in range(0, len(row), 12)}
    assert len(colors) > 20, "the screenshot looks blank"
    r_, g_, b_ = rows_px[10][30:33]  # inside the dark header bar: proof the inline CSS applied
    assert max(r_, g_, b_) < 80, (r_, g_, b_)
    keep = os.environ.get("STATUS_PAGE_SCREENSHOT")  # keep a copy of the screenshot there
    if keep:
        shutil.copy(shot, keep)


async def render_page(tmp_path: Path, status: Callable[[web.Request], Awaitable[web.Response]]) -> str:
    """The status page's DOM in headless Chromium, served beside ``status`` as its status endpoint."""
    async def page(request: web.Request) -> web.Response:
        return status_page.response()

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/get_instances_status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return (await chromium(tmp_path, f"http://127.0.0.1:{port}/", "--dump-dom")).decode()
    finally:
        await runner.cleanup()


def text_of(dom: str, element_id: str) -> str:
    found = re.search(rf'<[a-z]+ [^>]*id="{element_id}"[^>]*>([^<]*)<', dom)
    assert found, f"no #{element_id} in the rendered DOM"
    return found.group(1)


def syncing_instance(port: int) -> dict[str, object]:
    return {"endpoint": f"127.0.0.1:{port}", "id": f"i{port}", "kind": "remote", "state": "syncing",
            "state_for_s": 3.0, "weight_version": 0, "in_flight": 0, "in_flight_tokens": 0, "sender": 0,
            "group": 0, "consecutive_failures": 0, "last_error": None}


@pytest.mark.slow
@needs_chromium
async def test_status_page_counts_agree_with_badges_and_tokens_and_waiting_are_live(tmp_path):
    """Two syncing instances, sequences streaming (none finished yet) and requests waiting: the page
    must say "2 syncing", show a live tokens/s above zero, and show the waiting requests."""
    polls = 0

    async def status(request: web.Request) -> web.Response:
        nonlocal polls
        polls += 1
        return web.json_response({
            "ready_instances": 0, "pending_instances": 2, "weight_version": 1,
            "counts": {"pending": 0, "syncing": 2, "active": 0, "draining": 0},
            "instances": [syncing_instance(1), syncing_instance(2)],
            "generation": {"sequences": 4, "tokens": 0, "streamed_tokens": 500 * polls, "continuations": 0,
                           "failed": 0, "preempted": 0},
            "requests_waiting_for_instance": 3,
            "local": {"open": False, "budget_s": 1.0}, "weight_senders": {"senders": []},
            "recent_events": [], "recent_weight_pushes": [],
        })

    dom = await render_page(tmp_path, status)
    assert polls >= 2, polls
    assert text_of(dom, "n-instances") == "(2 syncing)"
    assert re.search(r'<section id="relays-section" style="display: none;?">', dom)  # one process: no relays
    assert float(text_of(dom, "c-tps")) > 0  # tokens streamed, although no sequence finished
    assert text_of(dom, "c-waiting") == "3"


@pytest.mark.slow
@needs_chromium
async def test_status_page_lists_the_relays_when_the_manager_runs_them(tmp_path):
    """With relays the control process's status lists each relay; the page shows them, the lost one marked."""
    relay = {"relay": 0, "pid": 4242, "connected": True, "restarts": 1, "report_age_s": 0.2, "in_flight": 17,
             "waiting": 3, "finished": 905, "streamed_tokens": 123456, "cpu_s": 12.5, "saving": 11}

    async def status(request: web.Request) -> web.Response:
        return web.json_response({
            "ready_instances": 2, "pending_instances": 0, "weight_version": 1,
            "counts": {"pending": 0, "syncing": 2, "active": 0, "draining": 0},
            "instances": [syncing_instance(1), syncing_instance(2)],
            "relays": [relay, {**relay, "relay": 1, "pid": 4343, "connected": False, "restarts": 0}],
            "local": {"open": False, "budget_s": 1.0}, "weight_senders": {"senders": []},
            "recent_events": [], "recent_weight_pushes": [],
        })

    dom = await render_page(tmp_path, status)
    rows = tbody(dom, "relays")
    assert "4242" in rows and "4343" in rows and "905" in rows and "123456" in rows, rows
    assert text_of(dom, "n-relays") == "(1 of 2 connected)"
    assert '<section id="relays-section" style="">' in dom


@pytest.mark.slow
@needs_chromium
async def test_status_page_shows_an_error_banner_when_the_status_fetch_fails(tmp_path):
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": "boom"}, status=503)

    dom = await render_page(tmp_path, failing)
    banner = re.search(r'<div id="banner" role="alert" class="show">(.*?)</div>', dom, re.S)
    assert banner, dom[:2000]
    assert "Cannot fetch the manager's status: HTTP 503" in banner.group(1)


@pytest.mark.slow
async def test_rejected_requests_are_counted_per_endpoint_and_reason_and_change_nothing(start_manager):
    m = await start_manager()
    before = await m.get("/get_instances_status")
    assert (await m.post("/register_rollout_instance", data=b"{not json"))[0] == 400
    assert (await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": "x"}))[0] == 400
    assert (await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": -1}))[0] == 400
    assert (await m.post("/no/such/endpoint", {}))[0] == 404
    assert (await m.post("/metrics", {}))[0] == 405
    _, samples = await scrape(m)
    name = "rollout_manager_rejected_requests_total"
    assert value(samples, name, endpoint="/register_rollout_instance", reason="invalid_json") == 1
    assert value(samples, name, endpoint="/register_rollout_instance", reason="invalid_field") == 2
    assert value(samples, name, endpoint="unmatched", reason="no_route") == 1
    assert value(samples, name, endpoint="unmatched", reason="method_not_allowed") == 1
    assert await m.get("/get_instances_status") == before


async def test_a_refusal_is_logged_at_debug_only(caplog):
    from aiohttp.test_utils import TestClient, TestServer

    from rollout_manager.api.http import MAX_ADMIN_BODY, MAX_BODY, ON_REJECT, accepts, json_errors
    from rollout_manager.api.schemas import UpdateWeightVersion

    seen: list[tuple[str, str]] = []

    @accepts(UpdateWeightVersion)
    async def handler(request: web.Request, body: object, raw: object) -> web.Response:
        return web.json_response({})

    app = web.Application(middlewares=[json_errors])
    app[MAX_BODY] = app[MAX_ADMIN_BODY] = 1 << 16
    app[ON_REJECT] = lambda endpoint, reason: seen.append((endpoint, reason))
    app.router.add_post("/v", handler)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level("DEBUG", logger="rollout_manager.http"):
            r = await client.post("/v", json={"new_version": "one"})
            assert r.status == 400 and "new_version" in (await r.json())["error"]
    assert seen == [("/v", "invalid_field")]
    assert [rec.levelname for rec in caplog.records if rec.name == "rollout_manager.http"] == ["DEBUG"]


def test_event_histogram_counts_as_prometheus_histogram_does_values_on_a_bound_included() -> None:
    """The per-sequence histograms are the manager's own (no lock per observation); what a scrape shows
    must be what prometheus_client's Histogram shows for the same values."""
    values = [0.0, 0.05, 0.051, 1, 2.5, 7, 600, 1200, 1e6]
    ours = EventHistogram(LATENCY_BUCKETS)
    theirs_registry = CollectorRegistry()
    theirs = Histogram("h", "h", buckets=LATENCY_BUCKETS, registry=theirs_registry)
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    family = HistogramMetricFamily("h", "h")
    ours.add_to(family, [])
    expected = {(s.name, s.labels.get("le")): s.value for m in theirs_registry.collect() for s in m.samples
                if not s.name.endswith("_created")}
    assert {(s.name, s.labels.get("le")): s.value for s in family.samples} == expected
    assert expected[("h_bucket", "0.05")] == 2 and expected[("h_bucket", "+Inf")] == len(values)
