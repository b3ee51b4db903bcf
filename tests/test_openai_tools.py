"""Tool calls in the OpenAI front without processes: an answer read with a response schema by transformers
(the hermes one the product ships, for a tokenizer that carries none: the results SGLang 0.5.23's
HermesDetector gives; a tokenizer's own schema when it carries one), and a tool conversation's next turn
extending the session's ledger exactly (the model's ids kept, the tool results as template tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai_tokenizer import LLAMA3, LLAMA3_SCHEMA, make

from rollout_manager.openai_front import tool_calls
from rollout_manager.openai_front.errors import OpenAIError
from rollout_manager.openai_front.ledger import Ledger
from rollout_manager.openai_front.prompt import plan_chat, retokenized
from rollout_manager.openai_front.render import Renderer
from rollout_manager.openai_front.schemas import check_messages, check_tools
from rollout_manager.sglang.openai_turn import TurnResult, TurnSampling, turn_body

NAMES = frozenset({"get_weather"})
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TWO_CALLS = ('<tool_call> {"name": "get_weather", "arguments": {"city": "paris"}} </tool_call> '
             '<tool_call> {"name": "get_weather", "arguments": {"city": "rome"}} </tool_call>')


def test_an_answer_is_read_into_content_and_calls(renderer: Renderer) -> None:
    def parse(text: str, names: frozenset[str] | None = NAMES, parallel: bool = True) -> tool_calls.Parsed:
        return tool_calls.parse(text, renderer.read, names, parallel)

    parsed = parse("let me look \n" + TWO_CALLS)
    assert parsed.content == "let me look" and parsed.reasoning is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "paris"}),
                                                                         ("get_weather", {"city": "rome"})]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id
    assert tool_calls.finish_reason("stop", parsed.calls) == "tool_calls"
    assert tool_calls.finish_reason("length", parsed.calls) == "length"
    only = parse(TWO_CALLS, parallel=False)
    assert only.content is None and len(only.calls) == 1  # parallel_tool_calls false: the first call
    unclosed = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "rome"}}')
    assert len(unclosed.calls) == 1
    listed = parse('<tool_call>[{"name": "get_weather", "arguments": {"city": "rome"}}, '
                   '{"name": "get_weather", "parameters": {"city": "paris"}}]</tool_call>')
    assert [json.loads(c.arguments) for c in listed.calls] == [{"city": "rome"}, {"city": "paris"}]  # a list per block
    unknown = parse('hi <tool_call>{"name": "launch", "arguments": {}}</tool_call>')
    assert unknown.calls == [] and unknown.content == "hi"  # a call to an undeclared function is dropped
    broken = "hi <tool_call>{not json</tool_call>"
    assert parse(broken) == tool_calls.Parsed(broken, [])  # the whole text stays content
    assert parse("no call here ") == tool_calls.Parsed("no call here ", [])
    # Qwen3's reasoning, before a call or an answer; without tools declared calls are not read
    thought = parse("<think> weather in paris </think>\n\n" + TWO_CALLS)
    assert thought.reasoning == "weather in paris" and thought.content is None and len(thought.calls) == 2
    assert parse("<think> sunny </think> paris", None) == tool_calls.Parsed("paris", [], "sunny")
    assert parse(TWO_CALLS, None) == tool_calls.Parsed(TWO_CALLS, [])
    assert renderer.reads_reasoning  # </think> is one of its tokens: every chat answer is read for reasoning


def test_without_a_think_token_answers_are_not_read_for_reasoning_with_the_shipped_schema(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_end|>", "hello"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(tmp_path)
    assert not Renderer(str(tmp_path)).reads_reasoning


def test_a_tokenizers_own_response_schema_is_the_one_read(tmp_path: Path) -> None:
    """A tokenizer that carries a ``response_schema`` (tokenizer_config.json) is read with it, not the hermes
    one: here Llama 3.x's JSON calls (``{"name": ..., "parameters": ...}``) after ``<|python_tag|>``."""
    own = Renderer(str(make(tmp_path / "llama", LLAMA3, LLAMA3_SCHEMA)))
    assert own.schema == LLAMA3_SCHEMA
    text = 'paris first <|python_tag|>{"name": "get_weather", "parameters": {"city": "paris"}}'
    parsed = tool_calls.parse(text, own.read, NAMES)
    assert parsed.content == "paris first" and [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", '{"city": "paris"}')]
    assert tool_calls.parse("<tool_call>{}</tool_call>", own.read, NAMES).content == "<tool_call>{}</tool_call>"


def test_tools_and_tool_messages_are_checked_naming_the_field() -> None:
    cases: list[tuple[Any, Any, str]] = [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None,
         "tools[0].function.parameters"),
        (TOOLS + TOOLS, None, "tools[1].function.name"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        (None, "required", "tool_choice"),
    ]
    for tools, choice, param in cases:
        with pytest.raises(OpenAIError) as caught:
            check_tools(tools, choice)
        assert caught.value.status == 400 and caught.value.param == param
    check_tools(TOOLS, "required")  # well formed
    with pytest.raises(OpenAIError) as caught:
        check_messages([{"role": "tool", "content": "sunny"}])
    assert caught.value.param == "messages[0].tool_call_id"
    with pytest.raises(OpenAIError) as caught:
        check_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                                    "arguments": 3}}]}])
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(str(make(Path(tmp_path_factory.mktemp("tok")))))


def test_a_tool_conversations_next_turn_extends_the_ledger(renderer: Renderer) -> None:
    ledger = Ledger(8, 10_000, 60.0)
    session = ledger.begin("s")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "weather in paris"}]
    first = plan_chat(renderer, None, 0, messages, TOOLS)
    assert first.ids == renderer.encode(renderer.chat_text(messages, TOOLS, True))
    end = renderer.encode("<|im_end|>")[0]
    sampled = [*renderer.encode(TWO_CALLS), end]  # what the model wrote: two calls, then the end token
    parsed = tool_calls.parse(renderer.decode(sampled), renderer.read, NAMES)
    answer = {"role": "assistant", "content": parsed.content, "tool_calls": [c.to_json() for c in parsed.calls]}
    ledger.record(session, first, messages, TurnResult(sampled, [-0.5] * len(sampled), "stop", end, 0, "v1", [], []),
                  answer)
    ledger.end(session)
    # the agent sends back the calls (their arguments parsed to objects, as some harnesses do) and two results
    back = {"role": "assistant", "content": None,
            "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                           for c in answer["tool_calls"]]}
    results = [{"role": "tool", "tool_call_id": c.id, "content": w} for c, w in zip(parsed.calls, ["sunny", "rainy"])]
    messages += [back, *results]
    second = plan_chat(renderer, session.branch, 1, messages, TOOLS)
    n = len(first.ids) + len(sampled)
    assert second.extends and second.ids[:n] == first.ids + sampled  # the model's ids, not re-tokenized
    assert second.ids[n:] == renderer.encode("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                                             "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")
    ledger.record(session, second, messages, TurnResult([7], [-0.1], "length", None, 0, "v1", [], []),
                  {"role": "assistant", "content": renderer.decode([7])})
    branch = session.branch
    assert branch is not None and branch.mask.tolist() == [1] * len(sampled) + [0] * (len(second.ids) - n) + [1]
    # the template writes the calls back as the model wrote them (a word per JSON piece): nothing diverged
    assert retokenized(renderer, branch) is None and len(session.branches) == 1


def test_a_forced_call_asks_the_boxes_for_a_call_in_the_templates_format_to_the_declared_functions(
        renderer: Renderer) -> None:
    two = [*TOOLS, {"type": "function", "function": {"name": "get_time"}}]
    assert tool_calls.forced(two, "auto", True) is None and tool_calls.forced(two, "none", True) is None
    assert tool_calls.forced(None, "required", True) is None
    required = tool_calls.forced(two, "required", True)
    assert required is not None and not required.one and [t.begin for t in required.tags] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>\n{"name": "get_time", "arguments": ']
    assert required.tags[0].schema == TOOLS[0]["function"]["parameters"]
    assert required.tags[1].schema == {"type": "object"}  # no parameters given: any object
    named = tool_calls.forced(two, {"type": "function", "function": {"name": "get_time"}}, False)
    assert named is not None and named.one and [t.begin for t in named.tags] == [required.tags[1].begin]
    # what reaches SGLang: its structural_tag sampling parameter, xgrammar's triggered tags
    body = turn_body([1, 2], TurnSampling(8, forced=named), stream=False)
    tag = json.loads(body.sampling.rest["structural_tag"])
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert fmt["at_least_one"] and fmt["stop_after_first"]
    assert [(t["begin"], t["end"]) for t in fmt["tags"]] == [(named.tags[0].begin, "}\n</tool_call>")]
    # the template writes a call as the grammar makes it, so the parser reads it back
    text = named.tags[0].begin + '{"zone": "utc"}' + named.tags[0].end
    assert [(c.name, c.arguments) for c in tool_calls.parse(text, renderer.read, frozenset({"get_time"})).calls] == [
        ("get_time", '{"zone": "utc"}')]
