"""The operator's subcommands: ``status``, ``drain``, ``evacuate``, ``push-status`` and ``watch`` against a running
manager.

They speak the manager's public HTTP API through :mod:`rollout_manager.manager_client` (the standard
library's ``urllib``), so a call starts in a
fraction of a second (no torch, no event loop); ``rich`` is imported only by ``watch``. Exit codes are
meant for scripts, see :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_manager.bearer import TOKEN_ENV
from rollout_manager.manager_client import ManagerAPI, ManagerAPIError, ShutdownResult, base_url

if TYPE_CHECKING:
    from rich.console import RenderableType

ADDR_ENV = "ROLLOUT_MANAGER_ADDR"
DEFAULT_ADDR = "http://127.0.0.1:5000"

OK = 0
FAILED = 1  # the manager answered, but not as expected (an HTTP error other than 401, a body that is not JSON)
USAGE = 2  # bad arguments or an unreadable --config (argparse uses 2 as well)
UNREACHABLE = 3  # nothing answered at --manager (refused, timed out, unknown host)
UNAUTHORIZED = 4  # the manager refused the bearer token (HTTP 401)
UNKNOWN_ENDPOINT = 5  # drain, evacuate: (at least one) endpoint is not registered
SKIPPED = 6  # drain: at least one endpoint was left alone (a weight push in progress); all were known

EXIT_CODES = {OK: "ok", FAILED: "unexpected answer from the manager", USAGE: "usage or configuration error",
              UNREACHABLE: "manager unreachable", UNAUTHORIZED: "token refused",
              UNKNOWN_ENDPOINT: "drain, evacuate: unknown endpoint",
              SKIPPED: "drain: endpoint skipped (weight push running)"}

# Keys under which an instance's status may describe its streaming mode (shown when present).
STREAMING_KEYS = ("streaming_mode", "stream_mode", "streaming")


class OpsError(Exception):
    """A failure with the exit code that reports it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Client:
    """The manager's API (:mod:`rollout_manager.manager_client`), its failures told as :class:`OpsError`."""

    api: ManagerAPI

    @property
    def url(self) -> str:
        return self.api.url

    def status(self) -> dict[str, Any]:
        with self._exit_codes():
            return self.api.instances_status()

    def drain(self, endpoints: list[str], *, force: bool, timeout_s: float | None) -> ShutdownResult:
        with self._exit_codes():
            return self.api.shutdown_instances(endpoints, check_weight_update=not force, timeout_s=timeout_s)

    def evacuate(self, endpoint: str, deadline_s: float | None, source: str, cancel: bool) -> dict[str, Any]:
        with self._exit_codes(unknown_endpoint=True):
            if cancel:
                return self.api.cancel_evacuation(endpoint)
            assert deadline_s is not None
            return self.api.evacuate_instance(endpoint, deadline_s, source=source)

    @contextlib.contextmanager
    def _exit_codes(self, unknown_endpoint: bool = False) -> Iterator[None]:
        try:
            yield
        except ManagerAPIError as exc:
            if exc.status is None:
                raise OpsError(str(exc), UNREACHABLE) from None
            if exc.status == 401:
                hint = f"set {TOKEN_ENV} or auth_token in --config" if not self.api.token else "the token is wrong"
                raise OpsError(f"{self.url} refused the token ({hint}): {exc.message}", UNAUTHORIZED) from None
            if unknown_endpoint and exc.status == 404:
                raise OpsError(exc.message, UNKNOWN_ENDPOINT) from None
            raise OpsError(str(exc), FAILED) from None


# ------------------------------------------------------------ settings: address and token
def manager_url(arg: str | None) -> str:
    """``--manager``, else $ROLLOUT_MANAGER_ADDR, else the local default; a bare ``host:port`` gets ``http://``."""
    return base_url(arg or os.environ.get(ADDR_ENV) or DEFAULT_ADDR)


def auth_token(config_path: str | None) -> str:
    """$ROLLOUT_MANAGER_AUTH_TOKEN, else ``auth_token`` from the ``--config`` file (the daemon's precedence)."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    if config_path is None:
        return ""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the project's oldest Python
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
    try:
        with open(config_path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError) as exc:
        raise OpsError(f"cannot read --config {config_path}: {exc}", USAGE) from None
    value = data.get("auth_token", "")
    if not isinstance(value, str):
        raise OpsError(f"--config {config_path}: auth_token must be a string", USAGE)
    return value


def client_from(args: argparse.Namespace) -> Client:
    return Client(ManagerAPI(manager_url(args.manager), auth_token(args.config), args.timeout))


# ------------------------------------------------------------ plain-text tables
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart; the last column is never padded (it may be long)."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " * (len(r) > 1) + r[-1]
                     for r in cells).rstrip() + "\n"


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def streaming_of(inst: dict[str, Any]) -> str | None:
    for key in STREAMING_KEYS:
        if key in inst:
            return _dash(inst[key])
    return None


def summary_line(st: dict[str, Any]) -> str:
    counts = st.get("counts") or {}
    by_state = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"
    return (f"weight version {st.get('weight_version')}  instances {len(st.get('instances') or [])} ({by_state})"
            f"  requests waiting {st.get('requests_waiting_for_instance', 0)}")


def render_status(st: dict[str, Any], url: str) -> str:
    instances = st.get("instances") or []
    streaming = any(streaming_of(i) is not None for i in instances)
    headers = ["ENDPOINT", "ID", "KIND", "STATE", "VERSION", "IN FLIGHT", "SPEED", *(["STREAMING"] * streaming),
               "TRUST", "MISMATCH", "WAITING FOR", "LAST ERROR"]
    rows = [[i.get("endpoint"), i.get("id"), i.get("kind"), i.get("state"), f"v{i.get('weight_version')}",
             i.get("in_flight"), speed_cell(i.get("decode_step")), *([_dash(streaming_of(i))] * streaming),
             trust_cell(i), mismatch_cell(i.get("mismatch")), _dash(i.get("waiting_for")), _dash(i.get("last_error"))]
            for i in instances]
    out = f"manager {url}  {summary_line(st)}\n"
    out += table(headers, rows) if rows else "no instances registered\n"
    return (out + mismatch_line(st.get("mismatch")) + quarantine_line(st.get("quarantine"))
            + evacuation_lines(instances) + relay_lines(st.get("relays")))


def relay_lines(relays: Any) -> str:
    """With relays (docs/relays.md): one line per relay, as it last reported to the control process."""
    if not isinstance(relays, list) or not relays:
        return ""
    rows = [[r.get("relay"), r.get("pid"), "yes" if r.get("connected") else "no", r.get("in_flight"),
             r.get("waiting"), r.get("finished"), _num(r.get("cpu_s"), 1), r.get("restarts"),
             _num(r.get("report_age_s"), 2)] for r in relays if isinstance(r, dict)]
    return table(["RELAY", "PID", "CONNECTED", "IN FLIGHT", "WAITING", "FINISHED", "CPU S", "RESTARTS",
                  "REPORT AGE S"], rows)


def evacuation_lines(instances: list[dict[str, Any]]) -> str:
    """One line per box being evacuated (a preemption notice): its deadline and what stays and moved."""
    out = ""
    for i in instances:
        ev = i.get("evacuation")
        if isinstance(ev, dict):
            out += (f"evacuating {i.get('endpoint')} ({ev.get('source')} notice): removed in "
                    f"{ev.get('deadline_in_s')}s, {ev.get('staying')} sequence(s) stay, {ev.get('moved')} moved\n")
    return out


def speed_cell(step: Any) -> str:
    """The box's learned decode step as ``base+per-sequence ms`` (``~`` before: the fleet's median box stands in
    until it is measured), ``-`` while no box is."""
    if not isinstance(step, dict) or not isinstance(step.get("base_ms"), (int, float)):
        return "-"
    mark = "" if step.get("measured") else "~"
    return f"{mark}{step['base_ms']:.3g}+{step.get('per_sequence_ms') or 0:.2g}ms"


def trust_cell(inst: dict[str, Any]) -> str:
    """The trust probe's verdict at the version it serves (``!`` when it disagrees), ``quarantined`` when out."""
    if inst.get("quarantined"):
        return "quarantined !"
    trust = inst.get("trust")
    if not isinstance(trust, dict):
        return "-"
    state = str(trust.get("state"))
    diff = trust.get("diff")
    shown = f"{state} ({_num(diff, 4)})" if state == "disagrees" and isinstance(diff, (int, float)) else state
    return shown + (" !" if state == "disagrees" else "")


def quarantine_line(q: Any) -> str:
    """The quarantine in one line, once it did anything: who is out, and the delivered answers it distrusted."""
    if not isinstance(q, dict):
        return ""
    delivered = q.get("delivered") or {}
    now = q.get("quarantined_now") or []
    if not (now or q.get("quarantined") or delivered.get("distrusted_samples") or q.get("held_by_floor")
            or q.get("fleet_wide")):
        return ""
    out = (f"quarantine: {len(now)} out now{' (' + ', '.join(now) + ')' if now else ''}, {q.get('quarantined', 0)} "
           f"quarantined and {q.get('lifted', 0)} readmitted in all; {delivered.get('distrusted_samples', 0)} "
           f"delivered answer segment(s) distrusted ({delivered.get('distrusted_tokens', 0)} tokens: "
           "GET /distrusted_samples)\n")
    for note in (q.get("held_by_floor"), q.get("fleet_wide")):
        if note:
            out += f"  ! {note}\n"
    return out


def mismatch_cell(m: Any) -> str:
    """An instance's trust figure: weighted mean log-prob gap, its multiple of the median, ``!`` if called out."""
    if not isinstance(m, dict):
        return "-"
    ratio = m.get("ratio_to_median")
    times = f" ({ratio:.1f}x)" if isinstance(ratio, (int, float)) else ""
    return f"{_num(m.get('mean_abs_diff'), 4)}{times}{' !' if m.get('above_median_multiple') else ''}"


def mismatch_line(fleet: Any) -> str:
    """The fleet's mismatch in one line, once the trainer reported any."""
    if not isinstance(fleet, dict) or fleet.get("last_step") is None:
        return ""
    return (f"log-prob mismatch (step {fleet.get('last_step')}): median {_num(fleet.get('median_mean_abs_diff'), 4)};"
            f" {fleet.get('note')}\n")


def push_failures(st: dict[str, Any]) -> list[dict[str, Any]]:
    """Instances whose last error is a weight push, and instances recently removed for failed pushes."""
    out = [{"endpoint": i.get("endpoint"), "state": i.get("state"), "error": i.get("last_error"),
            "at": i.get("last_error_at")}
           for i in st.get("instances") or [] if str(i.get("last_error") or "").startswith("weight push")]
    out += [{"endpoint": e.get("endpoint"), "state": e.get("to"), "error": e.get("reason"), "at": e.get("at")}
            for e in st.get("recent_events") or [] if "weight push failed" in str(e.get("reason") or "")]
    return out


def _clock(at: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else "-"


def _num(value: Any, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def render_push_status(pushes: list[dict[str, Any]], failures: list[dict[str, Any]]) -> str:
    if pushes:
        rows = [[_clock(p.get("at")), p.get("endpoint"), f"v{p.get('version')}",
                 f"{p.get('sender')} / {p.get('group')}",
                 _num(p["bytes"] / 1e9 if isinstance(p.get("bytes"), (int, float)) else None, 3),
                 _num(p.get("gbps"), 2), _num(p.get("total_s"), 2)] for p in pushes]
        out = "recent weight pushes\n" + table(["AT", "ENDPOINT", "VERSION", "SENDER / GROUP", "GB", "GB/S",
                                                "SECONDS"], rows)
    else:
        out = "no weight pushes yet\n"
    if failures:
        rows = [[_clock(f["at"]), f["endpoint"], f["state"], f["error"]] for f in failures]
        out += "\nweight push failures\n" + table(["AT", "ENDPOINT", "STATE", "ERROR"], rows)
    else:
        out += "no weight push failures\n"
    return out


# ------------------------------------------------------------ the subcommands
def cmd_status(args: argparse.Namespace, client: Client) -> int:
    st = client.status()
    print(json.dumps(st, indent=2) if args.json else render_status(st, client.url), end="\n" if args.json else "")
    return OK


def cmd_drain(args: argparse.Namespace, client: Client) -> int:
    # The manager answers once the instances drained (up to its drain_timeout_s): no client timeout by default.
    result = client.drain(list(args.endpoints), force=args.force, timeout_s=args.timeout)
    removed, not_found, skipped = result.removed, result.not_found, result.skipped
    if args.json:
        print(json.dumps(result.raw, indent=2))
    else:
        for ep in removed:
            print(f"removed    {ep}")
        for ep in not_found:
            print(f"not found  {ep}")
        for item in skipped:
            print(f"skipped    {item.get('endpoint')}: {item.get('reason')} (--force drains it anyway)")
    return UNKNOWN_ENDPOINT if not_found else SKIPPED if skipped else OK


def cmd_evacuate(args: argparse.Namespace, client: Client) -> int:
    if args.cancel == (args.deadline_s is not None):
        raise OpsError("give --deadline-s S (a notice) or --cancel (withdraw it), one of them", USAGE)
    if args.deadline_s is not None and not 0 < args.deadline_s <= 86400:
        raise OpsError(f"--deadline-s must be within (0, 86400], not {args.deadline_s:g}", USAGE)
    answer = client.evacuate(args.endpoint, args.deadline_s, args.source, args.cancel)
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.cancel:
        print(f"{answer.get('state', '?'):<11}{answer.get('endpoint')} (evacuation cancelled; "
              f"{answer.get('moved', 0)} sequence(s) had moved)")
    else:
        print(f"evacuating {answer.get('endpoint')}: removed in {answer.get('deadline_s')}s; "
              f"{answer.get('staying')} sequence(s) stay to finish, {answer.get('moving')} move")
    return OK


def cmd_push_status(args: argparse.Namespace, client: Client) -> int:
    st = client.status()
    pushes, failures = list(st.get("recent_weight_pushes") or []), push_failures(st)
    if args.json:
        print(json.dumps({"weight_version": st.get("weight_version"), "pushes": pushes, "failures": failures},
                         indent=2))
    else:
        print(render_push_status(pushes, failures), end="")
    return OK


def cmd_watch(args: argparse.Namespace, client: Client) -> int:
    return watch(client, interval_s=args.interval, once=args.once)


# ------------------------------------------------------------ watch (rich is imported only here)
@dataclass
class Rate:
    """Tokens/s from the streamed-token counter between two frames (moves while sequences run)."""

    last: tuple[float, int] | None = None
    value: float | None = None

    def update(self, tokens: int) -> float | None:
        now = time.monotonic()
        if self.last is not None and now > self.last[0]:
            self.value = max(0.0, (tokens - self.last[1]) / (now - self.last[0]))
        self.last = (now, tokens)
        return self.value


def frame(st: dict[str, Any] | None, url: str, rate: float | None, error: str | None = None) -> RenderableType:
    """One screen: the status page's cards, instances, recent pushes and recent events."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    title = f"rollout-manager  {url}  {time.strftime('%H:%M:%S')}"
    if st is None:
        return Panel(Text(error or "no answer yet", style="bold red"), title=title)
    gen, local = st.get("generation") or {}, st.get("local") or {}
    counts = ", ".join(f"{n} {state}" for state, n in (st.get("counts") or {}).items() if n) or "none"
    cards = Text.from_markup(
        f"[b]weights[/b] v{st.get('weight_version')}   [b]instances[/b] {len(st.get('instances') or [])} ({counts})"
        f"   [b]requests waiting[/b] {st.get('requests_waiting_for_instance', 0)}   [b]tokens/s[/b] {_num(rate, 1)}\n"
        f"[b]generation[/b] {gen.get('sequences', 0)} seq, {gen.get('continuations', 0)} continued, "
        f"{gen.get('failed', 0)} failed   [b]local window[/b] {'open' if local.get('open') else 'closed'} "
        f"(budget {_num(local.get('budget_s'), 2)}s)")
    if error:
        cards.append(f"\nlast refresh failed: {error}", style="red")

    instances = st.get("instances") or []
    streaming = any(streaming_of(i) is not None for i in instances)
    inst = Table(title="instances", title_justify="left", expand=True)
    for name in ["endpoint", "id", "kind", "state", "for", "weights", "in flight", "tokens",
                 *(["streaming"] * streaming), "waiting for", "last error"]:
        inst.add_column(name, overflow="fold")
    current = st.get("weight_version")
    for i in instances:
        behind = isinstance(current, int) and isinstance(i.get("weight_version"), int) and i["weight_version"] < current
        inst.add_row(str(i.get("endpoint")), str(i.get("id")), str(i.get("kind")),
                     Text(str(i.get("state")), style=STATE_STYLES.get(str(i.get("state")), "")),
                     f"{_num(i.get('state_for_s'), 0)}s",
                     Text(f"v{i.get('weight_version')}", style="yellow" if behind else ""),
                     str(i.get("in_flight")), str(i.get("in_flight_tokens")),
                     *([_dash(streaming_of(i))] * streaming), _dash(i.get("waiting_for")),
                     Text(_dash(i.get("last_error")), style="red" if i.get("last_error") else "dim"))

    pushes = Table(title="recent weight pushes", title_justify="left")
    for name in ("at", "endpoint", "version", "sender / group", "MB", "GB/s", "seconds"):
        pushes.add_column(name)
    for p in reversed(st.get("recent_weight_pushes") or []):
        mb = p["bytes"] / 1e6 if isinstance(p.get("bytes"), (int, float)) else None
        pushes.add_row(_clock(p.get("at")), str(p.get("endpoint")), f"v{p.get('version')}",
                       f"{p.get('sender')} / {p.get('group')}", _num(mb, 1), _num(p.get("gbps"), 2),
                       _num(p.get("total_s"), 2))

    events = Table(title="recent events", title_justify="left")
    for name in ("at", "endpoint", "change", "reason"):
        events.add_column(name, overflow="fold")
    for e in list(reversed(st.get("recent_events") or []))[:10]:
        events.add_row(_clock(e.get("at")), str(e.get("endpoint")), f"{e.get('from') or 'new'} -> {e.get('to')}",
                       str(e.get("reason")))
    return Panel(Group(cards, inst, pushes, events), title=title)


STATE_STYLES = {"active": "green", "pending": "cyan", "syncing": "yellow", "draining": "magenta",
                "evacuating": "bright_red", "dead": "red"}


def watch(client: Client, *, interval_s: float, once: bool) -> int:
    """Redraw every ``interval_s`` until Ctrl-C; an unreachable manager at start exits at once
    (a typo in --manager should not look like a blank screen), later failures are shown in the frame."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    rate = Rate()
    st = client.status()  # OpsError here: the caller reports it with its exit code
    gen = st.get("generation") or {}
    rate.update(int(gen.get("streamed_tokens", gen.get("tokens", 0)) or 0))
    if once:
        console.print(frame(st, client.url, None))
        return OK
    try:
        with Live(frame(st, client.url, None), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval_s)
                error = None
                try:
                    st = client.status()
                    gen = st.get("generation") or {}
                    rate.update(int(gen.get("streamed_tokens", gen.get("tokens", 0)) or 0))
                except OpsError as exc:
                    error = str(exc)
                live.update(frame(st, client.url, rate.value, error), refresh=True)
    except KeyboardInterrupt:
        return OK


Command = Callable[[argparse.Namespace, Client], int]


def _run(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args, client_from(args))
        except OpsError as exc:
            print(f"rollout-manager {args.command}: {exc}", file=sys.stderr)
            return exc.code

    return run


def add_subcommands(sub: Any) -> None:
    """Add ``status``, ``drain``, ``evacuate``, ``push-status`` and ``watch`` to the CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--manager", metavar="URL",
                        help=f"the manager's address (default ${ADDR_ENV} or {DEFAULT_ADDR})")
    common.add_argument("--config", metavar="FILE",
                        help=f"read auth_token from this TOML file (${TOKEN_ENV} takes precedence)")
    codes = "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items())
    epilog = f"exit codes: {codes}"

    def add(name: str, command: Command, help_text: str, *, timeout: float | None, json_help: str | None) -> Any:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text[0].upper() + help_text[1:]
                           + ".", epilog=epilog)
        if json_help:
            p.add_argument("--json", action="store_true", help=json_help)
        p.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                       help=f"HTTP timeout (default {'none' if timeout is None else f'{timeout:g}'})")
        p.set_defaults(func=_run(command))
        return p

    add("status", cmd_status, "show the manager's instances and what each waits for", timeout=10.0,
        json_help="print the whole /get_instances_status document")
    drain = add("drain", cmd_drain, "drain instances (no new work, in-flight work finishes) and remove them",
                timeout=None, json_help="print the manager's answer (removed, not_found, skipped)")
    drain.add_argument("endpoints", nargs="+", metavar="ENDPOINT", help="HOST:PORT as registered")
    drain.add_argument("--force", action="store_true", help="drain an instance even during its weight push")
    evacuate = add("evacuate", cmd_evacuate, "evacuate a box before it is taken back (a preemption notice by hand): "
                   "no new work, its long sequences move now, the rest finish there or move before the deadline, then "
                   "it is removed", timeout=10.0, json_help="print the manager's answer")
    evacuate.add_argument("endpoint", metavar="ENDPOINT", help="HOST:PORT (or http://HOST:PORT) as registered")
    evacuate.add_argument("--deadline-s", type=float, metavar="S", help="seconds until the box is gone")
    evacuate.add_argument("--source", default="manual", choices=("manual", "aws", "gce", "azure", "sigterm"),
                          help="who gave the notice (default manual; the metric evacuations_total is by it)")
    evacuate.add_argument("--cancel", action="store_true", help="withdraw the notice: the box serves again")
    add("push-status", cmd_push_status, "show recent weight pushes (GB/s, seconds) and push failures",
        timeout=10.0, json_help="print pushes and failures as JSON")
    watch = add("watch", cmd_watch, "a live view of the status page in the terminal, until Ctrl-C",
                timeout=5.0, json_help=None)
    watch.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    watch.add_argument("--once", action="store_true", help="print one frame and exit")
