"""Every body the manager, the receiver agent and the trainer plugin send to SGLang, held to SGLang 0.5.23.

``/generate`` and ``/abort_request`` bodies go through SGLang's own generated decoder
(``sglang/api/v1/api_types.py``, loaded from the installed wheel without SGLang's GPU stack). The
weight-update request types live in ``sglang/srt/managers/io_struct.py``, which imports torch, zmq and
the rest of SGLang: their fields are read from that file's source (``ast``) instead, so a misspelled
or missing key still fails here. Every body is then sent to the CPU engine, which must accept it too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rollout_manager.cpu_engine.contract import abort_contract_error, api_types_path, generate_contract_error
from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.model import build_model
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import sampling_seed
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.generate_request import continuation
from rollout_manager.sglang.sse import iter_frames
from trainer_plugin.proxy import build_generate_body
from trainer_plugin.streaming import RolloutStream

PROMPT = [5, 17, 42, 9]
VERL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def manager_bodies() -> list[dict[str, Any]]:
    """What the manager sends to ``/generate``: the first attempt and continuations of callers' bodies,
    each decoded as the door does (``rollout.request``) and seeded as a sequence is."""
    callers: list[dict[str, Any]] = [
        {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "rid": "r"},
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None, "min_new_tokens": 2, "top_k": 5,
                                                  "stream_interval": 2}, "return_logprob": True},
        {"input_ids": PROMPT, "trajectory_key": "t", "min_weight_version": 3},
        {"input_ids": [PROMPT, PROMPT[:2]], "rid": "b", "return_logprob": [True, False],
         "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 2, "sampling_seed": 3}]},
    ]
    out = []
    for caller in callers:
        for item in decode(caller).sequences:
            body, seed = item.body, sampling_seed(item.body)
            out.append(continuation(body, [], rid=body.rid or "rm-1", seed=seed).to_json())
            out.append(continuation(body, [7, 8], rid="rm-1~1", seed=seed).to_json())
            # As the Generator sends them: with the manager's per-request stream interval, or as one answer.
            out.append(continuation(body, [], rid="rm-2", stream_interval=16, seed=seed).to_json())
            out.append(continuation(body, [7], rid="rm-2~1", stream_interval=16, keep_caller_interval=True,
                                    seed=seed).to_json())
            out.append(continuation(body, [7], rid="rm-3", stream_interval=16, stream=False, seed=seed).to_json())
    return out


def plugin_bodies() -> list[dict[str, Any]]:
    """What the trainer plugin sends (the manager passes them on, continued as above)."""
    proxy = build_generate_body(PROMPT, {**VERL_SAMPLING, "seed": 7}, "verl-1", prompt_length=8,
                                response_length=6, max_model_len=1024)
    stream = RolloutStream(None, [PROMPT], n=2, sampling_params={"temperature": 1.0, "top_p": 0.9},  # type: ignore[arg-type]
                           return_logprob=True, response_length=6)
    return [proxy] + [body for _, body in stream.requests()]


def all_generate_bodies() -> list[dict[str, Any]]:
    plugin = plugin_bodies()
    continued = [continuation(item.body, [3], rid="p~1").to_json() for b in plugin for item in decode(b).sequences]
    return manager_bodies() + plugin + continued


ABORT_BODIES = [wire.abort_body("r"), wire.abort_body(abort_all=True), wire.abort_body(None)]


@pytest.mark.parametrize("body", all_generate_bodies())
def test_generate_bodies_pass_sglangs_own_decoder(body: dict[str, Any]) -> None:
    assert generate_contract_error(body) is None


@pytest.mark.parametrize("body", ABORT_BODIES)
def test_abort_bodies_pass_sglangs_own_decoder(body: dict[str, Any]) -> None:
    assert abort_contract_error(body) is None


def test_the_plugin_sends_sglangs_name_for_the_seed() -> None:
    # SGLang >= 0.5.22 refuses unknown sampling keys; verl's (vLLM's) "seed" is SGLang's "sampling_seed".
    body = build_generate_body(PROMPT, {**VERL_SAMPLING, "seed": 7}, "r", prompt_length=8, response_length=6)
    assert body["sampling_params"]["sampling_seed"] == 7 and "seed" not in body["sampling_params"]


# ------------------------------------------------------------------ weight-update bodies (io_struct.py)


def io_struct_fields(class_name: str) -> tuple[dict[str, str], set[str]]:
    """``{field: annotation}`` and the required fields of an io_struct request class (and BaseReq)."""
    source = (api_types_path().parents[2] / "srt" / "managers" / "io_struct.py").read_text()
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    fields: dict[str, str] = {}
    required: set[str] = set()
    for name in ("BaseReq", class_name):
        for stmt in classes[name].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields[stmt.target.id] = ast.unparse(stmt.annotation)
                if stmt.value is None:
                    required.add(stmt.target.id)
    return fields, required


def _matches(value: Any, annotation: str) -> bool:
    """A JSON value against the few annotations these request types use."""
    if annotation.startswith("Optional[") and value is None:
        return True
    inner = annotation.removeprefix("Optional[").removesuffix("]") if annotation.startswith("Optional[") else annotation
    if inner == "bool":
        return isinstance(value, bool)
    if inner == "str":
        return isinstance(value, str)
    if inner.startswith("Literal["):
        return value in ast.literal_eval(inner.removeprefix("Literal"))
    if "List[bytes]" in inner:  # base64 strings over HTTP
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise AssertionError(f"no check for annotation {annotation!r}")


def weight_bodies() -> list[tuple[str, str, dict[str, Any]]]:
    """(path, io_struct class, body) of every weight-update call the receiver agent and manager make."""
    named = list(build_model(0).named_parameters())[:1]
    tensors = [(name, p.detach().clone()) for name, p in named]
    return [
        (wire.BEGIN_WEIGHT_UPDATE, "BeginWeightUpdateReqInput", wire.begin_weight_update_body()),
        (wire.UPDATE_WEIGHTS_FROM_TENSOR, "UpdateWeightsFromTensorReqInput",
         wire.update_weights_from_tensor_body([tensor_payload.serialize_named_tensors(tensors)], flush_cache=True,
                                              weight_version="1")),
        (wire.END_WEIGHT_UPDATE, "EndWeightUpdateReqInput", wire.end_weight_update_body()),
        (wire.UPDATE_WEIGHT_VERSION, "UpdateWeightVersionReqInput", wire.update_weight_version_body(1)),
    ]


@pytest.mark.parametrize("path, class_name, body", weight_bodies(), ids=lambda v: v if isinstance(v, str) else "")
def test_weight_update_bodies_match_sglangs_request_types(path: str, class_name: str, body: dict[str, Any]) -> None:
    fields, required = io_struct_fields(class_name)
    assert set(body) <= set(fields), f"{path}: keys SGLang does not know: {set(body) - set(fields)}"
    assert required <= set(body), f"{path}: missing {required - set(body)}"
    for key, value in body.items():
        assert _matches(value, fields[key]), f"{path}: {key}={value!r} is not {fields[key]}"


# ------------------------------------------------------------------ and the CPU engine accepts them all


@pytest.fixture
async def engine() -> AsyncIterator[TestClient]:
    # A short context keeps the bodies without a token limit short.
    client = TestClient(TestServer(create_app(EngineConfig(seed=0, context_length=140))))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _post(client: TestClient, path: str, body: Any) -> tuple[int, bytes]:
    async with client.post(path, json=body) as resp:
        return resp.status, await resp.read()


@pytest.mark.slow  # runs for seconds
async def test_the_cpu_engine_accepts_every_body(engine: TestClient) -> None:
    for body in all_generate_bodies():
        status, raw = await _post(engine, wire.GENERATE, body)
        assert status == 200, (body, raw)
        if body.get("stream"):
            frames = iter_frames([raw])  # an error frame raises here
            assert frames and frames[-1]["meta_info"]["finish_reason"]["type"] in ("length", "stop"), frames[-1]
    for body in ABORT_BODIES:
        assert (await _post(engine, wire.ABORT_REQUEST, body))[0] == 200
    for path, _, body in weight_bodies():
        status, raw = await _post(engine, path, body)
        assert status == 200, (path, raw)


@pytest.mark.slow
def test_the_contract_loads_without_sglangs_package() -> None:
    # In a fresh process: other tests (verl) may import sglang pieces into this one.
    code = ("import sys; from rollout_manager.cpu_engine.contract import generate_contract_error as check; "
            "assert check({'input_ids': [1], 'sampling_params': {'seed': 1}}); "
            "assert check({'input_ids': [1]}) is None; "
            "assert not [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')], 'sglang imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
