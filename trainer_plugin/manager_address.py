"""The manager's URL, published once by the process that starts it and read by every other one.

verl starts the rollout backend's servers (here: the manager) inside its TaskRunner actor, which Ray
may place on any node, while the training ranks that push weights run on the training nodes. A URL
built from each process's own node (``ray.util.get_node_ip_address()``) points a rank on another node
at a node with no manager. So, when ``custom.rollout_manager.address`` is not given, the process that
launches (or attaches to) the manager publishes its URL in a named Ray actor
(:data:`ADDRESS_ACTOR_NAME`, in the job's namespace, no resources) and every other process reads it
from there. Nothing is guessed: with no explicit address and no published one, a Ray process waits a
little for the publication (verl launches its replicas before the first weight sync) and then fails
naming the setting.

Where it listens (``custom.rollout_manager.host``): ``0.0.0.0`` (the default, every interface of the
TaskRunner's node), a specific address, or ``node_ip``: only the address Ray knows the TaskRunner's
node by, which is the address published for the training ranks (and the one rollout boxes on the
cluster's network reach).
"""

from __future__ import annotations

import time
from typing import Any

from .settings import NODE_IP_HOST, PluginSettings

ADDRESS_ACTOR_NAME = "rollout_manager_address"
_WILDCARDS = ("0.0.0.0", "::", "")
_HANDLES: list[Any] = []


class ManagerAddress:
    """The published URL (a Ray actor with no resources)."""

    def __init__(self, url: str):
        self.url = url

    def get(self) -> str:
        return self.url


def _in_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def bind_host(settings: PluginSettings) -> str:
    """The interface a manager started in *this* process listens on: ``host`` as given, or for
    ``host: node_ip`` the address Ray knows this node by (where the training ranks reach it)."""
    m = settings.manager
    if m.host != NODE_IP_HOST:
        return m.host
    if not _in_ray():
        raise RuntimeError(f"actor_rollout_ref.rollout.custom.rollout_manager.host={NODE_IP_HOST} binds the address "
                           "Ray knows this node by, and this process is not in a Ray job; set host to an address")
    return _ray_node_ip()


def launch_url(settings: PluginSettings) -> str:
    """The URL of a manager started in *this* process: the explicit address, a specific bind host, or,
    for a wildcard or ``node_ip`` bind, this node's address (the manager runs here)."""
    m = settings.manager
    if m.address or m.host not in (*_WILDCARDS, NODE_IP_HOST):
        return settings.manager_url
    if not m.launch:
        raise RuntimeError(
            "actor_rollout_ref.rollout.custom.rollout_manager.launch=false: the manager runs elsewhere, so its "
            "address cannot be taken from this node; set custom.rollout_manager.address to its URL")
    if _in_ray() or m.host == NODE_IP_HOST:
        host = bind_host(settings) if m.host == NODE_IP_HOST else _ray_node_ip()
        return f"http://{f'[{host}]' if ':' in host else host}:{m.port}"
    return settings.manager_url


def _ray_node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def publish(url: str) -> str:
    """Make ``url`` the job's manager URL; returns the URL already published, which must be the same."""
    import ray

    actor = ray.remote(ManagerAddress).options(name=ADDRESS_ACTOR_NAME, get_if_exists=True,
                                               num_cpus=0).remote(url)
    published = str(ray.get(actor.get.remote()))
    _HANDLES.append(actor)  # a named actor lives while its creator holds a handle: as long as this process
    if published != url:
        raise RuntimeError(f"rollout manager URL {url} differs from the one already published in this Ray job "
                           f"({published}): every replica must share one manager")
    return published


def published_url(wait_s: float = 0.0) -> str | None:
    """The URL published in this Ray job, waiting up to ``wait_s`` for it; None if there is none."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return str(ray.get(ray.get_actor(ADDRESS_ACTOR_NAME).get.remote()))
        except ValueError:  # no such actor (yet)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


def resolve(settings: PluginSettings, wait_s: float = 30.0) -> str:
    """Where this process reaches the manager: the explicit address; inside Ray, a relay that answers now when
    the manager runs as Ray actors (``ray_relays``: one Ray started again is found at its new address), else the
    published URL; outside Ray (one process), the bind host or loopback."""
    m = settings.manager
    if m.address or not _in_ray():
        return settings.manager_url
    if m.ray_relays:
        from .relay_actors import find

        urls = find()
        if urls:
            return urls[0]
    url = published_url(wait_s)
    if url is None:
        raise RuntimeError(
            f"no rollout manager URL is published in this Ray job (named actor {ADDRESS_ACTOR_NAME!r}, set when "
            f"the sglang-disaggregated replicas launch) after {wait_s:g}s; set "
            "actor_rollout_ref.rollout.custom.rollout_manager.address to the URL every training node reaches "
            "the manager at")
    return url
