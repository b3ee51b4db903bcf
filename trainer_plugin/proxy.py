"""The light "server" verl's rollout replicas point at: verl's generate calls become manager calls.

verl 0.9.1 has no config field that points at servers it did not start; its route for generation is
``LLMServerClient.generate`` -> load balancer -> ``server_handle.generate.remote(...)`` on a Ray actor
that its ``RolloutReplica`` launched. :class:`ManagerProxyServer` is that actor for
``rollout.name=sglang-disaggregated``: the ``generate`` calls arriving together (a step's agent loops
all start at once) go to the manager as one ``POST /batch_generate_requests`` (see
:mod:`trainer_plugin.request_batcher`; the manager picks the instances, continues a sequence whose
instance dies, and records the weight version of every segment), each answered as soon as its own
result comes back; ``batch_window_ms=0`` sends each as its own ``POST /generate``. The memory
controls verl sends to colocated engines (sleep, wake_up, KV-cache release) are no-ops, because the
remote boxes do not share GPUs with the trainer.

Nothing here imports verl at module level except inside :meth:`ManagerProxyServer.generate` (for
``TokenOutput``), so the translation helpers are testable on their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_manager.sglang.answer import ReceivedAnswer

from .client import ManagerClient, ManagerHTTPError
from .client_errors import ManagerUnavailable
from .relay_spread import RelaySpread
from .request_batcher import RequestBatcher
from .routed_experts import (
    REQUEST_FIELD,
    ExpertsLayout,
    FleetExperts,
    RoutedExpertsUnavailable,
    decode_routed_experts,
    refusal_error,
    require_routed_experts,
)
from .trajectory_keys import TrajectoryKeys

log = logging.getLogger("trainer_plugin.proxy")

# verl sampling keys that SGLang's /generate knows under the same name
_PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                 "n", "min_new_tokens", "sampling_seed", "no_stop_trim", "spaces_between_special_tokens")
# verl (vLLM) names SGLang spells differently; SGLang >= 0.5.22 refuses unknown sampling keys with 400.
_RENAMED = {"seed": "sampling_seed"}


def build_generate_body(prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str | None, *,
                        prompt_length: int, response_length: int, max_model_len: int | None = None,
                        trajectory_key: str | None = None, min_weight_version: int | None = None,
                        return_routed_experts: bool = False, group_key: str | None = None) -> dict[str, Any]:
    """verl's sampling dict -> a manager ``/generate`` body, as verl's own SGLang server does it.

    ``max_new_tokens``: the caller's ``max_new_tokens``/``max_tokens``, else
    ``min(response_length, prompt_length + response_length - len(prompt))``; clamped to what the
    model context leaves. ``logprobs`` -> ``return_logprob``. ``request_id`` is the engine's ``rid``;
    ``trajectory_key`` (default: ``request_id``) the manager's affinity key, which it strips before the
    engine (see :mod:`trainer_plugin.trajectory_keys` for the key verl's agent loops get).
    ``min_weight_version`` (the manager's own field, see :func:`weight_floor`): the oldest weight version
    the sequence may run on. ``return_routed_experts``: verl's routing replay (see
    :mod:`trainer_plugin.routed_experts`). ``group_key`` (the manager's own field): the sample's GRPO
    group, verl's ``uid``, whose siblings' lengths predict its own (without it the manager groups the
    samples of one prompt).
    """
    params = dict(sampling_params)
    if params.get("max_new_tokens") is not None:
        budget = int(params.pop("max_new_tokens"))
        params.pop("max_tokens", None)
    elif params.get("max_tokens") is not None:
        budget = int(params.pop("max_tokens"))
    else:
        params.pop("max_tokens", None)
        params.pop("max_new_tokens", None)
        budget = min(response_length, prompt_length + response_length - len(prompt_ids))
    if max_model_len:
        room = max_model_len - len(prompt_ids) - 1
        if room < 0:
            raise ValueError(f"prompt length ({len(prompt_ids)}) exceeds the model's maximum context "
                             f"length ({max_model_len})")
        budget = min(budget, room)
    return_logprob = bool(params.pop("logprobs", False))
    for old, new in _RENAMED.items():
        if params.get(old) is not None:
            params.setdefault(new, params[old])
    sampling = {k: params[k] for k in _PASS_THROUGH if k in params and params[k] is not None}
    sampling["max_new_tokens"] = max(0, budget)
    body: dict[str, Any] = {"input_ids": [int(t) for t in prompt_ids], "sampling_params": sampling}
    if return_logprob:
        body["return_logprob"] = True
    if return_routed_experts:
        body[REQUEST_FIELD] = True
    if request_id:
        body["rid"] = str(request_id)
    key = trajectory_key or request_id
    if key:
        body["trajectory_key"] = str(key)
    if min_weight_version is not None:
        body["min_weight_version"] = int(min_weight_version)
    if group_key:
        body["group_key"] = str(group_key)
    return body


def group_key_of(kwargs: dict[str, Any]) -> str | None:
    """verl's GRPO group key of a ``generate`` call: the ``uid`` of its sample, when the agent loop hands it
    on (``LLMServerClient.generate`` passes its extra keyword arguments to the server). verl 0.9.1's own
    agent loops keep the ``uid`` to themselves: the manager then groups the samples of one prompt, which is
    the GRPO group of a single-turn loop."""
    uid = kwargs.get("uid")
    if uid is None:
        return None
    text = str(uid.item() if hasattr(uid, "item") else uid)
    return text if 0 < len(text) <= 512 else None


def weight_floor(published: int | None, max_staleness: int) -> int | None:
    """The ``min_weight_version`` to ask for: at most ``max_staleness`` versions behind the version the
    trainer published (``published``: verl's ``global_steps``); None when unbounded (``max_staleness`` < 0)
    or nothing was published yet."""
    if max_staleness < 0 or published is None:
        return None
    return max(int(published) - max_staleness, 0)


def token_output_fields(result: dict[str, Any], return_logprob: bool,
                        fallback_global_steps: int | None = None, *, experts: ExpertsLayout | None = None,
                        prompt_len: int = 0) -> dict[str, Any]:
    """A manager ``/generate`` answer -> keyword arguments of verl's ``TokenOutput``.

    ``experts``: the model's layout when routing replay asked for them (``routed_experts``: rows for the
    ``prompt_len`` prompt tokens and the output but its last token, as verl's SGLang server hands them)."""
    out = ReceivedAnswer.from_json(result)
    token_ids = list(out.output_ids)
    log_probs = None
    if return_logprob:
        n = len(out.token_logprobs)
        if n != len(token_ids):
            raise ValueError(f"request {out.rid}: {n} log-probs for {len(token_ids)} tokens")
        log_probs = [_logprob(v, out.rid, i) for i, v in enumerate(out.token_logprobs)]
    versions = out.weight_versions
    steps = [_as_int(v) for v in versions]
    known = [s for s in steps if s is not None]
    global_steps = _as_int(out.weight_version)
    if global_steps is None:
        global_steps = fallback_global_steps
    extra: dict[str, Any] = {
        "global_steps": global_steps,
        "min_global_steps": min(known) if known else global_steps,
        "max_global_steps": max(known) if known else global_steps,
        "weight_version": out.weight_version,
        "weight_versions": versions,
        "segments": [s.to_json() for s in out.segments],
        "request_id": out.rid,
    }
    fields: dict[str, Any] = {"token_ids": token_ids, "log_probs": log_probs, "stop_reason": out.finish_type,
                              "extra_fields": extra}
    if experts is not None:
        fields["routed_experts"] = decode_routed_experts(out.routed_experts, experts,
                                                         rows=prompt_len + len(token_ids) - 1, rid=out.rid)
    return fields


def _logprob(value: float | None, rid: str | None, i: int) -> float:
    if value is None:
        raise ValueError(f"request {rid}: output token {i} has no log-prob")
    return value


def _as_int(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


class ManagerProxyServer:
    """The server object behind every ``sglang-disaggregated`` replica (run as a Ray actor).

    Method names and signatures are those verl calls on its rollout servers
    (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``).
    """

    def __init__(self, manager_url: str, *, prompt_length: int, response_length: int,
                 max_model_len: int | None = None, timeout_s: float = 30.0,
                 batch_window_s: float = 0.005, max_batch: int = 1024,
                 client_options: dict[str, Any] | None = None, max_staleness: int = -1,
                 routed_experts: ExpertsLayout | None = None, ray_relays: bool = False):
        """``client_options``: more :class:`ManagerClient` arguments (stall and restart bounds);
        ``max_staleness``: how many versions behind the published one a sample may be made by (-1: any;
        sent as ``min_weight_version``, see :func:`weight_floor`); ``routed_experts``: the model's MoE
        layout when verl's routing replay is on (None: off); ``ray_relays``: the manager runs as Ray actors, and
        every generate call goes out as part of a batch spread over its relays, found through Ray (``relay_spread``;
        with no batching window a batch of the calls made together), its health and fleet checks to a relay that
        answers then."""
        self.manager_url = manager_url
        self.client_options = dict(client_options or {})
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self.global_steps: int | None = None
        self.max_staleness = max_staleness
        self.batch_window_s = batch_window_s
        self.max_batch = max_batch
        self.routed_experts = routed_experts
        self._fleet_check: asyncio.Task[FleetExperts] | None = None  # the first replay request's, shared
        self._client: ManagerClient | None = None
        self._batcher: RequestBatcher | None = None
        self._spread: RelaySpread | None = None
        if ray_relays:
            from .relay_actors import find

            self._spread = RelaySpread(find, {"timeout_s": self.timeout_s, **self.client_options})
        # verl sends a fresh request id per turn: the trajectory is recognised by its token context
        self.trajectories = TrajectoryKeys()

    @property
    def client(self) -> ManagerClient:
        if self._client is None:
            self._client = ManagerClient(self.manager_url, **{"timeout_s": self.timeout_s, **self.client_options})
        return self._client

    @property
    def batcher(self) -> RequestBatcher | None:
        if self._batcher is None and (self.batch_window_s > 0 or self._spread is not None):  # relays: always
            self._batcher = RequestBatcher(self._spread or self.client, window_s=self.batch_window_s,
                                           max_batch=self.max_batch)
        return self._batcher

    def get_server_address(self) -> tuple[str, int]:
        hostport = self.manager_url.split("://", 1)[-1]
        host, _, port = hostport.rpartition(":")
        return host.strip("[]"), int(port)

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError("sglang-disaggregated rollout is text-only: the manager continues "
                                      "sequences token by token and does not forward multi-modal data")
        if hasattr(prompt_ids, "tolist"):
            prompt_ids = prompt_ids.tolist()
        prompt_ids = list(prompt_ids)
        key = self.trajectories.key_for(prompt_ids, str(request_id))
        experts = self.routed_experts
        body = build_generate_body(prompt_ids, sampling_params, request_id,
                                   prompt_length=self.prompt_length, response_length=self.response_length,
                                   max_model_len=self.max_model_len, trajectory_key=key,
                                   min_weight_version=weight_floor(self.global_steps, self.max_staleness),
                                   return_routed_experts=experts is not None, group_key=group_key_of(kwargs))
        if experts is not None:
            await self._fleet_checked()
        batcher = self.batcher
        try:
            result = await (batcher.generate(body) if batcher is not None else self.client.generate(body))
        except ManagerHTTPError as exc:
            refused = refusal_error(exc.status, exc.message) if experts is not None else None
            if refused is not None:
                raise refused from exc
            raise
        fields = token_output_fields(result, bool(body.get("return_logprob")), self.global_steps,
                                     experts=experts, prompt_len=len(prompt_ids))
        self.trajectories.finished(key, prompt_ids, fields["token_ids"])
        extra = fields["extra_fields"]
        if extra["global_steps"] is not None:  # the newest integer version seen stands in for unknown ones
            self.global_steps = max(self.global_steps or 0, extra["global_steps"])
        else:  # (verl's metrics turn these into an int array: None would fail the step)
            fallback = self.global_steps or 0
            for key in ("global_steps", "min_global_steps", "max_global_steps"):
                extra[key] = fallback if extra[key] is None else extra[key]
        return TokenOutput(**fields)

    async def check_routed_experts(self) -> FleetExperts:
        """With routing replay on: fail unless some instance of the manager can return routed experts
        (see :func:`~trainer_plugin.routed_experts.require_routed_experts`). Run at start and before the
        first replay request (boxes may register after the trainer starts)."""
        fleet = FleetExperts.from_status(await self._ask(lambda client: client.get_instances_status()))
        if self.routed_experts is not None:
            require_routed_experts(fleet, self.manager_url)
        return fleet

    async def _fleet_checked(self) -> None:
        """The first replay requests wait for one shared check; a verdict stands, a failed look is retried."""
        if self._fleet_check is None:
            self._fleet_check = asyncio.ensure_future(self.check_routed_experts())
        check = self._fleet_check
        try:
            await asyncio.shield(check)
        except RoutedExpertsUnavailable:
            raise
        except Exception:
            if self._fleet_check is check:
                self._fleet_check = None
            raise

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # The remote boxes do not share the trainer's GPUs: nothing to free or restore.
    async def wake_up(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        # Partial-rollout aborts target colocated engines about to receive weights; remote instances
        # get their weights through the manager, which keeps in-flight sequences running.
        log.debug("abort_all_requests ignored: the manager keeps remote sequences running")

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return await self._ask(lambda client: client.health())

    async def _ask(self, call: Callable[[ManagerClient], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``call`` on the manager; under Ray relays on a relay that answers now, found through Ray (the
        start-up URL's relay may have been started again elsewhere)."""
        spread = self._spread
        if spread is None:
            return await call(self.client)
        for fresh in (False, True):
            urls = await spread.relays(fresh)
            if urls:
                try:
                    return await call(spread.client(urls[0]))
                except ManagerUnavailable:
                    if fresh:
                        raise
        return await call(self.client)

    def batching_stats(self) -> dict[str, int]:
        """How many batches and requests went out coalesced (zero when batching is off)."""
        b = self._batcher
        return {"batches": b.batches_sent if b else 0, "requests": b.requests_sent if b else 0}

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
        if self._client is not None:
            await self._client.close()
        if self._spread is not None:
            await self._spread.close()
