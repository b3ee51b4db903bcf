"""Weight versions: after each training step every remote instance gets the new weights before it serves.

On ``/update_weight_version`` the manager marks remote instances below the new version ``syncing``
(no new requests; in-flight ones finish, SGLang is never told to abort them), and runs one sync task
per instance: wait until it has drained, then prepare the receiver (layout sent ahead), have the
instance's sender push through its transfer group, and have the receiver verify and load. Only then
is the instance ``active`` again, at the new version. A failed push is retried; after
``weight_push_max_attempts`` the instance is removed. Instances never wait on each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from rollout_manager.errors import BadRequest
from rollout_manager.instances.registry import Instance, Kind, State

if TYPE_CHECKING:
    from rollout_manager.manager import Manager

log = logging.getLogger("rollout_manager.weights.sync")


class PushFailed(Exception):
    """The push to one instance failed; counts towards that instance's attempts."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SenderUnavailable(PushFailed):
    """The trainer-side sender is down or has not staged the version: not the instance's fault, so
    the instance waits out of service (not removed) until the sender is back."""


class WeightSync:
    def __init__(self, manager: Manager):
        self.m = manager
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.pushes: list[dict[str, Any]] = []  # recent push results, for status and metrics
        self.on_push: Callable[[dict[str, Any]], None] | None = None  # every successful push (metrics)

    # ------------------------------------------------------------ trainer-facing
    def bump(self, new_version: int | None) -> int:
        """Set the new version and start syncing every remote instance that is behind."""
        current = self.m.weight_version
        version = current + 1 if new_version is None else new_version
        if version <= current:
            raise BadRequest(f"new_version {version} is not above the current version {current}")
        self.m.weight_version = version
        for inst in self.m.registry:
            if inst.kind == Kind.LOCAL:
                inst.weight_version = version  # the trainer updates its own instances
            elif inst.state == State.ACTIVE:
                self.m.registry.transition(inst, State.SYNCING, f"needs weight version {version}")
                self.ensure_sync(inst)
            elif inst.state == State.SYNCING:
                self.ensure_sync(inst)
        log.info("weight version %d -> %d", current, version)
        return version

    def at_version(self, version: int) -> list[Instance]:
        return [i for i in self.m.registry.in_state(State.ACTIVE) if i.weight_version >= version]

    async def wait(self, version: int, min_instances: int | None, timeout_s: float) -> dict[str, Any]:
        """Wait until ``min_instances`` (None: every remote instance) serve ``version``, bounded."""
        def enough() -> bool:
            ready = len([i for i in self.at_version(version) if i.kind == Kind.REMOTE])
            if min_instances is None:
                behind = [i for i in self.m.registry if i.kind == Kind.REMOTE and i.weight_version < version]
                return not behind
            return ready >= min_instances

        t0 = time.monotonic()
        ok = await self.m.dispatcher.changed.wait_for(enough, timeout_s)
        return {"timed_out": not ok, "waited_s": round(time.monotonic() - t0, 6),
                "instances_at_version": len([i for i in self.at_version(version) if i.kind == Kind.REMOTE])}

    # ------------------------------------------------------------ per instance
    def ensure_sync(self, inst: Instance) -> None:
        task = self._tasks.get(inst.id)
        if task is None or task.done():
            self._tasks[inst.id] = asyncio.get_running_loop().create_task(self._sync(inst), name=f"sync:{inst.id}")

    def forget(self, inst: Instance) -> None:
        task = self._tasks.pop(inst.id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _sync(self, inst: Instance) -> None:
        cfg = self.m.config
        failures = 0
        while self.m.registry.get(inst.id) is inst and inst.weight_version < self.m.weight_version:
            version = self.m.weight_version
            drained = await self.m.dispatcher.changed.wait_for(lambda: inst.in_flight == 0, cfg.drain_timeout_s)
            if not drained:
                log.warning("instance %s still has %d request(s) in flight after %gs; pushing anyway",
                            inst.endpoint, inst.in_flight, cfg.drain_timeout_s)
            try:
                result = await asyncio.wait_for(self._push(inst, version), cfg.weight_push_timeout_s)
            except SenderUnavailable as exc:
                if inst.last_error != f"weight push: {exc}":
                    log.warning("weight push of version %d to %s waits for its sender: %s", version,
                                inst.endpoint, exc)
                inst.last_error = f"weight push: {exc}"
                await self.m.dispatcher.changed.wait(cfg.weight_push_retry_s)
                continue
            except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                failures += 1
                reason = str(exc) or type(exc).__name__
                inst.last_error = f"weight push: {reason}"
                log.warning("weight push of version %d to %s failed (%d/%d): %s", version, inst.endpoint,
                            failures, cfg.weight_push_max_attempts, reason)
                if failures >= cfg.weight_push_max_attempts:
                    self.m.registry.transition(
                        inst, State.DEAD, f"weight push failed {failures} times; last: {reason}")
                    return
                await self.m.dispatcher.changed.wait(cfg.weight_push_retry_s)
                continue
            failures = 0
            inst.weight_version = version
            self.pushes.append(result)
            del self.pushes[:-100]
            if self.on_push is not None:
                self.on_push(result)
            if version == self.m.weight_version:
                self.m.registry.transition(inst, State.ACTIVE, f"weights at version {version} "
                                           f"({result['gbps']:.2f} GB/s, {result['total_s']:.2f}s)")
        self._tasks.pop(inst.id, None)

    async def _push(self, inst: Instance, version: int) -> dict[str, Any]:
        """prepare (receiver) -> push (sender, through the instance's group) -> commit (receiver)."""
        m = self.m
        if inst.weight_receiver_port is None:
            raise PushFailed("the instance registered no weight_receiver_port")
        group = m.group_of(inst)
        while group is None:  # no sender has reported yet: wait for one
            await m.dispatcher.changed.wait(None)
            group = m.group_of(inst)
        sender_url = m.sender_url(group.sender)
        receiver_url = f"http://{inst.host}:{inst.weight_receiver_port}"
        t0 = time.monotonic()
        try:
            layout = await self._call("GET", sender_url + "/layout")
        except (PushFailed, aiohttp.ClientConnectionError) as exc:
            raise SenderUnavailable(f"sender {group.sender} at {sender_url}: {exc}") from None
        if int(layout["version"]) != version:
            raise SenderUnavailable(f"sender {group.sender} has version {layout['version']} staged, not {version}")
        transport = m.config.weight_transport
        prep = await self._call("POST", receiver_url + "/prepare",
                                {"version": version, "layout": layout["layout"], "transport": transport})
        try:
            push = await self._call("POST", sender_url + "/push", {
                "version": version, "ip": group.ip, "num_engines": m.engines_per_group, "transport": transport,
                "session_ids": prep["session_ids"], "buffer_addr": prep["buffer_addr"],
            })
        except aiohttp.ClientConnectionError as exc:
            raise SenderUnavailable(f"sender {group.sender} at {sender_url}: {exc}") from None
        except PushFailed as exc:
            if exc.status == 409:  # restaged since: try again with what is there now
                raise SenderUnavailable(str(exc)) from None
            raise
        commit = await self._call("POST", receiver_url + "/commit", {
            "version": version, "fingerprint": push["fingerprint"], "shards": push["shards"],
            "checksums": push["checksums"],
        })
        return {"instance": inst.id, "endpoint": inst.endpoint, "version": version, "sender": group.sender,
                "group": group.group, "ip": group.ip, "transport": transport, "bytes": push["bytes"], "transfer_s": push["seconds"],
                "gbps": push["gbps"], "verify_s": commit.get("verify_s"), "load_s": commit.get("load_s"),
                "total_s": round(time.monotonic() - t0, 6), "at": time.time()}

    async def _call(self, method: str, url: str, body: Any = None) -> dict[str, Any]:
        assert self.m.sglang is not None
        token = self.m.config.auth_token  # the agents take the same shared token
        async with self.m.sglang.session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=self.m.config.weight_push_timeout_s),
            headers={"Authorization": f"Bearer {token}"} if token else None,
        ) as resp:
            text = await resp.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = {"error": text[:300]}
            if resp.status != 200:
                raise PushFailed(f"{method} {url} -> HTTP {resp.status}: {data.get('error', data)}", resp.status)
            return data
