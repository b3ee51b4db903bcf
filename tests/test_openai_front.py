"""The OpenAI-compatible front (``/v1/*``, rollout_manager/openai_front), driven by the official ``openai`` SDK
against a real manager and a CPU engine: turns run through the manager's own rollout path with token ids, a
session's ledger keeps the exact ids (its next turn's prompt extends them, the trajectory returns them),
streaming and non-streaming agree, and bad requests get OpenAI's error shape naming the field."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai_tokenizer import LLAMA3, LLAMA3_SCHEMA, eos_id, llama3_eos_id, make
from support import async_wait_until

MODEL = "tiny-chatml"
pytestmark = pytest.mark.slow  # a manager and a CPU engine per test


@pytest.fixture
async def start_front(tmp_path: Path, start_manager: Any, start_engines: Any) -> Any:
    """Starts a manager with the front configured (a ChatML tokenizer) and one CPU engine whose end token is
    ChatML's ``<|im_end|>`` (and the engine flags given); returns (manager handle, SDK client)."""
    clients: list[openai.AsyncOpenAI] = []

    async def start(*engine_flags: str) -> tuple[Any, openai.AsyncOpenAI]:
        tok = make(tmp_path / "tokenizer")
        m = await start_manager(openai_tokenizer_path=str(tok), openai_model_name=MODEL)
        (engine,) = await start_engines(["--eos-token-id", str(eos_id()), *engine_flags])
        await m.register(engine)
        clients.append(openai.AsyncOpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60))
        return m, clients[-1]

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def front(start_front: Any) -> Any:
    return await start_front()


async def metrics(m: Any, *names: str) -> dict[str, float]:
    """The manager's ``rollout_manager_openai_<name>`` samples."""
    async with m.session.get(m.url + "/metrics") as resp:
        text = await resp.text()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("rollout_manager_openai_"))
    return {n: float(samples["rollout_manager_openai_" + n]) for n in names if "rollout_manager_openai_" + n in samples}


def extra(obj: Any, name: str) -> Any:
    """A field the manager adds beside OpenAI's (the SDK keeps it as an extra)."""
    return (obj.model_extra or {})[name]


async def test_a_sessions_second_turn_extends_the_ledger_and_the_trajectory_is_what_was_sampled(front: Any) -> None:
    m, client = front
    models = await client.models.list()
    assert [x.id for x in models.data] == [MODEL]
    session = {"X-Session-Id": "agent-1"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "you are a helpful agent"},
                                      {"role": "user", "content": "hello what is the answer"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, extra_headers=session)
    p1, r1 = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    assert 1 <= len(r1) <= 6 and first.usage.prompt_tokens == len(p1) and first.usage.completion_tokens == len(r1)
    assert first.choices[0].logprobs is not None and len(first.choices[0].logprobs.content) == len(r1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again please"}]
    second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                  extra_body={"session_id": "agent-1"})
    p2, r2 = extra(second, "prompt_token_ids"), extra(second.choices[0], "token_ids")
    assert p2[:len(p1) + len(r1)] == p1 + r1  # the history is the ledger's ids, not a re-tokenization
    assert len(p2) > len(p1) + len(r1)  # ... followed by the template's closing and the new message

    async with m.session.get(f"{m.url}/v1/sessions/agent-1/trajectory") as resp:
        assert resp.status == 200
        traj = await resp.json()
    assert traj["prompt_ids"] == p1
    assert traj["prompt_ids"] + traj["response_ids"] == p2 + r2
    mask = traj["response_mask"]
    assert [t for t, k in zip(traj["response_ids"], mask) if k == 1] == r1 + r2  # exactly the sampled ids
    assert mask == [1] * len(r1) + [0] * (len(p2) - len(p1) - len(r1)) + [1] * len(r2)
    sampled_lps = [lp for lp, k in zip(traj["response_logprobs"], mask) if k == 1]
    assert sampled_lps[:len(r1)] == pytest.approx([c.logprob for c in first.choices[0].logprobs.content])
    assert [t["prompt_len"] for t in traj["turns"]] == [len(p1), len(p2)]
    assert traj["divergences"] == [] and traj["branch"] == 0
    # the ledger's figures in /metrics: its token arrays are 4 bytes an id, 5 more per response token
    held = len(p2) + len(r2)
    figures = {"sessions": 1.0, "session_tokens": held, "session_token_bytes": 4 * held + 5 * (held - len(p1)),
               "divergences_total": 0.0, "sessions_expired_total": 0.0, "max_sessions": 4096.0}
    assert await metrics(m, *figures) == {k: float(v) for k, v in figures.items()}

    # a rewritten history (the first user message edited) starts a branch, counted, the first kept
    messages[1] = {"role": "user", "content": "hello"}
    await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                         extra_headers=session)
    async with m.session.delete(f"{m.url}/v1/sessions/agent-1") as resp:
        freed = await resp.json()
    assert freed["branch"] == 1 and len(freed["branches"]) == 2
    assert [d["kind"] for d in freed["divergences"]] == ["rewritten"] and freed["divergences"][0]["position"] == 1
    async with m.session.get(f"{m.url}/v1/sessions/agent-1/trajectory") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "session_id"


async def test_streaming_and_not_give_the_same_ids(front: Any) -> None:
    m, client = front
    messages = [{"role": "user", "content": "what is the answer"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    ids, text, finish, usage = [], "", None, None
    async for chunk in stream:
        for c in chunk.choices:
            ids += extra(c, "token_ids") or []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
        usage = chunk.usage or usage
    assert ids == extra(whole.choices[0], "token_ids") and len(ids) == 8
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens == whole.usage.prompt_tokens
    with openai.OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60) as sync:  # the sync client
        same = await asyncio.to_thread(sync.chat.completions.create, model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert extra(same.choices[0], "token_ids") == ids

    # token-id prompts on /v1/completions, n=2 with a seed: two choices, each equal streamed or not
    body = dict(model=MODEL, prompt=[4, 5, 6, 7], max_tokens=5, temperature=1.0, seed=3, n=2,
                extra_body={"ignore_eos": True})
    done = await client.completions.create(**body)
    assert [c.index for c in done.choices] == [0, 1] and extra(done, "prompt_token_ids") == [4, 5, 6, 7]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    async for chunk in await client.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += extra(c, "token_ids") or []
    assert [streamed[0], streamed[1]] == [extra(c, "token_ids") for c in done.choices]

    # the raw stream ends with OpenAI's terminator
    async with m.session.post(m.url + "/v1/completions", json={**{k: v for k, v in body.items() if k != "extra_body"},
                                                                "stream": True}) as resp:
        raw = await resp.read()
    assert resp.headers["Content-Type"].startswith("text/event-stream") and raw.endswith(b"data: [DONE]\n\n")


BAD_CHATS: list[tuple[dict[str, Any], int, str]] = [
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "hi"}], temperature=5), 400, "temperature"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_tokens="many"), 400, "max_tokens"),
    (dict(messages=[{"role": "user", "content": "hi"}], model="gpt-4o"), 404, "model"),
    (dict(messages=[{"role": "user", "content": "hi"}], n=2, extra_body={"session_id": "s"}), 400, "n"),
    (dict(messages=[{"role": "user", "content": "hi"}], tool_choice="required"), 400, "tool_choice"),
]


async def test_a_bad_request_gets_openais_error_naming_the_field(front: Any) -> None:
    m, client = front
    for call, status, param in BAD_CHATS:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(**{"model": MODEL, **call})
        err = caught.value
        assert err.status_code == status and err.param == param, (call, err.body)
        assert set(err.body) >= {"message", "type", "param", "code"}  # the SDK hands over the "error" object
    status, ledger = await m.get("/v1/sessions")
    assert status == 200 and ledger["sessions"] == 0  # the refused session turn left nothing behind
    assert (await m.status())["openai_sessions"] == ledger and ledger["max_sessions"] == 4096


async def test_the_raw_error_shape_and_a_text_completion(front: Any) -> None:
    m, client = front
    async with aiohttp.ClientSession() as s:
        async with s.post(m.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}) as resp:
            body = await resp.json()
    assert resp.status == 400 and body["error"]["param"] == "prompt", body
    assert body["error"]["type"] == "invalid_request_error" and "99999" in body["error"]["message"]
    out = await client.completions.create(model=MODEL, prompt="hello you", max_tokens=3, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
    assert extra(out, "prompt_token_ids") == [8, 9]
    assert len(extra(out.choices[0], "token_ids")) == 3 and len(out.choices[0].logprobs.token_logprobs) == 3


async def test_a_stream_abandoned_mid_turn_frees_its_session_and_is_not_recorded(start_front: Any) -> None:
    m, client = await start_front("--token-delay-s", "0.05")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True, "session_id": "gone"}
    async with aiohttp.ClientSession() as s:
        async with s.post(m.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")  # the turn runs; then the caller leaves
    deadline = asyncio.get_running_loop().time() + 20
    while True:  # the abandoned turn is aborted and its session freed (409 while it still runs)
        try:
            out = await client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2,
                                                       temperature=0, extra_body={"session_id": "gone"})
            break
        except openai.ConflictError:
            assert asyncio.get_running_loop().time() < deadline, "the abandoned turn still holds its session"
            await asyncio.sleep(0.05)
    status, traj = await m.get("/v1/sessions/gone/trajectory")
    assert status == 200 and traj["turn_count"] == 1 and traj["response_ids"] == extra(out.choices[0], "token_ids")


async def test_a_turn_whose_box_dies_continues_on_another_and_the_ledger_has_the_whole_turn(
        tmp_path: Path, start_manager: Any, start_engines: Any) -> None:
    m = await start_manager(openai_tokenizer_path=str(make(tmp_path / "tokenizer")), openai_model_name=MODEL,
                            engine_stream_interval=1)  # a chunk per token: the cut is exactly where it died
    dying, healthy = await start_engines(["--die-after-tokens", "5", "--token-delay-s", "0.005"], [])
    await m.register(dying)  # the dying one is the only choice for the turn's first attempt
    messages = [{"role": "user", "content": "what is the answer"}]
    turn = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    async with openai.AsyncOpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        first = asyncio.ensure_future(client.chat.completions.create(**turn, extra_headers={"X-Session-Id": "d"}))
        await async_wait_until(lambda: dying.proc.popen.poll() is not None, message="the dying engine to die")
        await m.register(healthy)
        out = await first
        reference = await client.chat.completions.create(**turn)  # the same turn, uninterrupted, on the healthy one
    ids = extra(out.choices[0], "token_ids")
    assert ids == extra(reference.choices[0], "token_ids") and len(ids) == 16  # greedy: exactly as uninterrupted
    segments = out.choices[0].model_extra["rollout"]["segments"]
    assert [s["endpoint"] for s in segments] == [dying.endpoint, healthy.endpoint]
    assert segments[0]["end"] == segments[1]["start"] >= 4 and segments[1]["end"] == 16
    status, traj = await m.get("/v1/sessions/d/trajectory")
    assert status == 200 and traj["response_ids"] == ids and traj["response_mask"] == [1] * 16


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TWO_CALLS = ('<tool_call> {"name": "get_weather", "arguments": {"city": "paris"}} </tool_call> '
             '<tool_call> {"name": "get_weather", "arguments": {"city": "rome"}} </tool_call>')


async def test_a_tool_calling_loop_through_the_sdk_extends_the_ledger_exactly(
        tmp_path: Path, start_manager: Any, start_engines: Any) -> None:
    """The tiny random model cannot write a tool call by itself: the CPU engine is made to (its
    ``script_tokens`` fault: the first tokens it generates are the given ids, with the model's log-probs)."""
    from transformers import AutoTokenizer

    tok_dir = make(tmp_path / "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    m = await start_manager(openai_tokenizer_path=str(tok_dir), openai_model_name=MODEL)
    (engine,) = await start_engines(["--eos-token-id", str(eos_id())])
    await m.register(engine)
    script = [*tok.encode(TWO_CALLS, add_special_tokens=False), eos_id()]
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/debug/faults", json={"script_tokens": script}) as resp:
            assert resp.status == 200
    messages: list[Any] = [{"role": "system", "content": "you are a helpful agent"},
                           {"role": "user", "content": "what is the weather in paris"}]
    turn = dict(model=MODEL, tools=TOOLS, max_tokens=32, temperature=0)
    async with openai.AsyncOpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        first = await client.chat.completions.create(messages=messages, **turn, extra_headers={"X-Session-Id": "t"})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "paris"}), ("get_weather", {"city": "rome"})]
        p1, r1 = extra(first, "prompt_token_ids"), extra(choice, "token_ids")
        assert r1 == script

        # the same turn streamed (no session): the same ids, calls and finish
        names, args, ids, finish = {}, {}, [], None
        async for chunk in await client.chat.completions.create(messages=messages, **turn, stream=True):
            for c in chunk.choices:
                ids += extra(c, "token_ids") or []
                finish = c.finish_reason or finish
                assert not c.delta.content  # the calls' text is not content
                for d in c.delta.tool_calls or []:
                    names[d.index] = d.function.name
                    args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        assert ids == r1 and finish == "tool_calls"
        assert [(names[k], json.loads(args[k])) for k in sorted(names)] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls]

        async with m.session.post(engine.url + "/debug/faults", json={"script_tokens": None}) as resp:
            assert resp.status == 200
        # the agent appends the SDK's message object as it came and a result per call
        messages += [choice.message, *({"role": "tool", "tool_call_id": c.id, "content": w}
                                       for c, w in zip(calls, ["sunny", "rainy"]))]
        second = await client.chat.completions.create(messages=messages, model=MODEL, tools=TOOLS, max_tokens=5,
                                                      temperature=0, extra_body={"session_id": "t",
                                                                                 "ignore_eos": True})
    p2, r2 = extra(second, "prompt_token_ids"), extra(second.choices[0], "token_ids")
    tail = tok.encode("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n"
                      "</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert p2 == p1 + r1 + tail  # the model's ids as sampled, the results as the template writes them
    status, traj = await m.get("/v1/sessions/t/trajectory")
    assert status == 200 and traj["prompt_ids"] == p1 and traj["response_ids"] == r1 + tail + r2
    assert traj["response_mask"] == [1] * len(r1) + [0] * len(tail) + [1] * len(r2) and traj["divergences"] == []
    # the turn's ids are what /generate makes of the ledger's prompt
    status, replay = await m.post("/generate", {"input_ids": p2, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and replay["output_ids"] == r2


async def test_another_call_format_and_reasoning_are_read_with_the_tokenizers_response_schema(
        tmp_path: Path, start_manager: Any, start_engines: Any) -> None:
    """A second template family: Llama 3.x's JSON calls (``{"name": ..., "parameters": ...}``) after
    ``<think>`` reasoning, read with the response schema the tokenizer carries (transformers' parsing); the
    engine is made to write the answer (``script_tokens``). The SDK gets the reasoning as
    ``reasoning_content``, the call in OpenAI's shape, streamed as whole, and the next turn's prompt is the
    ledger's ids followed by the template's ``ipython`` turn."""
    from transformers import AutoTokenizer

    tok_dir = make(tmp_path / "llama", LLAMA3, LLAMA3_SCHEMA)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    m = await start_manager(openai_tokenizer_path=str(tok_dir), openai_model_name=MODEL)
    (engine,) = await start_engines(["--eos-token-id", str(llama3_eos_id())])
    await m.register(engine)
    said = '<think> weather in paris </think> {"name": "get_weather", "parameters": {"city": "paris"}}'
    script = [*tok.encode(said, add_special_tokens=False), llama3_eos_id()]
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/debug/faults", json={"script_tokens": script}) as resp:
            assert resp.status == 200
    messages: list[Any] = [{"role": "user", "content": "what is the weather in paris"}]
    turn = dict(model=MODEL, tools=TOOLS, max_tokens=32, temperature=0)
    async with openai.AsyncOpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        first = await client.chat.completions.create(messages=messages, **turn, extra_headers={"X-Session-Id": "l"})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert extra(choice.message, "reasoning_content") == "weather in paris"
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "paris"})
        p1, r1 = extra(first, "prompt_token_ids"), extra(choice, "token_ids")
        assert r1 == script

        content, reasoning, calls, finish = "", "", [], None
        async for chunk in await client.chat.completions.create(messages=messages, **turn, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                calls += [(d.function.name, json.loads(d.function.arguments)) for d in c.delta.tool_calls or []]
        assert (content, reasoning, calls, finish) == ("", "weather in paris", [("get_weather", {"city": "paris"})],
                                                       "tool_calls")

        async with m.session.post(engine.url + "/debug/faults", json={"script_tokens": None}) as resp:
            assert resp.status == 200
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = await client.chat.completions.create(messages=messages, model=MODEL, tools=TOOLS, max_tokens=3,
                                                      temperature=0, extra_body={"session_id": "l",
                                                                                 "ignore_eos": True})
    p2 = extra(second, "prompt_token_ids")
    tail = tok.encode("<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    assert p2 == p1 + r1 + tail  # the model's ids as sampled (its end token is the template's), then the result


async def test_top_logprobs_come_through_the_rollout_path_in_openais_shape(front: Any) -> None:
    """SGLang's ``output_top_logprobs`` (asked with ``top_logprobs_num``), gathered by the manager, as OpenAI's
    ``top_logprobs``: greedy, each sampled token is its own most likely one, with the same log-prob."""
    m, client = front
    turn = dict(model=MODEL, messages=[{"role": "user", "content": "what is the answer"}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = await client.chat.completions.create(**turn)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = []
    async for chunk in await client.chat.completions.create(**turn, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in streamed] == [
        [(t.token, t.logprob) for t in e.top_logprobs] for e in content]
    text = await client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=3, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    lp = text.choices[0].logprobs
    assert len(lp.top_logprobs) == 3 and all(len(row) == 2 for row in lp.top_logprobs)
    assert all(max(row.values()) == pytest.approx(sampled) for row, sampled in zip(lp.top_logprobs, lp.token_logprobs))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(**{**turn, "logprobs": False})
    assert caught.value.param == "top_logprobs"


async def test_with_auth_a_session_answers_only_to_the_owner_key_its_first_turn_gave(
        tmp_path: Path, start_manager: Any, start_engines: Any) -> None:
    token = "front-secret"
    m = await start_manager(auth_token=token, openai_tokenizer_path=str(make(tmp_path / "tokenizer")),
                            openai_model_name=MODEL)
    (engine,) = await start_engines(["--eos-token-id", str(eos_id())])
    await m.register(engine)

    def client(owner: str | None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=m.url + "/v1", api_key=token, max_retries=0, timeout=60,
                                  default_headers={"X-Session-Owner": owner} if owner else None)

    alice, bob, anyone = client("alice-key"), client("bob-key"), client(None)
    hello = [{"role": "user", "content": "hello what is the answer"}]
    mine = await alice.chat.completions.create(model=MODEL, messages=hello, max_tokens=4, temperature=0,
                                               extra_body={"session_id": "episode-1", "ignore_eos": True})
    ours = await bob.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "you are a agent"}],
                                             max_tokens=4, temperature=0,
                                             extra_body={"session_id": "episode-2", "ignore_eos": True})

    async def trajectory(owner: str, sid: str, method: str = "GET") -> tuple[int, Any]:
        path = f"/v1/sessions/{sid}" + ("/trajectory" if method == "GET" else "")
        async with aiohttp.ClientSession() as s, s.request(
                method, m.url + path, headers={"Authorization": f"Bearer {token}", "X-Session-Owner": owner}) as r:
            return r.status, await r.json()

    _, before = await trajectory("alice-key", "episode-1")
    again = [*hello, {"role": "assistant", "content": mine.choices[0].message.content},
             {"role": "user", "content": "again"}]
    for other in (bob, anyone):  # another caller reusing alice's session id: 403 naming it, in OpenAI's shape
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await other.chat.completions.create(model=MODEL, messages=again, max_tokens=4, temperature=0,
                                                extra_body={"session_id": "episode-1"})
        assert caught.value.param == "session_id" and caught.value.code == "session_owned", caught.value.body
        with pytest.raises(openai.PermissionDeniedError):
            await other.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2,
                                           extra_body={"session_id": "episode-1"})
    for method in ("GET", "DELETE"):  # nor read or freed by another caller
        status, body = await trajectory("bob-key", "episode-1", method)
        assert status == 403 and body["error"]["param"] == "session_id", body
    status, after = await trajectory("alice-key", "episode-1")
    assert status == 200 and after == before and after["turn_count"] == 1  # the refusals changed nothing
    assert after["prompt_ids"] == extra(mine, "prompt_token_ids")
    assert after["response_ids"] == extra(mine.choices[0], "token_ids")
    # the owner's next turn extends its own ledger as if nobody had tried
    second = await alice.chat.completions.create(model=MODEL, messages=again, max_tokens=4, temperature=0,
                                                 extra_body={"session_id": "episode-1", "ignore_eos": True})
    ids = after["prompt_ids"] + after["response_ids"]
    assert extra(second, "prompt_token_ids")[:len(ids)] == ids
    # one session never holds another's tokens: bob's is exactly his own turn
    status, theirs = await trajectory("bob-key", "episode-2", "DELETE")
    assert status == 200 and theirs["turn_count"] == 1
    assert theirs["prompt_ids"] == extra(ours, "prompt_token_ids")
    assert theirs["response_ids"] == extra(ours.choices[0], "token_ids")
    status, freed = await trajectory("alice-key", "episode-1", "DELETE")
    assert status == 200 and freed["turn_count"] == 2
    for c in (alice, bob, anyone):
        await c.close()


async def test_routed_experts_asked_for_through_the_front_cover_the_whole_session(start_front: Any) -> None:
    m, client = await start_front("--num-experts", "4", "--enable-return-routed-experts")
    session = {"X-Session-Id": "moe-1"}
    ask = {"return_routed_experts": True, "ignore_eos": True}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello what is the answer"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 extra_headers=session, extra_body=ask)
    p1, r1 = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    rows1 = base64.b64decode(extra(first.choices[0], "rollout")["routed_experts"])  # the answer carries them
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again please"}]
    second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                  extra_headers=session, extra_body=ask)
    p2, r2 = extra(second, "prompt_token_ids"), extra(second.choices[0], "token_ids")
    status, traj = await m.get("/v1/sessions/moe-1/trajectory")
    assert status == 200 and traj["prompt_ids"] + traj["response_ids"] == p2 + r2
    # one row per position but the last, the second turn's asked only from where the first's ended
    rows = base64.b64decode(traj["routed_experts"])
    assert traj["routed_experts_rows"] == len(p2) + len(r2) - 1
    width = len(rows1) // (len(p1) + len(r1) - 1)
    assert len(rows) == width * traj["routed_experts_rows"] and rows.startswith(rows1)
    # the same rows /generate gives for the whole sequence at once
    status, whole = await m.post("/generate", {"input_ids": p2, "return_routed_experts": True,
                                               "sampling_params": {"max_new_tokens": len(r2), "temperature": 0,
                                                                   "ignore_eos": True}})
    assert status == 200 and whole["output_ids"] == r2
    assert base64.b64decode(whole["meta_info"]["routed_experts"]) == rows
