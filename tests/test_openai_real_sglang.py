"""The OpenAI front against real SGLang 0.5.23 on CPU, driven by the official ``openai`` SDK.

One manager with the front and one real box (through scripts/launch_sglang.sh) for the module: the tiny
random model of tests/real_sglang_model.py (its byte-level BPE tokenizer) given a hermes-style ChatML
template (tests/openai_tokenizer.py's), the same files for the box and the front. What is checked:

- a multi-turn session whose first turn is a forced tool call (``tool_choice: "required"``; the front sends
  SGLang's ``structural_tag``, which SGLang's xgrammar backend applies on CPU), then the tool result and a
  plain turn: every turn's ids equal what SGLang's own ``/generate`` makes of the ledger's prompt for that
  turn (greedy; the forced turn with the same grammar), and each turn's prompt extends the ledger;
- streaming and not give the same ids, and a named function forced streamed gives the same call;
- a second box joins, and the box running a streamed session turn is SIGKILLed mid-turn: the turn continues
  on the other box, its ids SGLang's own uninterrupted greedy answer, the ledger holding the whole turn (last
  in the module: the killed box may be the module's).
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai_tokenizer import CHATML
from real_sglang import Daemon, RealBox, start_box, start_manager

from rollout_manager.openai_front import tool_calls
from rollout_manager.sglang.openai_turn import structural_tag

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

MODEL = "tiny-hermes"
# fast failure detection, so the dead box is out of service within seconds of the kill
FAST = {"health_check_interval_s": "0.5", "health_check_timeout_s": "5", "health_failure_threshold": "2"}
SESSION = "X-Session-Id"
TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "the weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
                             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
              "name": "get_time", "description": "the time in a zone",
              "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                             "required": ["zone"], "additionalProperties": False}}}]


@dataclass
class Front:
    manager: Daemon
    box: RealBox
    client: openai.OpenAI
    model: Path
    log_dir: Path


@pytest.fixture(scope="module")
def front(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    import transformers

    log_dir = tmp_path_factory.mktemp("openai_real_sglang")
    model = log_dir / "model"
    shutil.copytree(real_sglang_model, model)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = CHATML  # a hermes-style template, as Qwen2.5 ships one
    tok.save_pretrained(str(model))
    manager = start_manager(log_dir, openai_tokenizer_path=str(model), openai_model_name=MODEL, **FAST)
    try:
        box = start_box(model, manager.url, log_dir)
        try:
            with openai.OpenAI(base_url=manager.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
                yield Front(manager, box, client, model, log_dir)
        finally:
            box.stop()
    finally:
        manager.stop()


def http(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


def generate(box: RealBox, ids: list[int], max_new_tokens: int, **params: Any) -> list[int]:
    """SGLang's own greedy answer to ``ids``, straight from the box."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params}}
    return list(http("POST", box.url + "/generate", body)["output_ids"])


def grammar(tool_choice: Any) -> str:
    """The ``structural_tag`` the front sends for ``tool_choice`` (one call), to replay a forced turn."""
    forced = tool_calls.forced(TOOLS, tool_choice, False)
    assert forced is not None
    return structural_tag(forced)


def test_each_turn_of_a_tool_calling_session_is_what_sglang_makes_of_the_ledgers_prompt(front: Front) -> None:
    client, session = front.client, {SESSION: "agent-real-1"}
    messages: list[Any] = [{"role": "system", "content": "you are a helpful agent"},
                           {"role": "user", "content": "alpha beta gamma delta"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=150, temperature=0,
                                           extra_headers=session)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls is not None and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert (call.function.name, list(args)) in (("get_weather", ["city"]), ("get_time", ["zone"]))
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    budgets = [150]
    for text in (None, "rollout manager token"):  # the tool result answered, then a plain user turn
        if text is not None:
            messages += [{"role": "user", "content": text}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12,
                                               temperature=0, extra_headers=session)
        messages.append(reply.choices[0].message)
        budgets.append(12)
    last_prompt, last_ids = extra(reply, "prompt_token_ids"), extra(reply.choices[0], "token_ids")

    traj = http("GET", f"{front.manager.url}/v1/sessions/agent-real-1/trajectory")
    assert traj["turn_count"] == 3 and len(traj["branches"]) == 1, traj
    ids = traj["prompt_ids"] + traj["response_ids"]
    assert ids == last_prompt + last_ids  # the last turn's prompt is the whole history, as sent
    forced = grammar("required")
    for k, (turn, budget) in enumerate(zip(traj["turns"], budgets)):
        prompt = ids[:turn["prompt_len"]]
        made = ids[turn["prompt_len"]:turn["prompt_len"] + turn["response_len"]]
        constrained = {"structural_tag": forced} if k == 0 else {}
        assert made == generate(front.box, prompt, budget, **constrained), f"turn {k}"
    mask = traj["response_mask"]
    first_made = traj["turns"][0]["response_len"]
    assert mask[:first_made] == [1] * first_made and 0 in mask  # the tool result and template tokens: mask 0
    assert extra(first.choices[0], "token_ids") == ids[len(traj["prompt_ids"]):][:first_made]


def test_streaming_and_not_give_the_same_ids_and_the_same_forced_call(front: Front) -> None:
    client = front.client
    messages = [{"role": "user", "content": "the box of the trainer"}]
    body: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body)
    streamed: list[int] = []
    text = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed += extra(c, "token_ids") or []
            text += c.delta.content or ""
    assert streamed == extra(whole.choices[0], "token_ids") and len(streamed) == 16
    assert text == whole.choices[0].message.content

    named = {"type": "function", "function": {"name": "get_time"}}
    body = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, parallel_tool_calls=False,
                max_tokens=150, temperature=0)
    whole = client.chat.completions.create(**body)
    calls = whole.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_time"]
    streamed, deltas, finish = [], [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed += extra(c, "token_ids") or []
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert streamed == extra(whole.choices[0], "token_ids") and finish == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert streamed == generate(front.box, extra(whole, "prompt_token_ids"), 150, structural_tag=grammar(named))


def test_a_turn_whose_box_is_killed_mid_turn_continues_on_another_exactly(front: Front) -> None:
    other = start_box(front.model, front.manager.url, front.log_dir, name="b")
    try:
        messages = [{"role": "user", "content": "alpha rollout manager"}]
        n = 300
        ids: list[int] = []
        victim: RealBox | None = None
        final: Any = None
        killed_at = 0
        for chunk in front.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "session_id": "killed-1"}):
            for c in chunk.choices:
                ids += extra(c, "token_ids") or []
                if c.finish_reason is not None:
                    final = c
            if victim is None and len(ids) >= 20:  # the turn runs: kill the box running it
                status = http("GET", front.manager.url + "/get_instances_status")
                serving = [i["endpoint"] for i in status["instances"] if i["in_flight"]]
                assert len(serving) == 1, serving
                victim = next(b for b in (front.box, other) if b.endpoint == serving[0])
                victim.kill_sglang()
                killed_at = len(ids)
        assert victim is not None and killed_at < n and final is not None, "the turn finished before the kill"
        survivor = other if victim is front.box else front.box
        traj = http("GET", f"{front.manager.url}/v1/sessions/killed-1/trajectory")
        assert traj["response_ids"] == ids and traj["turns"][0]["response_len"] == n  # the whole turn, once
        assert ids == generate(survivor, traj["prompt_ids"], n, ignore_eos=True)  # token for token, uninterrupted
        segments = extra(final, "rollout")["segments"]
        assert len(segments) >= 2 and segments[0]["endpoint"] == victim.endpoint
    finally:
        other.stop()
