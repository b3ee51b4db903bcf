"""The one client for the manager's API (rollout_manager.manager_client): typed answers, one error type
that says whether anything answered, the bearer token on every call. Against a real HTTP server on
127.0.0.1 in a thread (no process started)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support import free_port

from rollout_manager.manager_client import ManagerAPI, ManagerAPIError, base_url
from trainer_plugin.client import ManagerClientError, ManagerHTTPError

SEEN: list[tuple[str, str, str | None]] = []


class _Manager(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: object) -> None:
        raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        SEEN.append(("GET", self.path, self.headers.get("Authorization")))
        if self.path == "/health":
            self._answer(200, {"status": "healthy", "version": "0.1.0", "weight_version": 3, "run_id": "r1",
                               "instances": {"active": 2}})
        elif self.path == "/get_instances_status":
            self._answer(200, b"not json")
        else:
            self._answer(404, {"error": "no such path"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append(("POST", self.path, self.headers.get("Authorization")))
        self._answer(200, {"removed": body["endpoints"][:1], "not_found": body["endpoints"][1:], "skipped": []})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def manager() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Manager)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    SEEN.clear()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_typed_answers_and_the_token_on_every_call(manager: str) -> None:
    api = ManagerAPI(base_url(manager + "/"), "s3cret", timeout_s=5.0)
    assert api.url == f"http://{manager}"
    health = api.health()
    assert (health.healthy, health.version, health.weight_version, health.run_id, health.instances) == \
        (True, "0.1.0", 3, "r1", {"active": 2})
    result = api.shutdown_instances(["a:1", "b:2"], check_weight_update=False)
    assert (result.removed, result.not_found, result.skipped) == (["a:1"], ["b:2"], [])
    assert [auth for _, _, auth in SEEN] == ["Bearer s3cret"] * 2


def test_one_error_type_tells_an_answer_from_no_answer(manager: str) -> None:
    api = ManagerAPI(base_url(manager), timeout_s=5.0)
    with pytest.raises(ManagerAPIError) as refused:
        api.request("GET", "/nothing")
    assert (refused.value.status, refused.value.message) == (404, "no such path")
    with pytest.raises(ManagerAPIError, match="not JSON"):
        api.instances_status()
    assert SEEN[0][2] is None  # no token, no header
    gone = ManagerAPI(f"http://127.0.0.1:{free_port()}", timeout_s=5.0)
    with pytest.raises(ManagerAPIError, match="cannot reach the manager at") as unreachable:
        gone.health()
    assert unreachable.value.status is None and unreachable.value.reason == "connection refused"


def test_the_trainer_plugins_errors_are_the_same_type() -> None:
    err = ManagerHTTPError("GET", "/x", 409, "taken", {"error": "taken"})
    assert isinstance(err, ManagerAPIError) and isinstance(err, ManagerClientError)
    assert (err.status, err.message, err.body) == (409, "taken", {"error": "taken"})
