"""Relay processes under Ray (docs/relays.md, "Under Ray"): the control process as a named detached actor that
Ray starts again when it dies, and the relays as named actors anywhere in the cluster.

Each actor runs the same ``api.server.serve`` as the local supervisor's processes, with the same roles, on an
event loop of its own thread (Ray calls the actor's methods on another). What differs from one machine:

- every process listens on its node's Ray address, on a port of its own (no shared port across nodes); the
  trainer plugin finds the relays' URLs through Ray (:func:`relay_urls`) and spreads its batches over them;
- the control process is reached over the network, so all of them share a random ``relay_secret``: the
  control process takes hellos, reports and a forwarded caller's address only from requests that carry it;
- a relay reaches the control process through a loopback door (``launch.local_door``) that looks the control
  actor up by name, so a control process that Ray started again elsewhere is found again; it keeps the run id
  (an actor's arguments are the same at each start), so boxes and the trainer see the same manager.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.config import Config
from rollout_manager.osutil import format_endpoint, free_port

log = logging.getLogger("rollout_manager.launch.ray_relays")

DEFAULT_NAME = "rollout_manager"  # actors: <name>_control, <name>_relay_<i>
READY_TIMEOUT_S = 60.0  # an actor's start fails when its process does not listen within this
LOOKUP_TIMEOUT_S = 10.0  # one look-up of an actor's address (it may be starting again)
MAX_RELAYS = 64  # the config's bound on relays
STOP_EXTRA_S = 10.0  # beyond shutdown_grace_s, before a stop is given up and the actor killed


def control_name(name: str) -> str:
    return f"{name}_control"


def relay_name(name: str, index: int) -> str:
    return f"{name}_relay_{index}"


class ServedInThread:
    """A coroutine (one process of the manager) on an event loop of its own thread, stopped by :meth:`stop`."""

    def __init__(self, main: Callable[[asyncio.Event, asyncio.Event], Awaitable[None]], what: str) -> None:
        """``main(ready, stop)`` sets ``ready`` once it listens and returns after ``stop`` is set."""
        self.what = what
        self._main = main
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=what, daemon=True)
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT_S):
            raise RuntimeError(f"the {what} did not listen within {READY_TIMEOUT_S:g}s")
        if self._error is not None:
            raise RuntimeError(f"the {what} did not start: {self._error}") from self._error

    def _run(self) -> None:
        async def run() -> None:
            self._loop, self._stop, ready = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()
            waiter = asyncio.create_task(ready.wait())
            waiter.add_done_callback(lambda _: self._ready.set())
            try:
                await self._main(ready, self._stop)
            finally:
                waiter.cancel()

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported to whoever waits for the start
            self._error = exc
            log.exception("the %s stopped", self.what)
        finally:
            self._ready.set()

    def stop(self, timeout_s: float) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _setup_logging(config: Config, process: str) -> None:
    from rollout_manager.logs import setup_logging

    setup_logging(config.log_level, config.log_format, process)


class ControlActor:
    """The control process (registration, health, weights, trust), listening on its node's Ray address."""

    def __init__(self, config: Config, run_id: str) -> None:
        from rollout_manager.api.server import serve
        from rollout_manager.manager import Role

        _setup_logging(config, "control")
        host = _node_ip()
        self.address = format_endpoint(host, free_port(host))
        self.grace_s = config.shutdown_grace_s
        self.relays = config.relays
        config = config.model_copy(update={"bind": self.address})
        self.served = ServedInThread(lambda ready, stop: serve(config, ready=ready, role=Role.CONTROL, run_id=run_id,
                                                               stop=stop), "control process")

    def where(self) -> str:
        """``host:port`` it listens on (a new one after each start)."""
        return self.address

    def relay_count(self) -> int:
        return self.relays

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.served.stop(self.grace_s + STOP_EXTRA_S)


class RelayActor:
    """Relay ``index`` of ``relays``: the rollout path, on its node's Ray address; it reaches the control process
    (and relay 0's OpenAI front) through loopback doors that find those actors by name."""

    def __init__(self, config: Config, run_id: str, name: str, namespace: str | None, index: int,
                 relays: int) -> None:
        _setup_logging(config, f"relay {index}")
        host = _node_ip()
        self.url = f"http://{format_endpoint(host, free_port(host))}"
        self.private = format_endpoint(host, free_port(host))
        self.grace_s = config.shutdown_grace_s
        config = config.model_copy(update={"bind": self.url.split("://", 1)[1]})
        self.served = ServedInThread(
            lambda ready, stop: self._serve(config, run_id, name, namespace, index, relays, ready, stop),
            f"relay {index}")

    async def _serve(self, config: Config, run_id: str, name: str, namespace: str | None, index: int, relays: int,
                     ready: asyncio.Event, stop: asyncio.Event) -> None:
        from rollout_manager.api.server import serve
        from rollout_manager.launch.local_door import LocalDoor
        from rollout_manager.manager import RelayPlace, Role

        control = LocalDoor(lambda: _where(control_name(name), namespace), "control process")
        doors = [control]
        front_url = None
        if index:
            front = LocalDoor(lambda: _where(relay_name(name, 0), namespace, "private_address"), "relay 0")
            doors.append(front)
            front_url = f"http://{await front.open()}"
        place = RelayPlace(index, relays, f"http://{await control.open()}", self.private, front_url)
        try:
            await serve(config, ready=ready, role=Role.RELAY, run_id=run_id, place=place, stop=stop)
        finally:
            for door in doors:
                await door.close()

    def where(self) -> str:
        """The URL callers (the trainer plugin) reach this relay at."""
        return self.url

    def private_address(self) -> str:
        return self.private

    def stop(self) -> None:
        self.served.stop(self.grace_s + STOP_EXTRA_S)


def _where(actor: str, namespace: str | None, method: str = "where") -> str:
    import ray

    handle = ray.get_actor(actor, namespace=namespace)
    return str(ray.get(getattr(handle, method).remote(), timeout=LOOKUP_TIMEOUT_S))


def cpu_only_nodes() -> list[str]:
    """Ids of the live nodes with CPUs and no GPU: where the manager's actors go by default, off the training
    nodes (the trainer's rank zero is on a GPU node)."""
    import ray

    return [n["NodeID"] for n in ray.nodes()
            if n.get("Alive") and n["Resources"].get("CPU", 0) > 0 and not n["Resources"].get("GPU")]


def _strategy(nodes: Sequence[str], i: int) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # soft: when that node is gone, Ray starts the actor again anywhere rather than never
    return NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=True) if nodes else "DEFAULT"


@dataclass
class RayRelays:
    """The manager's actors in this Ray cluster (relay ``i`` is ``relays[i]``)."""

    name: str
    namespace: str | None
    run_id: str
    control: Any
    relays: list[Any] = field(default_factory=list)

    def urls(self) -> list[str]:
        return relay_urls(self.name, self.namespace)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the relays (they finish what they run), then the control process; kill what does not stop."""
        import ray

        for group in (self.relays, [self.control]):
            try:
                ray.get([a.stop.remote() for a in group], timeout=timeout_s)
            except Exception as exc:  # dead or stuck: killed below either way
                log.warning("stopping the manager's actors: %s", exc)
            for actor in group:
                ray.kill(actor, no_restart=True)


def start(config: Config, relays: int, *, name: str = DEFAULT_NAME, namespace: str | None = None,
          nodes: Sequence[str] | None = None, relay_cpus: float = 1.0, max_restarts: int = -1) -> RayRelays:
    """Start the control actor (named, detached, started again by Ray up to ``max_restarts`` times, -1: always)
    and ``relays`` relay actors (named, detached, started again too). ``nodes``: the node ids to place them on
    (round-robin; None: the CPU-only nodes if the cluster has any, else wherever Ray puts them)."""
    import ray

    if relays < 1:
        raise ValueError(f"relays must be >= 1 under Ray, got {relays}")
    where = list(cpu_only_nodes() if nodes is None else nodes)
    run_id = uuid.uuid4().hex
    config = config.model_copy(update={"relays": relays, "relay_secret": config.relay_secret or secrets.token_hex(16)})
    # get_if_exists: a second caller (another replica of the same job) gets the actors the first one started
    common = {"lifetime": "detached", "namespace": namespace, "max_restarts": max_restarts, "get_if_exists": True,
              "max_concurrency": 4}  # a look-up is answered while a stop waits
    control = ray.remote(ControlActor).options(name=control_name(name), num_cpus=0, scheduling_strategy=_strategy(
        where, 0), **common).remote(config, run_id)
    ray.get(control.where.remote(), timeout=READY_TIMEOUT_S * 2)
    handles = [ray.remote(RelayActor).options(name=relay_name(name, i), num_cpus=relay_cpus,
                                              scheduling_strategy=_strategy(where, i + 1), **common)
               .remote(config, run_id, name, namespace, i, relays) for i in range(relays)]
    out = RayRelays(name, namespace, run_id, control, handles)
    try:
        ray.get([h.where.remote() for h in handles], timeout=READY_TIMEOUT_S * 2)
    except Exception:
        out.stop(timeout_s=5.0)
        raise
    log.info("a control actor and %d relay actor(s) started (run %s) on %s", relays, run_id,
             "the CPU-only nodes" if where and nodes is None else "the given nodes" if where else "any node")
    return out


def relay_urls(name: str = DEFAULT_NAME, namespace: str | None = None, timeout_s: float = 2.0) -> list[str]:
    """The URLs of the relays that answer now, found through Ray by their actors' names (how many: the control
    actor's word, or while it starts again every name a manager may have). A relay being started again, or
    gone, is left out; the caller looks again later."""
    import ray

    try:
        count = int(ray.get(ray.get_actor(control_name(name), namespace=namespace).relay_count.remote(),
                            timeout=timeout_s))
    except Exception:  # no control actor now: look for every relay name
        count = MAX_RELAYS
    asked = []
    for index in range(count):
        try:
            asked.append((index, ray.get_actor(relay_name(name, index), namespace=namespace).where.remote()))
        except ValueError:  # no such actor (never started, or killed for good)
            continue
    out: list[str] = []
    for index, ref in asked:
        try:
            out.append(str(ray.get(ref, timeout=timeout_s)))
        except Exception as exc:  # dead or starting again: the others serve meanwhile
            log.info("relay %d does not answer now: %s", index, exc)
    return out
