#!/usr/bin/env python
"""Prefix-cache hit rate of multi-turn agents on two real SGLang boxes, sent the way verl's agent loop sends them.

Real parts: two SGLang 0.5.23 servers (CPU, the tiny Llama of ``tests/real_sglang_model.py``) started through
``scripts/launch_sglang.sh --engine sglang`` (``tests/real_sglang.py``), the rollout manager in front, the
plugin's ``ManagerProxyServer``, and verl 0.9.1's own ``LLMServerClient.generate``, which passes the server a
fresh ``uuid4`` request id on every turn. Only verl's load balancer (a Ray actor holding server handles) is
replaced: it hands back the proxy, as in
``tests/test_trainer_plugin_verl_layout.py::test_multi_turn_agents_through_verls_llm_server_client_keep_their_instance``.

Workload: ``--trajectories`` agent trajectories run at once (as verl's agent loops start together), each
``--turns`` turns in sequence; turn 1 is ``--first`` random tokens, turn k+1 = turn k's prompt + its output
(``--output`` tokens, ``ignore_eos``) + ``--tool`` new random tokens (a tool answer). Every mode uses fresh
random prompts, so no mode finds another's conversations in the cache.

Modes, in one run, on the same two boxes:

- ``keys on``: the plugin as shipped (``trainer_plugin/trajectory_keys.py``: a prompt that extends an earlier
  turn's prompt + output inherits its trajectory key), manager affinity on;
- ``keys off``: the proxy keys every turn by verl's per-turn request id (the plugin before trajectory keys),
  manager affinity on (the manager's own prefix-hash fallback may still find the instance);
- ``affinity off``: a second manager started with ``affinity=false``, the same two boxes registered with it.

Reported from SGLang itself: ``sum(meta_info.cached_tokens) / sum(meta_info.prompt_tokens)`` over turns >= 2
(SGLang 0.5.23 sets ``cached_tokens`` in ``tokenizer_manager.py`` from ``req.cached_tokens``, the prefix
found in its radix cache at prefill; the manager passes the finishing engine's ``meta_info`` through), the
best possible (each later turn's previous prompt + output cached), and the instance every turn landed on.

    .venv/bin/python benchmarks/bench_multi_turn.py --trajectories 16 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from real_sglang import Daemon, RealBox, make_tiny_model, start_boxes, start_manager  # noqa: E402
from real_sglang_model import CONTEXT, VOCAB  # noqa: E402
from support import wait_until  # noqa: E402

from trainer_plugin.proxy import ManagerProxyServer  # noqa: E402


class RequestIdKeys:
    """Keys OFF: every turn keyed by the request id verl passes the server (fresh per turn)."""

    started = 0
    continued = 0

    def key_for(self, prompt_ids: list[int], request_id: str) -> str:
        self.started += 1
        return request_id

    def finished(self, key: str, prompt_ids: list[int], output_ids: list[int]) -> None:
        return None


@dataclass
class Turn:
    trajectory: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    previous_context: int  # the previous turn's prompt + output: what a cache could hold (0 on turn 1)
    endpoint: str


@dataclass
class ModeResult:
    name: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    keys_started: int = 0
    keys_continued: int = 0

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.turn >= 2]

    def hit_rate(self) -> float:
        later = self.later()
        return sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later))

    def best_rate(self) -> float:
        later = self.later()
        return sum(t.previous_context for t in later) / max(1, sum(t.prompt_tokens for t in later))

    def paths(self) -> dict[int, str]:
        """Per trajectory, the box letter of each turn (A/B), in turn order."""
        out: dict[int, list[Turn]] = {}
        for t in self.turns:
            out.setdefault(t.trajectory, []).append(t)
        return {k: "".join(t.endpoint for t in sorted(v, key=lambda t: t.turn)) for k, v in sorted(out.items())}


def _verl_client(proxy: ManagerProxyServer) -> Any:
    """verl's LLMServerClient with its load balancer replaced by the proxy (a fresh uuid per turn stays)."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    class Client(LLMServerClient):  # type: ignore[misc]
        async def _acquire_server(self, request_id: str, **extra: Any) -> Any:
            return "proxy", SimpleNamespace(generate=SimpleNamespace(remote=proxy.generate))

        def _release_server(self, server_id: str, request_id: str | None = None) -> None:
            return None

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "sglang-disaggregated",
                                                                 "full_determinism": False}}})
    return Client(config)


async def run_mode(name: str, manager_url: str, letters: dict[str, str], args: argparse.Namespace,
                   rng: random.Random, keys_on: bool) -> ModeResult:
    proxy = ManagerProxyServer(manager_url, prompt_length=CONTEXT, response_length=args.output,
                               max_model_len=CONTEXT, batch_window_s=0, timeout_s=600.0)
    if not keys_on:
        proxy.trajectories = RequestIdKeys()  # type: ignore[assignment]
    engine_meta: dict[str, dict[str, Any]] = {}  # rid (verl's per-turn uuid) -> SGLang's meta_info
    client = proxy.client
    plain_generate = client.generate

    async def generate(body: dict[str, Any], *a: Any, **kw: Any) -> Any:
        result = await plain_generate(body, *a, **kw)
        engine_meta[str(body["rid"])] = result["meta_info"]
        return result

    client.generate = generate  # type: ignore[method-assign]
    verl = _verl_client(proxy)
    result = ModeResult(name)
    sampling = {"temperature": 1.0, "max_new_tokens": args.output, "ignore_eos": True}

    async def trajectory(i: int) -> None:
        request_id = uuid.uuid4().hex  # verl's agent loop: one id per trajectory, never sent to the server
        prompt = [rng.randrange(1, VOCAB) for _ in range(args.first)]
        previous = 0
        for k in range(1, args.turns + 1):
            out = await verl.generate(request_id, prompt_ids=prompt, sampling_params=sampling)
            meta = engine_meta[out.extra_fields["request_id"]]
            result.turns.append(Turn(i, k, int(meta["prompt_tokens"]), int(meta["cached_tokens"]), previous,
                                     letters[out.extra_fields["segments"][-1]["endpoint"]]))
            previous = len(prompt) + len(out.token_ids)
            prompt = [*prompt, *out.token_ids, *(rng.randrange(1, VOCAB) for _ in range(args.tool))]

    started = time.monotonic()
    try:
        await asyncio.gather(*(trajectory(i) for i in range(args.trajectories)))
    finally:
        await proxy.close()
    result.wall_s = time.monotonic() - started
    result.keys_started, result.keys_continued = proxy.trajectories.started, proxy.trajectories.continued
    return result


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def register_elsewhere(manager: Daemon, boxes: list[RealBox]) -> None:
    """Register the running boxes with a second manager too (SGLang's address only), until active."""
    for box in boxes:
        req = urllib.request.Request(manager.url + "/register_rollout_instance", method="POST",
                                     data=json.dumps({"host": "127.0.0.1", "port": box.port}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
    for box in boxes:
        wait_until(lambda box=box: any(i["endpoint"] == box.endpoint and i["state"] == "active"
                                       for i in _get(manager.url + "/get_instances_status")["instances"]),
                   120.0, interval_s=0.5, message=f"{box.endpoint} active in the affinity-off manager")


def print_report(results: list[ModeResult], args: argparse.Namespace) -> None:
    print(f"{args.trajectories} trajectories x {args.turns} turns; turn 1 {args.first} tokens, +{args.output} "
          f"output +{args.tool} tool tokens per turn; last prompt "
          f"{args.first + (args.turns - 1) * (args.output + args.tool)} tokens")
    print("| mode | cached / prompt tokens, turns >= 2 | best possible | later turns on turn 1's box "
          "| turns on box A / B | trajectory keys started / continued | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        later = r.later()
        first = {t.trajectory: t.endpoint for t in r.turns if t.turn == 1}
        stayed = sum(t.endpoint == first[t.trajectory] for t in later)
        a = sum(t.endpoint == "A" for t in r.turns)
        cached, prompt = sum(t.cached_tokens for t in later), sum(t.prompt_tokens for t in later)
        print(f"| {r.name} | {cached:,} / {prompt:,} = {r.hit_rate():.1%} | {r.best_rate():.1%} "
              f"| {stayed}/{len(later)} | {a} / {len(r.turns) - a} | {r.keys_started} / {r.keys_continued} "
              f"| {r.wall_s:.0f} |")
    print()
    for r in results:
        print(f"{r.name}: boxes per trajectory (turn 1..{args.turns}): {' '.join(r.paths().values())}")
    if args.per_turn:
        for r in results:
            for t in sorted(r.turns, key=lambda t: (t.trajectory, t.turn)):
                print(f"  {r.name} traj {t.trajectory} turn {t.turn}: box {t.endpoint} prompt {t.prompt_tokens} "
                      f"cached {t.cached_tokens} previous context {t.previous_context}")


async def measure(args: argparse.Namespace, manager: Daemon, plain: Daemon | None,
                  letters: dict[str, str]) -> list[ModeResult]:
    rng = random.Random(args.seed)
    results = [await run_mode("keys on", manager.url, letters, args, rng, keys_on=True),
               await run_mode("keys off (request id per turn)", manager.url, letters, args, rng, keys_on=False)]
    if plain is not None:
        results.append(await run_mode("affinity off (manager)", plain.url, letters, args, rng, keys_on=True))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=300, help="turn 1's prompt tokens")
    p.add_argument("--output", type=int, default=32, help="tokens generated per turn (ignore_eos)")
    p.add_argument("--tool", type=int, default=180, help="new tokens after each output (the tool's answer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="each box's KV pool (tokens): room for every mode's conversations, so nothing is evicted")
    p.add_argument("--no-affinity-off", action="store_true", help="skip the affinity-off manager")
    p.add_argument("--per-turn", action="store_true", help="print every turn")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args()
    last = args.first + (args.turns - 1) * (args.output + args.tool)
    if last + args.output >= CONTEXT:
        p.error(f"the last turn needs {last + args.output} tokens; the model's context is {CONTEXT}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_multi_turn-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(log_dir / "model", "llama")
    manager = start_manager(log_dir)
    plain: Daemon | None = None
    boxes: list[RealBox] = []
    try:
        boxes = start_boxes(model, manager.url, log_dir, ["boxA", "boxB"],
                            "--max-total-tokens", str(args.max_total_tokens))
        letters = {box.endpoint: letter for box, letter in zip(boxes, "AB")}
        if not args.no_affinity_off:
            plain = start_manager(log_dir, affinity="false")
            register_elsewhere(plain, boxes)
        results = asyncio.run(measure(args, manager, plain, letters))
        print_report(results, args)
        pools = []
        for box in boxes:  # SGLang's own KV pool size, as it resolved the flags
            info = _get(box.url + "/server_info")
            states = info.get("internal_states") or [{}]
            pools.append(states[0].get("max_total_num_tokens", info.get("max_total_tokens")))
        print(f"\nboxes: A={boxes[0].endpoint} B={boxes[1].endpoint}, KV pool {pools} tokens; logs in {log_dir}")
    finally:
        for box in boxes:
            box.stop()
        manager.stop()
        if plain is not None:
            plain.stop()


if __name__ == "__main__":
    main()
