"""``rollout-manager demo``: the whole system on one CPU machine, in under two minutes.

It starts the manager, rollout "boxes" through ``scripts/launch_sglang.sh --engine cpu`` (a CPU
engine plus a weight receiver each), and a small GRPO-style training loop on the same tiny model:
rollouts come through the manager, a toy reward scores them, real optimizer steps update the policy,
and after every step the weights go out through the Mooncake transfer groups (two loopback
"interfaces") and every box serves the new version before the next step. During one step it kills a
box mid-generation (its sequences are continued elsewhere from the tokens already made) and starts a
fresh one (bootstrapped to the current version). Everything it started is stopped at the end.

With ``--engine sglang --model-path DIR`` the boxes run real SGLang serving that Hugging Face checkpoint (on
CPU when torch sees no GPU) and the loop trains the same checkpoint with transformers; SGLang starts in tens
of seconds per box, so the run takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

from rollout_manager.launch.demo_engines import Policy, cpu_policy, default_sglang_python, hf_policy, sglang_box_flags
from rollout_manager.osutil import die_with_parent_preexec, free_port
from rollout_manager.weights.sender_agent import SenderAgent

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch_sglang.sh"
SENDER_IPS = ["127.0.0.1", "127.0.0.2"]  # two loopback "interfaces": two transfer groups
RUN_MARKER = "RM_DEMO_RUN_ID"
# The demo's sequences are a few dozen tokens: a chunk every 4 (not the default 64, sized for thousands)
# so a box preempted mid-generation has streamed tokens its sequences continue from.
FAST_HEALTH = ["pending_poll_interval_s=0.2", "health_check_interval_s=0.5", "health_failure_threshold=2",
               "weight_push_retry_s=0.5", "no_instance_wait_timeout_s=60", "engine_stream_interval=4"]


@dataclass
class Child:
    """A child process in its own process group, so it can be stopped with everything it started."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill_tree(self) -> None:
        """SIGKILL the child and every descendant (they may sit in process groups of their own)."""
        for pid in reversed(_descendants(self.popen.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill()

    def stop(self, grace_s: float = 10.0) -> None:
        family = _descendants(self.popen.pid) if self.alive() else []  # read while the leader can be asked
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # whatever is left in the group
        self.popen.wait()
        deadline = time.monotonic() + grace_s  # killed processes take a moment to go: return once they have
        while any(Path(f"/proc/{pid}").exists() for pid in family) and time.monotonic() < deadline:
            time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendants, parents before children (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def spawn(name: str, args: Sequence[str], logdir: Path, env: dict[str, str] | None = None) -> Child:
    """Start a child in its own process group that the kernel stops if the demo is killed outright.

    Called from the event loop's thread (the main thread), which lives as long as the demo: the
    parent-death signal is tied to the thread that forks.
    """
    log = logdir / f"{name}.log"
    popen = subprocess.Popen(list(args), stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, **(env or {})}, start_new_session=True,
                             preexec_fn=die_with_parent_preexec())
    return Child(name, popen, log)


@dataclass
class Box:
    child: Child
    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class StepStats:
    step: int
    reward: float
    rollouts: int
    tokens: int
    gen_s: float
    continued: int
    push_s: float
    push_gbps: float
    instances: str


@dataclass
class Demo:
    args: argparse.Namespace
    logdir: Path
    children: list[Child] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    killed: str | None = None
    started_box: str | None = None
    tty: bool = field(default_factory=lambda: sys.stdout.isatty())

    # ------------------------------------------------------------ plumbing
    def say(self, text: str) -> None:
        print(("\r\033[K" if self.tty else "") + text, flush=True)

    def live(self, text: str) -> None:
        if self.tty:
            print("\r\033[K" + text, end="", flush=True)

    async def get(self, s: aiohttp.ClientSession, path: str) -> Any:
        async with s.get(self.url + path) as r:
            return await r.json()

    async def post(self, s: aiohttp.ClientSession, path: str, body: Any, method: str = "POST") -> Any:
        async with s.request(method, self.url + path, json=body) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{method} {path} -> {r.status}: {data}")
            return data

    async def wait_for(self, what: str, check: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await check()
            if value:
                return value
            await asyncio.sleep(0.1)
        raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}; logs in {self.logdir}")

    def start_box(self) -> Box:
        port, agent_port = free_port(), free_port()
        a = self.args
        env = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
        if a.engine == "sglang":
            launcher_flags, engine_flags, engine_env = sglang_box_flags(a.model_path, a.sglang_python)
            env.update(engine_env)
        else:
            launcher_flags = ["--engine", "cpu", "--python", sys.executable]
            engine_flags = ["--seed", "0", "--model-size", a.model_size, "--token-delay-s", str(a.token_delay_s)]
        child = spawn(f"box-{port}", ["bash", str(LAUNCH), *launcher_flags, "--manager-addr", self.url,
                                      "--host", "127.0.0.1", "--port", str(port),
                                      "--transfer-agent-handshake-port", str(agent_port),
                                      "--ready-timeout-s", str(int(self.box_timeout_s)),
                                      "--drain-timeout-s", "5",
                                      # boxes on this machine: no cloud to hear from, and the demo's own
                                      # SIGTERM at its end is a stop, not a preemption
                                      "--preemption-notice", "off", "--", *engine_flags],
                      self.logdir, env=env)
        self.children.append(child)
        box = Box(child, port)
        self.boxes.append(box)
        return box

    async def box_mid_generation(self, s: aiohttp.ClientSession) -> Box | None:
        """The live box holding the most tokens already made by sequences still in flight on it, while they
        have made at most half their budget on average (None if no box is there yet). Tokens made there are
        the remaining budget's shortfall: each placed sequence reserves ``max_new_tokens`` and every streamed
        token gives one back. At half, a kill lands before they finish even on a loaded machine (the
        sequences are short), so there is something to continue."""
        made: dict[str, int] = {}
        for i in (await self.get(s, "/get_instances_status"))["instances"]:
            reserved = i["in_flight"] * self.args.max_new_tokens
            done = reserved - i["in_flight_tokens"]
            if i["in_flight"] and 0 < done <= reserved // 2:  # some made, at least half the budget left
                made[i["endpoint"]] = done
        live = [b for b in self.boxes if b.child.alive() and b.endpoint in made]
        return max(live, key=lambda b: made[b.endpoint], default=None)

    async def preempt_mid_generation(self, s: aiohttp.ClientSession, step: int) -> None:
        """Kill a box as soon as one has sequences part-way through (a preempted spot box: everything on it
        gone without a word) and start a fresh one. Polled, so the kill lands mid-sequence however fast or
        slow the boxes are, rather than at some fixed point of the batch."""
        while self.killed is None:
            victim = await self.box_mid_generation(s)
            if victim is None:
                await asyncio.sleep(0.005)
                continue
            victim.child.kill_tree()
            self.killed = victim.child.name
            fresh = self.start_box()
            self.started_box = fresh.endpoint
            self.say(f"step {step}: killed box {victim.endpoint} mid-generation; started {fresh.endpoint}")

    async def instances_line(self, s: aiohttp.ClientSession) -> str:
        st = await self.get(s, "/get_instances_status")
        return " ".join(f"{i['endpoint'].split(':')[1]}:{i['state']}@v{i['weight_version']}" for i in st["instances"])

    @property
    def box_timeout_s(self) -> float:
        """How long a box may take to start: SGLang loads and warms up for tens of seconds even on CPU."""
        return 600.0 if self.args.engine == "sglang" else 60.0

    # ------------------------------------------------------------ the run
    async def run(self) -> int:
        a = self.args
        if not LAUNCH.exists():
            raise RuntimeError(f"{LAUNCH} not found: run the demo from a checkout of rollout-manager")
        mport, sport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{mport}"
        sets = [x for kv in FAST_HEALTH + [f"weight_sender_base_port={sport}", "allowed_sender_ips=127.0.0.0/8"]
                for x in ("--set", kv)]
        self.children.append(spawn("manager", [sys.executable, "-m", "rollout_manager", "serve", "--bind",
                                               f"127.0.0.1:{mport}", *sets], self.logdir))
        sender = SenderAgent(SENDER_IPS, sport)
        t_start = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await self.wait_for("the manager", lambda: self._healthy(s), 30)
            self.say(f"manager up at {self.url} after {time.monotonic() - t_start:.1f}s (logs: {self.logdir})")
            sender.start()
            await self.post(s, "/update_weight_senders", {"weight_sender_ips": [SENDER_IPS],
                                                         "num_mooncake_groups_per_sender": 2,
                                                         "num_mooncake_engines_per_group": 2}, method="PUT")
            for _ in range(a.boxes):
                self.start_box()
            await self.wait_for(f"{a.boxes} boxes active", lambda: self._ready(s, a.boxes), self.box_timeout_s + 30)
            self.say(f"{a.boxes} rollout boxes active after {time.monotonic() - t_start:.1f}s: "
                     f"{await self.instances_line(s)}")
            policy = hf_policy(a.model_path) if a.engine == "sglang" else cpu_policy(a.model_size)
            policy.module.requires_grad_(True)
            policy.module.train()
            optimizer = torch.optim.Adam(policy.module.parameters(), lr=a.lr)
            history: list[StepStats] = []
            rng = random.Random(0)
            vocab = policy.vocab_size
            for step in range(1, a.steps + 1):
                prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(a.prompts)]
                results, gen_s = await self.rollouts(s, step, prompts)
                rewards = self.learn(policy, optimizer, prompts, results, vocab)
                stage_t = time.monotonic()
                state = policy.state()
                await asyncio.to_thread(sender.stage, state, step)
                answer = await self.post(s, "/update_weight_version", {"wait_for_instances": "all",
                                                                      "timeout_s": 60})
                if answer.get("timed_out"):
                    raise RuntimeError(f"step {step}: not every box reached version {step}: {answer}")
                if step == a.kill_step:  # show the fresh box joining: bootstrapped to v{step}, then serving
                    self.live(f"step {step:>2} waiting for the fresh box {self.started_box} to join")
                    await self.wait_for("the fresh box", lambda: self._ready(s, a.boxes), self.box_timeout_s + 30)
                push_s = time.monotonic() - stage_t
                st = await self.get(s, "/get_instances_status")
                pushes = [p for p in st["recent_weight_pushes"] if p["version"] == step]
                gbps = sum(p["gbps"] for p in pushes) / len(pushes) if pushes else 0.0
                tokens = sum(len(r["output_ids"]) for r in results)
                continued = sum(len(r["meta_info"]["segments"]) > 1 for r in results)
                stats = StepStats(step, sum(rewards) / len(rewards), len(results), tokens, gen_s, continued,
                                  push_s, gbps, await self.instances_line(s))
                history.append(stats)
                await self.post(s, "/update_metrics", {"step_time_s": gen_s + push_s, "trainer_bubble_time_s": 0.0,
                                                       "step_throughput": tokens / max(gen_s, 1e-9)})
                self.say(f"step {step:>2}  reward {stats.reward:.3f}  rollouts {stats.rollouts} "
                         f"({stats.rollouts / gen_s:5.1f}/s, {tokens / gen_s:6.0f} tok/s)  continued {continued:>2}  "
                         f"push v{step} {push_s:5.2f}s {gbps:5.2f} GB/s  | {stats.instances}")
            self.summary(history, time.monotonic() - t_start)
        sender.stop()
        return 0

    async def _healthy(self, s: aiohttp.ClientSession) -> bool:
        try:
            return bool((await self.get(s, "/health"))["status"] == "healthy")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _ready(self, s: aiohttp.ClientSession, n: int) -> bool:
        for box in self.boxes:
            if not box.child.alive() and box.child.name != self.killed:
                raise RuntimeError(f"{box.child.name} exited: see {box.child.log}")
        return bool((await self.get(s, "/get_instances_status"))["ready_instances"] >= n)

    async def rollouts(self, s: aiohttp.ClientSession, step: int,
                       prompts: list[list[int]]) -> tuple[list[dict[str, Any]], float]:
        """One NDJSON batch of prompts x n; on the kill step, preempt a box mid-way and add a new one."""
        a = self.args
        body = {"sampling_params": {"max_new_tokens": a.max_new_tokens, "temperature": 1.0},
                "return_logprob": True}
        items = [[f"{p}/{k}", {"input_ids": prompt, **body}] for p, prompt in enumerate(prompts) for k in range(a.n)]
        results: dict[str, dict[str, Any]] = {}
        t0 = time.monotonic()
        preempt = (asyncio.create_task(self.preempt_mid_generation(s, step))
                   if step == a.kill_step and self.killed is None else None)
        try:
            await self._stream_batch(s, step, items, results, t0)
        finally:
            if preempt is not None:
                preempt.cancel()
                await asyncio.gather(preempt, return_exceptions=True)
        gen_s = time.monotonic() - t0
        ordered = [results[f"{p}/{k}"] for p in range(len(prompts)) for k in range(a.n)]
        return ordered, gen_s

    async def _stream_batch(self, s: aiohttp.ClientSession, step: int, items: list[list[Any]],
                            results: dict[str, dict[str, Any]], t0: float) -> None:
        async with s.post(self.url + "/batch_generate_requests", json=items) as r:
            async for raw in r.content:
                line = json.loads(raw)
                if not line["success"]:
                    raise RuntimeError(f"request {line['id']} failed: {line['error']}")
                results[line["id"]] = line["data"]
                done = len(results)
                elapsed = time.monotonic() - t0
                tokens = sum(len(x["output_ids"]) for x in results.values())
                bar = "#" * (24 * done // len(items))
                rate = tokens / max(elapsed, 1e-9)
                self.live(f"step {step:>2} [{bar:<24}] {done}/{len(items)} rollouts  {rate:6.0f} tok/s")

    def learn(self, policy: Policy, optimizer: torch.optim.Optimizer, prompts: list[list[int]],
              results: list[dict[str, Any]], vocab: int) -> list[float]:
        """GRPO-style step: reward = share of response tokens in the lowest eighth of the vocabulary;
        advantage = reward minus its group mean; loss = -advantage * log-prob of the response."""
        n = self.args.n
        rewards = [sum(t < vocab // 8 for t in r["output_ids"]) / max(len(r["output_ids"]), 1) for r in results]
        optimizer.zero_grad()
        loss: torch.Tensor | None = None
        for i, r in enumerate(results):
            group = rewards[(i // n) * n:(i // n + 1) * n]
            adv = rewards[i] - sum(group) / len(group)
            if adv == 0.0 or not r["output_ids"]:
                continue
            prompt = prompts[i // n]
            ids = torch.tensor(prompt + r["output_ids"])
            logits = policy.logits(ids[:-1])[len(prompt) - 1:]
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[len(prompt):, None]).sum()
            term = -adv * logp / len(results)
            loss = term if loss is None else loss + term
        if loss is not None:  # every group scored evenly: nothing to learn from this batch
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        return rewards

    def summary(self, history: list[StepStats], wall: float) -> None:
        first, last = history[0], history[-1]
        total_rollouts = sum(h.rollouts for h in history)
        total_tokens = sum(h.tokens for h in history)
        continued = sum(h.continued for h in history)
        self.say("")
        self.say("summary")
        self.say(f"  steps {len(history)}, {total_rollouts} rollouts, {total_tokens} tokens in {wall:.1f}s")
        self.say(f"  reward {first.reward:.3f} -> {last.reward:.3f}")
        self.say(f"  weight versions pushed: 1..{last.step}, every box at v{last.step}: {last.instances}")
        self.say(f"  mean push {sum(h.push_s for h in history) / len(history):.2f}s "
                 f"(stage + transfer + verify + load, all boxes)")
        if self.killed:
            self.say(f"  box killed mid-generation: {self.killed}; {continued} sequences continued elsewhere, "
                     f"none restarted; fresh box {self.started_box} bootstrapped and served")

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop(5.0)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description's paragraphs as written, and every flag's default (but "None")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-manager demo", description=(__doc__ or "").replace("``", ""),
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="training steps (one weight push each)")
    parser.add_argument("--boxes", type=int, default=2, help="rollout boxes at the start")
    parser.add_argument("--engine", default="cpu", choices=["cpu", "sglang"],
                        help="what the boxes run: the CPU engine, or real SGLang serving --model-path")
    parser.add_argument("--model-path", default=None,
                        help="--engine sglang: a Hugging Face checkpoint (directory) SGLang serves and the demo "
                             "trains with transformers")
    parser.add_argument("--sglang-python", default=None,
                        help="--engine sglang: the interpreter that has SGLang (default: this checkout's "
                             ".venv-sglang, else this one)")
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "small"],
                        help="--engine cpu: the CPU model's size")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per sample")
    parser.add_argument("--kill-step", type=int, default=2, help="step during which a box is killed (0: none)")
    parser.add_argument("--token-delay-s", type=float, default=0.01, help="--engine cpu: pace of the CPU engines")
    parser.add_argument("--lr", type=float, default=0.03, help="the optimizer's learning rate")
    parser.add_argument("--logdir", default=None,
                        help="where the manager's and boxes' logs go; kept afterwards (default: a new "
                             "rollout-manager-demo-* directory under $TMPDIR)")
    args = parser.parse_args(argv)
    if args.engine == "sglang":
        if not args.model_path:
            parser.error("--engine sglang needs --model-path")
        args.model_path = str(Path(args.model_path).resolve())
        args.sglang_python = args.sglang_python or default_sglang_python()
    # Mooncake's log chatter (glog, read when the library loads) would bury the progress display.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "3")
    os.environ.setdefault(RUN_MARKER, uuid.uuid4().hex)  # every child inherits it: tests find leftovers by it
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="rollout-manager-demo-"))
    logdir.mkdir(parents=True, exist_ok=True)
    demo = Demo(args, logdir)
    # SIGTERM and SIGHUP (the terminal closed) stop the demo like Ctrl-C: through stop_all below.
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        code = asyncio.run(demo.run())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    except Exception as exc:  # one clear line, then the logs for whoever wants more
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        code = 1
    finally:
        # A further signal must not cut the clean-up short (a closed terminal sends SIGHUP while Ctrl-C's
        # shutdown runs); stop_all is bounded by the children's grace periods.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        try:
            demo.stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    # Kept, also after a clean run: the logs are what a user reads when something looked odd.
    print(f"logs kept in {logdir}", file=sys.stderr)
    return code
