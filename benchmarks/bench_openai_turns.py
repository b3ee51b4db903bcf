#!/usr/bin/env python
"""The OpenAI front's CPU per chat turn as a session grows, against ``/generate`` of the same ids.

A manager with the front configured (the word-level ChatML test tokenizer of ``tests/openai_tokenizer.py``)
in front of one instant fake SGLang backend (``benchmarks/fake_sglang.py``: ``--answer`` tokens per turn,
so what is measured is the manager). ``--sessions`` agent sessions run in lockstep, non-streaming as an
agent harness calls them: turn 1 is a system message and a user message of ``--words`` words; every later
turn sends the whole conversation back (each answer as it came, then a new user message of ``--words``
words, a tool result's size), so by turn 50 a session's prompt is past 64k tokens by default. After each
turn of every session, the same manager gets a ``/generate`` of exactly the ids that turn was sent (the
``prompt_token_ids`` the front reports), with the same sampling and log-probs asked for: the baseline, the
cost of the rollout path alone for those ids.

Manager CPU is the run time of its threads (``/proc/PID/task/*/schedstat``, nanoseconds), read around
each group of ``--sessions`` turns (one turn of every session, then one ``/generate`` for each), divided
by the group's size: per turn, at turns 2 and ``--turns``. Each round starts fresh sessions; a round ends
by reading and freeing every session (``DELETE /v1/sessions/{id}``, where the one re-tokenization check of
the history runs), whose CPU per session is printed too. Printed last: per round and median / worst over
rounds, a chat turn's CPU over its ``/generate``'s (at turn 2 and at the last turn) and the last turn's
chat CPU over turn 2's.

Memory per session token, two ways. In the manager: the ledger's own byte count of its token arrays
(``token_bytes`` over ``tokens`` in ``GET /v1/sessions``, read before the round's sessions are freed). In
this process: the same sessions' turns planned
and recorded by the front's own code (``prompt.plan_chat``, ``Ledger.record``; each turn's messages a fresh
JSON decoding, as a request's are) under ``tracemalloc``: everything the ledger holds per session token,
the arrays' share, and the rest per session (the conversation's messages, the turns).

    .venv/bin/python benchmarks/bench_openai_turns.py --rounds 3 --sessions 16 --turns 50 --words 1300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_manager_overhead import PY, register_backends, spawn, spawn_manager, stop_all  # noqa: E402
from openai_tokenizer import WORDS, make  # noqa: E402

from rollout_manager.openai_front.ledger import Ledger  # noqa: E402
from rollout_manager.openai_front.prompt import plan_chat  # noqa: E402
from rollout_manager.openai_front.render import Renderer  # noqa: E402
from rollout_manager.osutil import free_port  # noqa: E402
from rollout_manager.sglang.openai_turn import TurnResult  # noqa: E402

MODEL = "bench"
TEXT_WORDS = [w for w in WORDS if not w.startswith("<")]


def cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid`` in seconds, from the scheduler's nanosecond counters
    (``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` counts 10 ms ticks, too coarse for a turn)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def words(n: int, salt: int) -> str:
    """``n`` words of the tokenizer's vocabulary (one token each), different per ``salt``."""
    return " ".join(TEXT_WORDS[(salt * 7 + i * 3) % len(TEXT_WORDS)] for i in range(n))


class Session:
    def __init__(self, name: str, first_words: int) -> None:
        self.name = name
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "you are a helpful agent"},
                                               {"role": "user", "content": words(first_words, 0)}]
        self.prompt_ids: list[int] = []


async def chat_turn(http: aiohttp.ClientSession, url: str, s: Session, answer: int) -> None:
    body = json.dumps({"model": MODEL, "messages": s.messages, "max_tokens": answer, "temperature": 0,
                       "session_id": s.name})
    async with http.post(url + "/v1/chat/completions", data=body,
                         headers={"Content-Type": "application/json"}) as r:
        out = await r.json()
        assert r.status == 200, out
    s.prompt_ids = out["prompt_token_ids"]
    s.messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})


async def generate(http: aiohttp.ClientSession, url: str, ids: list[int], answer: int) -> None:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": answer, "temperature": 0},
                       "return_logprob": True})
    async with http.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as r:
        out = await r.json()
        assert r.status == 200 and len(out["output_ids"]) == answer, out


async def one_round(url: str, pid: int, k: int, args: argparse.Namespace) -> dict[str, float]:
    """One round of fresh sessions; returns per-turn CPU (ms) of the chat turns and their /generate at
    turn 2 and the last turn, the last turn's prompt length and the CPU of freeing a session."""
    sessions = [Session(f"r{k}-s{i}", args.words) for i in range(args.sessions)]
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for turn in range(1, args.turns + 1):
            if turn > 1:
                for i, s in enumerate(sessions):
                    s.messages.append({"role": "user", "content": words(args.words, turn * 31 + i)})
            before = cpu_s(pid)
            for s in sessions:
                await chat_turn(http, url, s, args.answer)
            chat = cpu_s(pid) - before
            before = cpu_s(pid)
            for s in sessions:
                await generate(http, url, s.prompt_ids, args.answer)
            gen = cpu_s(pid) - before
            if turn in (2, args.turns):
                at = "2" if turn == 2 else "last"
                out[f"chat_{at}"] = 1e3 * chat / len(sessions)
                out[f"gen_{at}"] = 1e3 * gen / len(sessions)
        out["prompt_tokens"] = float(len(sessions[0].prompt_ids))
        async with http.get(f"{url}/v1/sessions") as r:
            ledger = await r.json()
        out["ledger_b_per_token"] = ledger["token_bytes"] / ledger["tokens"]
        before = cpu_s(pid)
        for s in sessions:
            async with http.delete(f"{url}/v1/sessions/{s.name}") as r:
                traj = await r.json()
                assert r.status == 200 and traj["turn_count"] == args.turns, traj
        out["free"] = 1e3 * (cpu_s(pid) - before) / len(sessions)
    return out


def ledger_memory(tokenizer: Path, args: argparse.Namespace, count: int = 4) -> dict[str, float]:
    """``count`` sessions of ``args.turns`` turns planned and recorded in this process, as the front does
    (the answer: ``args.answer`` ids of the vocabulary, decoded as the front returns them), under
    tracemalloc; bytes per session token held by the ledger, the arrays' share, the rest per session."""
    import tracemalloc

    renderer = Renderer(str(tokenizer))
    answer_ids = renderer.encode(words(args.answer, 5))[:args.answer]
    answer_text = renderer.decode(answer_ids)
    convos = []
    for i in range(count):
        s = Session(f"m{i}", args.words)
        turns = []
        for turn in range(1, args.turns + 1):
            if turn > 1:
                s.messages += [{"role": "assistant", "content": answer_text},
                               {"role": "user", "content": words(args.words, turn * 31 + i)}]
            turns.append(json.dumps(s.messages))
        convos.append(turns)
    ledger = Ledger(count + 1, 10**9, 1e9)

    def run(name: str, turns: list[str]) -> None:
        session = ledger.begin(name)
        for text in turns:
            messages = json.loads(text)  # a request's own objects, as the manager decodes them
            plan = plan_chat(renderer, session.branch, session.turn_count, messages, None)
            result = TurnResult(list(answer_ids), [-0.5] * len(answer_ids), "length", None, len(plan.ids), "v0",
                                [], [])
            ledger.record(session, plan, messages, result, {"role": "assistant", "content": answer_text})
        ledger.end(session)

    run("warm", convos[0][:3])  # the template's and tokenizer's one-time caches, outside the count
    ledger.release("warm")
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i, turns in enumerate(convos):
        run(f"m{i}", turns)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tokens = sum(s.tokens for s in ledger.sessions.values())
    arrays = sum(s.nbytes for s in ledger.sessions.values())
    return {"tokens_per_session": tokens / count, "held_b_per_token": held / tokens,
            "arrays_b_per_token": arrays / tokens, "rest_kib_per_session": (held - arrays) / count / 1024}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=16, help="sessions per round, run in lockstep")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--words", type=int, default=1300, help="tokens of each new user message")
    p.add_argument("--answer", type=int, default=90, help="tokens the fake answers per turn")
    args = p.parse_args()
    procs: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        tok = make(logs / "tokenizer")
        try:
            port = free_port()
            procs.append(spawn([PY, str(ROOT / "benchmarks/fake_sglang.py"), "--port", str(port), "--chunks",
                                str(args.answer), "--incremental-streaming-output"], logs / "backend.log"))
            backend = f"http://127.0.0.1:{port}"
            url = spawn_manager(logs / "manager.log", procs, f"openai_tokenizer_path={tok}",
                                f"openai_model_name={MODEL}", "openai_session_max_tokens=10000000")
            await register_backends(url, [backend])
            pid = procs[-1].pid
            await one_round(url, pid, -1, argparse.Namespace(**{**vars(args), "turns": 2, "sessions": 2}))  # warm
            rounds = []
            for k in range(args.rounds):
                t0 = time.monotonic()
                r = await one_round(url, pid, k, args)
                r["wall_s"] = time.monotonic() - t0
                rounds.append(r)
        finally:
            stop_all(procs)
        mem = ledger_memory(tok, args)

    def ratios(r: dict[str, float]) -> dict[str, float]:
        return {"chat/gen @2": r["chat_2"] / r["gen_2"], "chat/gen @last": r["chat_last"] / r["gen_last"],
                "chat last/2": r["chat_last"] / r["chat_2"], "gen last/2": r["gen_last"] / r["gen_2"],
                "front's own (chat - gen) last/2": (r["chat_last"] - r["gen_last"]) / (r["chat_2"] - r["gen_2"])}

    print(f"{args.sessions} sessions x {args.turns} turns per round, {args.words}-token messages, "
          f"{args.answer}-token answers; last turn's prompt: {int(rounds[0]['prompt_tokens'])} tokens")
    print("round  chat@2 ms  gen@2 ms  chat@last ms  gen@last ms  free ms/session  wall s  ledger B/token")
    for k, r in enumerate(rounds):
        print(f"{k:>5}  {r['chat_2']:>9.2f}  {r['gen_2']:>8.2f}  {r['chat_last']:>12.2f}  {r['gen_last']:>11.2f}  "
              f"{r['free']:>15.1f}  {r['wall_s']:>6.1f}  {r['ledger_b_per_token']:>14.2f}")
    print(f"ledger memory (tracemalloc, 4 sessions of {mem['tokens_per_session']:.0f} tokens): "
          f"{mem['held_b_per_token']:.2f} B per session token, of which the token arrays "
          f"{mem['arrays_b_per_token']:.2f} (ids 4, mask 1, log-prob 4); the rest (messages, turns) "
          f"{mem['rest_kib_per_session']:.0f} KiB per session")
    table = [ratios(r) for r in rounds]
    print("ratios (manager CPU per turn)     " + "  ".join(f"round {k}" for k in range(len(rounds)))
          + "  median  worst")
    for name in table[0]:
        values = [t[name] for t in table]
        print(f"{name:<33} " + "  ".join(f"{v:>7.2f}" for v in values)
              + f"  {statistics.median(values):>6.2f}  {max(values):>5.2f}")


if __name__ == "__main__":
    asyncio.run(main())
