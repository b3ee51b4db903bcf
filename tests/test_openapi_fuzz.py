"""The API description and fuzzing every endpoint from it: no 5xx, no crash, nothing changed by a refusal."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from support import PY, Proc, free_port, wait_http_ok_sync

from rollout_manager.api.openapi import build_openapi
from rollout_manager.api.routes import ROUTES

DOC = build_openapi(ROUTES, "test")
BODY_ROUTES = [(m, p, h) for m, p, h in ROUTES
               if getattr(h, "body_model", None) is not None or getattr(h, "body_schema", None) is not None]
# Valid bodies of these would generate (no instance here: a 503 by design) or wait on purpose.
NO_VALID_FUZZ = {"/generate", "/batch_generate_requests"}


def test_openapi_document_covers_every_route_with_the_validating_models():
    for method, path, handler in ROUTES:
        op = DOC["paths"][path][method.lower()]
        model = getattr(handler, "body_model", None)
        described = getattr(handler, "body_schema", None)
        if described is not None:  # a generation body: its msgspec types' schema, each named one in components
            schema, named = described("#/components/schemas/{name}")
            assert op["requestBody"]["content"]["application/json"]["schema"] == schema, path
            assert all(DOC["components"]["schemas"][name] == value for name, value in named.items()), path
            continue
        if model is None:
            assert "requestBody" not in op
            continue
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        own.pop("$defs", None)
        assert schema == own or schema == {"$ref": f"#/components/schemas/{model.__name__}"}, path
    assert {p for _, p, _ in ROUTES} == set(DOC["paths"])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    args = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"]
    for kv in ("registration_allowed_networks=127.0.0.0/8", "allowed_sender_ips=127.0.0.0/8",
               "no_instance_wait_timeout_s=0.05", "startup_grace_period_s=0.5", "pending_poll_interval_s=0.1",
               "drain_timeout_s=0.5", "max_attempts_per_request=1", "log_level=warning"):
        args += ["--set", kv]
    proc = Proc(args, tmp_path_factory.mktemp("fuzz") / "manager.log")
    try:
        wait_http_ok_sync(f"http://127.0.0.1:{port}/health", proc)
        yield port, proc
    finally:
        proc.stop()


def call(port: int, method: str, path: str, body: bytes) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, (json.loads(raw) if ctype.startswith("application/json") and raw else raw)
    finally:
        conn.close()


def snapshot(port: int) -> dict[str, Any]:
    status, st_ = call(port, "GET", "/get_instances_status", b"")
    assert status == 200
    return {"instances": [(i["endpoint"], i["kind"]) for i in st_["instances"]],
            "weight_version": st_["weight_version"], "senders": st_["weight_senders"],
            "budget": st_["local"]["budget_s"]}


def resolved(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "components": {"schemas": DOC["components"]["schemas"]}}


def body_strategy(path: str, method: str) -> st.SearchStrategy[bytes]:
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
        max_leaves=12)
    garbage = json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
    if path in NO_VALID_FUZZ:
        return garbage
    op = DOC["paths"][path][method.lower()]
    schema = resolved(op["requestBody"]["content"]["application/json"]["schema"])
    valid = from_schema(schema).map(lambda v: _tame(path, v)).map(lambda v: json.dumps(v).encode())
    return garbage | valid


def _tame(path: str, value: Any) -> Any:
    """Keep valid bodies from waiting on purpose or from pointing outside loopback."""
    if path == "/update_weight_version" and isinstance(value, dict):
        value.pop("wait_for_instances", None)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("method, path", [(m, p) for m, p, _ in BODY_ROUTES], ids=[p for _, p, _ in BODY_ROUTES])
def test_fuzz_endpoint(daemon, method, path):
    port, proc = daemon

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body_strategy(path, method))
    def run(body: bytes) -> None:
        before = snapshot(port)
        status, answer = call(port, method, path, body)
        assert status < 500 or (path in NO_VALID_FUZZ and status == 503), (status, answer, body)
        if status >= 400:
            assert isinstance(answer, dict) and set(answer) == {"error"}, answer
            assert snapshot(port) == before, (status, answer, body)
        assert proc.popen.poll() is None, "the daemon died"

    run()


def test_the_generate_schema_takes_what_the_door_takes_and_refuses_what_it_refuses():
    """The document describes /generate bodies as the decode checks them: a few bodies, both ways."""
    from jsonschema import Draft202012Validator

    from rollout_manager.errors import InvalidField
    from rollout_manager.rollout.request import decode

    op = DOC["paths"]["/generate"]["post"]
    validator = Draft202012Validator(resolved(op["requestBody"]["content"]["application/json"]["schema"]))
    for body in ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "top_p": 0.5}, "lora_path": "x"},
                 {"input_ids": [[1], [2]], "rid": ["a", "b"], "sampling_params": [{}, {"temperature": 1.0}]},
                 {"input_ids": [1], "trajectory_key": "t", "min_weight_version": 2, "stream": True}):
        assert validator.is_valid(body), body
        decode(body)
    for body in ({"input_ids": []}, {"input_ids": [-1]}, {"input_ids": [1], "stream": 1}, {"rid": "a"},
                 {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, {"input_ids": [[1], []]}):
        assert not validator.is_valid(body), body
        with pytest.raises(InvalidField):
            decode(body)
