"""The front's core: an OpenAI request -> prompt ids (rendered, or the ledger's) -> the manager's own
rollout path (the Generator ``/generate`` uses: placement, affinity by session, continuation on another
box, version segments) -> OpenAI's answer, and the turn into the session's ledger."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, cast

from rollout_manager import jsonutil
from rollout_manager.errors import ManagerError
from rollout_manager.manager import Manager
from rollout_manager.openai_front import responses, tool_calls
from rollout_manager.openai_front.errors import OpenAIError, invalid
from rollout_manager.openai_front.ledger import Ledger, PromptPlan, Session
from rollout_manager.openai_front.prompt import known_ids, plan_chat, plan_ids, retokenized
from rollout_manager.openai_front.render import Renderer
from rollout_manager.openai_front.schemas import ChatRequest, CompletionRequest, not_found_model
from rollout_manager.openai_front.schemas import prompts as prompts_of
from rollout_manager.rollout.generation import Generator
from rollout_manager.rollout.request import Request, SequenceRequest
from rollout_manager.sglang.answer import ErrorChunk, GenerateAnswer
from rollout_manager.sglang.generate_request import KnownIds
from rollout_manager.sglang.openai_turn import ForcedCalls, TurnResult, TurnSampling, read_answer, turn_body

log = logging.getLogger("rollout_manager.openai_front")
CHAT, CHAT_CHUNK, TEXT = "chat.completion", "chat.completion.chunk", "text_completion"


@dataclass
class Prepared:
    """A request checked and turned into prompt ids, ready to run; its session (if any) is held busy."""

    reply: responses.Reply
    chat: bool
    prompts: list[list[int]]
    n: int
    request: Request
    want_logprobs: bool
    renderer: Renderer | None
    session: Session | None = None
    plan: PromptPlan | None = None
    messages: list[dict[str, Any]] | None = None
    tool_names: frozenset[str] | None = None  # the declared functions, when the answer is read for calls
    parallel_tool_calls: bool = True
    prompt_json: bytes | None = None  # the one prompt's ids as JSON, encoded once for the engine and the answer
    known: KnownIds | None = None  # a session turn's prompt ids as the rollout path needs them (prompt.known_ids)

    @property
    def reads(self) -> bool:
        """Whether a chat answer is read with the response schema: tools declared, or the schema reads
        reasoning."""
        return self.chat and self.renderer is not None and (self.tool_names is not None
                                                            or self.renderer.reads_reasoning)

    def answer(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat answer's assistant message (content, and reasoning and tool calls when read for them)
        and its finish."""
        if not self.reads:
            return {"role": "assistant", "content": text}, finish
        assert self.renderer is not None
        parsed = tool_calls.parse(text, self.renderer.read, self.tool_names, self.parallel_tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning  # SGLang's OpenAI server's field name
        if parsed.calls:
            message["tool_calls"] = [c.to_json() for c in parsed.calls]
        return message, tool_calls.finish_reason(finish, parsed.calls)


def _failure(exc: ManagerError) -> OpenAIError:
    return OpenAIError(exc.status, str(exc), None, exc.reason)


class Front:
    def __init__(self, manager: Manager) -> None:
        cfg = manager.config
        self.manager = manager
        self.model = cfg.openai_model_name
        self.tokenizer_path = cfg.openai_tokenizer_path
        self.ledger = Ledger(cfg.openai_max_sessions, cfg.openai_session_max_tokens, cfg.openai_session_idle_s)
        self.created = int(time.time())
        self._renderer: Renderer | None = None
        self._loading: asyncio.Lock = asyncio.Lock()

    @property
    def generator(self) -> Generator:
        generator = self.manager.generator
        assert generator is not None
        return generator

    async def renderer(self, needed_by: str | None) -> Renderer | None:
        """The tokenizer, loaded on first use off the event loop; a 400 naming ``needed_by`` when none is
        configured and the request needs one (None: optional)."""
        if self._renderer is None and self.tokenizer_path:
            async with self._loading:
                if self._renderer is None:
                    try:
                        self._renderer = await asyncio.to_thread(Renderer, self.tokenizer_path)
                    except Exception as exc:
                        log.error("openai_tokenizer_path %s: %s", self.tokenizer_path, exc)
                        raise OpenAIError(500, f"the manager's tokenizer (openai_tokenizer_path) did not load: "
                                          f"{exc}", None, "tokenizer_unavailable") from None
        if self._renderer is None and needed_by is not None:
            raise invalid(needed_by, "this manager has no tokenizer (openai_tokenizer_path is not set): send "
                          "token ids to /v1/completions", "tokenizer_not_configured")
        return self._renderer

    def _sampling(self, body: ChatRequest | CompletionRequest, budget: int | None, choice: int,
                  forced: ForcedCalls | None, experts_from: int) -> TurnSampling:
        seed = None if body.seed is None else body.seed + choice  # n choices from one seed: not n copies
        return TurnSampling(budget, body.temperature, body.top_p, seed, body.stops, body.stop_token_ids,
                            body.top_k, body.min_p, body.ignore_eos, body.top_count, forced,
                            experts_from if body.return_routed_experts else None)

    def _check_ids(self, ids: list[int], field: str) -> None:
        try:
            self.generator.vocab.check(ids, field)
        except ManagerError as exc:
            raise invalid(field, str(exc)) from None

    def _request(self, body: ChatRequest | CompletionRequest, prompts: list[list[int]], budget: int | None,
                 session_id: str | None, forced: ForcedCalls | None = None, experts_from: int = 0,
                 ids_json: bytes | None = None, known: KnownIds | None = None) -> Request:
        """``experts_from``: with ``return_routed_experts``, the first position whose experts are wanted (a
        session's turn asks only for the rows its branch lacks); ``ids_json``: the one prompt's JSON;
        ``known``: what the session's ledger gave of the one prompt's ids."""
        seqs = [SequenceRequest(turn_body(ids, self._sampling(body, budget, j, forced, experts_from),
                                          stream=body.stream, ids_json=ids_json, known=known), session_id)
                for ids in prompts for j in range(body.n)]
        return Request(seqs, batched=len(seqs) > 1, stream=body.stream)

    def _known(self, session: Session | None, plan: PromptPlan | None) -> KnownIds | None:
        """A session turn's :class:`KnownIds`, made from its branch and its new ids only."""
        if session is None or plan is None:
            return None
        table = self.generator.dispatcher.affinity
        return known_ids(plan, session.branch, table.settings.block_tokens if table is not None else 0)

    def _reply(self, prefix: str, session_id: str | None) -> responses.Reply:
        return responses.Reply(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model, session_id)

    def _open(self, session_id: str | None, n: int, owner: str | None) -> Session | None:
        if session_id is None:
            return None
        if n != 1:
            raise invalid("n", "a session's turn samples one answer (n=1): the ledger keeps one history")
        return self.ledger.begin(session_id, owner)

    async def prepare_chat(self, body: ChatRequest, session_id: str | None, owner: str | None = None) -> Prepared:
        if body.model != self.model:
            raise not_found_model(body.model, self.model)
        renderer = await self.renderer("messages")
        assert renderer is not None
        session = self._open(session_id, body.n, owner)
        try:
            branch = None if session is None else session.branch
            turn = 0 if session is None else session.turn_count
            tools = body.tools if body.tool_choice != "none" else None  # as SGLang: "none" hides them
            plan = plan_chat(renderer, branch, turn, body.messages, tools)
            held = len(branch.ids) if branch is not None and plan.extends else 0
            self._check_ids(plan.ids[held:], "messages")  # the ledger's own ids were checked when they came
            if session is not None:
                self.ledger.check_room(session, plan)
            parallel = body.parallel_tool_calls is not False
            ids_json = jsonutil.dumps(plan.ids)  # sent to the engine and returned in the answer: encoded once
            known = self._known(session, plan)
            request = self._request(body, [plan.ids], body.budget, session_id,
                                    tool_calls.forced(tools, body.tool_choice, parallel),
                                    branch.expert_rows if branch is not None and plan.extends else 0, ids_json,
                                    known)
        except BaseException:
            if session is not None:
                self.ledger.end(session)
            raise
        names = None
        if tools:  # the answer is read for calls (tool_calls.py, with the model's response schema)
            names = frozenset(str(t["function"]["name"]) for t in tools)
        return Prepared(self._reply("chatcmpl", session_id), True, [plan.ids], body.n, request, body.logprobs,
                        renderer, session, plan, list(body.messages), names, body.parallel_tool_calls is not False,
                        ids_json, known)

    async def prepare_completion(self, body: CompletionRequest, session_id: str | None,
                                 owner: str | None = None) -> Prepared:
        if body.model != self.model:
            raise not_found_model(body.model, self.model)
        given = prompts_of(body.prompt)
        texts = given if isinstance(given[0], str) else None
        renderer = await self.renderer("prompt" if texts is not None else None)
        if texts is not None:
            assert renderer is not None
            ids_list = [renderer.encode(str(t)) for t in texts]
        else:
            ids_list = cast("list[list[int]]", given)
        for i, ids in enumerate(ids_list):
            if not ids:
                raise invalid("prompt", f"prompt {i} has no tokens")
            self._check_ids(ids, "prompt")
        if session_id is not None and len(ids_list) != 1:
            raise invalid("prompt", "a session's turn has one prompt")
        session = self._open(session_id, body.n, owner)
        plan = None
        try:
            if session is not None:
                plan = plan_ids(session.branch, session.turn_count, ids_list[0])
                self.ledger.check_room(session, plan)
            branch = None if session is None else session.branch
            held = branch.expert_rows if branch is not None and plan is not None and plan.extends else 0
            known = self._known(session, plan)
            request = self._request(body, ids_list, body.budget, session_id, experts_from=held, known=known)
        except BaseException:
            if session is not None:
                self.ledger.end(session)
            raise
        return Prepared(self._reply("cmpl", session_id), False, ids_list, body.n, request, body.logprobs is not None,
                        renderer, session, plan, known=known)

    # ------------------------------------------------------------------ running
    def _text(self, p: Prepared, answer: GenerateAnswer, ids: list[int]) -> str:
        return p.renderer.decode(ids) if p.renderer is not None else (answer.text or "")

    def _tokens(self, p: Prepared, ids: list[int]) -> list[str]:
        return [p.renderer.token_text(t) for t in ids] if p.renderer is not None else [str(t) for t in ids]

    def _logprobs(self, p: Prepared, ids: list[int], lps: list[float | None],
                  tops: list[list[tuple[int, float]]] | None, offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's log-probs of ``ids`` (``tops``: their most likely alternatives, when asked for)."""
        if not p.want_logprobs:
            return None
        tokens = self._tokens(p, ids)
        named = None
        if tops is not None:
            named = [[(p.renderer.token_text(t) if p.renderer is not None else str(t), lp) for t, lp in row]
                     for row in tops]
        if p.chat:
            return responses.chat_logprobs(tokens, lps, named)
        return responses.completion_logprobs(tokens, lps, offset, named)

    def _record(self, p: Prepared, result: TurnResult, answer: dict[str, Any] | None) -> None:
        if p.session is not None and p.plan is not None:
            start = p.request.sequences[0].body.experts_from  # the first position whose experts were asked for
            self.ledger.record(p.session, p.plan, p.messages, result, answer, start, p.known)

    async def check(self, session: Session) -> None:
        """Each branch's re-tokenization divergence (:func:`.prompt.retokenized`), found when its trajectory
        is read and again only once it grew: one rendering of the history per read, off the event loop,
        where checking every turn would cost every turn the whole history."""
        renderer = self._renderer
        if renderer is None:
            return
        for branch in session.branches:
            if branch.messages and branch.checked != len(branch.ids):
                self.ledger.checked(branch, await asyncio.to_thread(retokenized, renderer, branch))

    def close(self, p: Prepared) -> None:
        """The turn is over (answered, failed or abandoned): its session takes the next turn."""
        if p.session is not None:
            self.ledger.end(p.session)

    async def run(self, p: Prepared) -> dict[str, Any]:
        """A non-streamed answer."""
        try:
            try:
                out = await self.generator.generate(p.request)
            except ManagerError as exc:
                raise _failure(exc) from None
            answers = out if isinstance(out, list) else [out]
            choices, made = [], 0
            for i, answer in enumerate(answers):
                assert answer is not None
                result = read_answer(answer)
                text = self._text(p, answer, result.output_ids)
                lp = self._logprobs(p, result.output_ids, result.logprobs, result.top_logprobs)
                message = None
                if p.chat:
                    message, finish = p.answer(text, result.finish_reason)
                    choices.append(responses.chat_choice(i, message, finish, result, lp))
                else:
                    choices.append(responses.completion_choice(i, text, result, lp))
                made += len(result.output_ids)
                if i == 0:
                    self._record(p, result, message)
            prompt_tokens = sum(map(len, p.prompts)) * p.n
            return responses.whole(p.reply, CHAT if p.chat else TEXT, choices, p.prompts, prompt_tokens, made,
                                   p.prompt_json)
        finally:
            self.close(p)

    async def stream(self, p: Prepared, include_usage: bool) -> AsyncGenerator[dict[str, Any], None]:
        """The answer as OpenAI's stream chunks (the caller writes ``data: [DONE]`` after the last)."""
        kind = CHAT_CHUNK if p.chat else TEXT
        count = len(p.request.sequences)
        sent_ids, sent_text = [0] * count, [""] * count
        finals: list[TurnResult | None] = [None] * count
        answers: list[dict[str, Any] | None] = [None] * count
        chunks = self.generator.generate_stream(p.request)
        try:
            if p.chat:
                yield responses.chunk(p.reply, kind, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None, "token_ids": []}
                                                      for i in range(count)])
            async for ready in chunks:
                out = []
                for item in ready:
                    if isinstance(item, ErrorChunk):
                        err = OpenAIError(item.status, item.message)
                        yield err.to_json()
                        return
                    i = item.index if p.request.batched and isinstance(item.index, int) else 0
                    result = read_answer(item)
                    ids = result.output_ids
                    text = self._text(p, item, ids)
                    if text.endswith("\ufffd") and result.finish_reason is None:
                        text = sent_text[i]  # a character cut between tokens: wait for its other bytes
                    new_ids, new_lps = ids[sent_ids[i]:], result.logprobs[sent_ids[i]:]
                    delta = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else text
                    new_tops = None if result.top_logprobs is None else result.top_logprobs[sent_ids[i]:]
                    lp = self._logprobs(p, new_ids, new_lps, new_tops, len(sent_text[i])) if new_ids else None
                    choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": result.finish_reason,
                                              "token_ids": new_ids}
                    if p.chat:
                        if p.reads:  # read with the schema: the message comes whole when the answer is
                            delta = ""
                        message = None
                        if result.finish_reason is not None:
                            message, choice["finish_reason"] = p.answer(text, result.finish_reason)
                            answers[i] = message
                            if p.reads:
                                delta = message["content"] or ""
                        choice["delta"] = {"content": delta} if delta or result.finish_reason is None else {}
                        if message is not None and "reasoning_content" in message:
                            choice["delta"]["reasoning_content"] = message["reasoning_content"]
                        if message is not None and message.get("tool_calls"):
                            choice["delta"]["tool_calls"] = [{"index": k, **c}
                                                             for k, c in enumerate(message["tool_calls"])]
                    else:
                        choice["text"] = delta
                    if result.finish_reason is not None:
                        choice["rollout"] = responses.rollout_info(result)
                        finals[i] = result
                    sent_ids[i], sent_text[i] = len(ids), text
                    out.append(choice)
                if out:
                    yield responses.chunk(p.reply, kind, out)
            first = finals[0]
            if first is not None:
                self._record(p, first, answers[0])
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in p.prompts) * p.n
                yield responses.chunk(p.reply, kind, [], responses.usage(prompt_tokens, sum(sent_ids)))
        finally:
            await chunks.aclose()
            self.close(p)
