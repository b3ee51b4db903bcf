"""A verl agent loop for agents written against the OpenAI API: the agent runs its turns through the manager's
OpenAI-compatible front with a session of its own, and the session's ledger (the exact ids each turn sent
and sampled) becomes verl's ``AgentLoopOutput``, so GRPO trains on the tokens the policy produced, not on a
re-tokenization of the conversation (docs/agents.md, "Training through verl").

verl 0.9.1 (``verl/experimental/agent_loop/agent_loop.py``): a loop is an ``AgentLoopBase`` registered by
name with ``@register``; verl's ``AgentLoopWorker`` instantiates it per sample (hydra, with the trainer
config, the tokenizer, ...) and calls ``run(sampling_params, **sample_fields)``. Which agent runs: the
``agent`` argument of the loop's entry in ``agent_loop_config_path`` (``agent: "mypkg.agents:solve"``), else
the sample's ``openai_agent`` field. The agent is ``async def solve(run: AgentRun) -> float | None``; what it
returns is the sample's reward (None: verl's reward function scores it). Rewards stay the user's.
"""

from __future__ import annotations

import importlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from rollout_manager.manager_client import bearer_headers, env_token

from .manager_address import resolve
from .routed_experts import REPLAY_KEY, ExpertsLayout, RoutedExpertsUnavailable, decode_routed_experts
from .settings import from_rollout_config

LOOP_NAME = "rollout_manager_openai"
SESSION_HEADER = "X-Session-Id"
OWNER_HEADER = "X-Session-Owner"  # a key of this sample's own: nobody else can read or continue its session
EXPERTS_HEADER = "X-Return-Routed-Experts"  # every turn asks for its routed experts (verl's routing replay)


@dataclass(frozen=True)
class AgentRun:
    """What the agent gets: an OpenAI client already pointed at the manager with this sample's session
    (every call it makes is a turn of that session), the model name, the sample's first messages, verl's
    sampling as OpenAI keyword arguments (``client.chat.completions.create(..., **run.sampling)``), and the
    sample's dataset fields."""

    client: Any  # openai.AsyncOpenAI
    model: str
    session_id: str
    messages: list[dict[str, Any]]
    sampling: dict[str, Any]
    sample: dict[str, Any]


AgentFn = Callable[[AgentRun], Awaitable[float | None]]


def load_agent(path: str) -> AgentFn:
    """``"module:function"`` (or ``module.function``) -> the function."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"the agent {path!r} is not a 'module:function' path")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"the agent {path!r} names no function")
    return fn


def openai_sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """verl's sampling (``temperature``, ``top_p``, ``top_k``, ...) as the OpenAI SDK's keyword arguments;
    ``top_k`` is SGLang's extra (``extra_body``). A repetition penalty other than 1 cannot be honoured by
    the front: refused rather than dropped."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if sampling_params.get(key) is not None:
            out[key] = sampling_params[key]
    top_k = sampling_params.get("top_k")
    if top_k is not None and top_k not in (-1, 0):
        out["extra_body"] = {"top_k": top_k}
    penalty = sampling_params.get("repetition_penalty")
    if penalty not in (None, 1, 1.0):
        raise ValueError(f"repetition_penalty {penalty} is not supported through the OpenAI front")
    return out


def trajectory_output(trajectory: dict[str, Any], reward: float | None, prompt_length: int, response_length: int,
                      elapsed_s: float, experts: ExpertsLayout | None = None) -> AgentLoopOutput:
    """A session's trajectory (``GET /v1/sessions/{id}/trajectory``) as verl's output: its ids, mask and
    log-probs as the ledger holds them, the response cut at ``response_length`` and the prompt's head cut
    to ``prompt_length`` (verl pads both to those lengths; its own loops cut the same way). ``experts``: the
    model's MoE shape when routing replay is on; the trajectory's routed experts, one row per position of
    the kept prompt and response but the last, as verl's own SGLang loop hands them."""
    prompt = list(trajectory["prompt_ids"])[-prompt_length:]
    response = list(trajectory["response_ids"])[:response_length]
    routed = None
    if experts is not None:
        rows = trajectory.get("routed_experts_rows", 0)
        held = len(trajectory["prompt_ids"]) + len(trajectory["response_ids"])
        if rows != held - 1:
            raise RoutedExpertsUnavailable(f"{REPLAY_KEY}: session {trajectory['session_id']} holds routed experts "
                                           f"for {rows} of its {held - 1} positions (a turn did not return them)")
        routed = decode_routed_experts(trajectory["routed_experts"], experts, rows=rows, rid=trajectory["session_id"])
        cut = len(trajectory["prompt_ids"]) - len(prompt)  # the prompt's head verl does not see
        routed = routed[cut:cut + len(prompt) + len(response)]
    extra = {"openai_session": trajectory["session_id"], "openai_turns": trajectory["turn_count"],
             "openai_divergences": len(trajectory["divergences"]),
             "openai_truncated": len(trajectory["response_ids"]) > response_length
             or len(trajectory["prompt_ids"]) > prompt_length}
    return AgentLoopOutput(prompt_ids=prompt, response_ids=response,
                           response_mask=list(trajectory["response_mask"])[:response_length],
                           response_logprobs=list(trajectory["response_logprobs"])[:response_length],
                           reward_score=reward, num_turns=2 * trajectory["turn_count"], routed_experts=routed,
                           metrics=AgentLoopMetrics(generate_sequences=elapsed_s), extra_fields=extra)


@register(LOOP_NAME)
class OpenAIAgentLoop(AgentLoopBase):
    """Runs the named agent against the manager's ``/v1`` with a fresh session, then reads and frees the
    session's trajectory (``DELETE /v1/sessions/{id}``) into an :class:`AgentLoopOutput`."""

    def __init__(self, *args: Any, agent: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_path = agent
        self.settings = from_rollout_config(self.rollout_config)
        self.experts = self._experts_layout()

    def _experts_layout(self) -> ExpertsLayout | None:
        """With verl's routing replay on, the model's MoE shape (its config, as verl's SGLang server reads it):
        every turn then asks for its routed experts and the output carries them."""
        if not self.rollout_config.get("enable_rollout_routing_replay", False):
            return None
        from types import SimpleNamespace

        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(self.config.actor_rollout_ref.model.path)
        return ExpertsLayout.of_model(SimpleNamespace(hf_config=hf))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        import aiohttp
        import openai

        path = self.agent_path or kwargs.get("openai_agent")
        if not path:
            raise ValueError(f"the {LOOP_NAME} agent loop needs an agent: the loop's 'agent' in "
                             "agent_loop_config_path, or the sample's 'openai_agent' field")
        agent = load_agent(str(path))
        url = resolve(self.settings)
        session_id, owner = f"verl-{uuid.uuid4().hex}", uuid.uuid4().hex
        messages = [dict(m) for m in kwargs.get("raw_prompt", [])]
        start = time.monotonic()
        token = env_token()  # the manager's auth_token, as the plugin's other clients send it
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token or "unused", max_retries=0,
                                      default_headers={SESSION_HEADER: session_id, OWNER_HEADER: owner,
                                                       **({EXPERTS_HEADER: "true"} if self.experts else {})}) as client:
            models = await client.models.list()
            run = AgentRun(client, models.data[0].id, session_id, messages, openai_sampling(sampling_params),
                           dict(kwargs))
            try:
                reward = await agent(run)
            finally:
                async with aiohttp.ClientSession(headers={**bearer_headers(token), OWNER_HEADER: owner}) as http, \
                        http.delete(f"{url}/v1/sessions/{session_id}") as resp:
                    trajectory = await resp.json() if resp.status == 200 else None
        if trajectory is None:
            raise RuntimeError(f"the agent made no turn in session {session_id} (nothing to train on)")
        return trajectory_output(trajectory, None if reward is None else float(reward),
                                 self.rollout_config.prompt_length, self.rollout_config.response_length,
                                 time.monotonic() - start, self.experts)
