"""Run the daemon: bind, serve until SIGINT/SIGTERM/SIGHUP, then shut down cleanly."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal

from aiohttp import web

from rollout_manager.api.connection_metrics import ConnectionMetrics
from rollout_manager.api.connections import ConnectionGuard, ConnectionLimits, start_site
from rollout_manager.api.routes import GenerateLane, create_app, max_body_of
from rollout_manager.config import Config, describe, parse_bind
from rollout_manager.manager import Manager, RelayPlace, Role
from rollout_manager.osutil import format_endpoint, raise_open_file_limit

log = logging.getLogger("rollout_manager.api.server")

# SIGHUP too: a closed terminal must drain and stop the daemon, not kill it mid-request.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FOLLOW_TIMEOUT_S = 30.0  # how long a relay waits for the control process's fleet before it listens anyway


class StartupError(RuntimeError):
    """The daemon cannot start; the message is the one-line reason."""


def bound_address(runner: web.AppRunner, config: Config) -> str:
    """``host:port`` as actually bound: with port 0 in ``bind`` the OS chose it, and whoever started the
    daemon learns it only from the log line that says where it listens."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return format_endpoint(config.bind_host, int(address[1]))
    return config.bind


async def serve(config: Config, *, ready: asyncio.Event | None = None, role: Role = Role.SINGLE,
                run_id: str | None = None, place: RelayPlace | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until a termination signal arrives, or ``stop`` is set (then no signal handlers are installed: a
    loop off the main thread, as in a Ray actor, cannot have them). Raises StartupError if the port cannot be
    bound. A relay (``place``) shares ``config.bind`` with the other relays and also listens on its own
    ``place.private``."""
    before, now, hard = raise_open_file_limit()
    if before >= 0:  # each sequence in flight holds one connection to its instance
        log.info("open-file limit: soft %d -> %d (hard %s)", before, now, "unlimited" if hard < 0 else hard)
    manager = Manager(config, role=role, run_id=run_id, place=place)
    if manager.link is not None and not await manager.link.followed(FOLLOW_TIMEOUT_S):
        log.warning("no fleet from the control process at %s within %gs: serving, and following it once it answers",
                    manager.link.url, FOLLOW_TIMEOUT_S)
    limits = ConnectionLimits.from_config(config)
    guard = ConnectionGuard(limits)
    app = create_app(manager)
    guard.install(app)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           keepalive_timeout=limits.keepalive_s, shutdown_timeout=10.0)
    await runner.setup()
    lane = None  # plain non-streaming /generate skips aiohttp's web layer (api.fast_lane)
    route = GenerateLane(manager, max_body_of(manager)) if config.http_fast_generate else None
    if route is not None:
        lane = route.lane_factory(limits.body_s)
    manager.metrics.prometheus.register(ConnectionMetrics(guard, route.stats if route is not None else None))
    try:
        await start_site(runner, guard, config.bind_host, config.bind_port, lane, reuse_port=place is not None)
        if place is not None:
            host, port = parse_bind(place.private)
            await start_site(runner, guard, host, port, lane)
    except OSError as exc:
        await runner.cleanup()
        await manager.close()
        why = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise StartupError(f"cannot listen on {config.bind}: {why}") from None

    bound = bound_address(runner, config)
    signals = STOP_SIGNALS if stop is None else ()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    guard.start()
    manager.sglang.limits.loop.ensure_started()  # measured from the start, for status and metrics
    log.info("rollout-manager%s listening on http://%s", "" if role is Role.SINGLE else
             f" {role.value}" + (f" {place.index}" if place else ""), bound)
    log.info("callers' connections: at most %d open (max_client_connections), %d idle per client address; "
             "idle closed after %gs, headers within %gs, bodies within %gs", limits.max_total,
             limits.max_waiting_per_client, limits.keepalive_s, limits.header_s, limits.body_s)
    log.info("effective configuration: %s", describe(config))
    if any(net.prefixlen == 0 for net in config.registration_networks):
        log.warning("registration_allowed_networks admits every address (%s): any host that can reach "
                    "this port can register an instance and feed rollouts into training; restrict it",
                    config.registration_allowed_networks)
    if not config.auth_token:
        log.warning("no auth_token: the API is open to anyone who can reach %s", bound)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        log.info("shutting down: no new work; finishing in-flight requests (up to %gs)", config.shutdown_grace_s)
        await manager.drain_for_shutdown(config.shutdown_grace_s)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await guard.close()
        await runner.cleanup()  # stops listening, waits for in-flight handlers up to shutdown_timeout
        await manager.close()  # cancels health checks and other background tasks
        log.info("stopped")
