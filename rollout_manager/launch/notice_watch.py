"""The box side of evacuation: preemption notices turned into ``POST /evacuate_instance``.

``notice-watch`` runs beside SGLang (started by ``scripts/launch_sglang.sh`` once the box is
registered) and asks one metadata provider (``notices``) for a notice, as often as that cloud
recommends. A notice is reported with the seconds left until the machine goes (relative, so the
manager's clock need not agree with the box's); a notice whose deadline moved earlier is reported
again; a notice that is withdrawn, or that the box outlives by ``outlive_s``, is taken back with
``POST /cancel_evacuation``. ``evacuate`` is the SIGTERM path: the launcher reports its grace period
as the deadline and keeps SGLang serving until the manager has removed the box or the grace is spent.
``notice-detect`` tells the launcher which metadata service answers (``auto``) and whether the machine
is a spot one. Calls to the manager carry the box token from the registration's state file (it may
evacuate this box and no other), the shared token where the manager issued none.

Standard library only, like the rest of the box helper.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from rollout_manager.launch.box_common import BoxError, Unreachable, manager_call, say
from rollout_manager.launch.box_registration import read_box_token
from rollout_manager.launch.notices import (
    PROVIDERS,
    MetadataUnavailable,
    MetadataURLs,
    Notice,
    Provider,
    detect,
    make_provider,
)
from rollout_manager.manager_client import INSTANCES_STATUS, HTTPAnswer, error_message

EVACUATE = "/evacuate_instance"
CANCEL_EVACUATION = "/cancel_evacuation"
MIN_DEADLINE_S = 1.0  # the contract wants > 0; a notice read late still gives the manager a moment
URL_ENV = {"aws": "ROLLOUT_AWS_METADATA_URL", "gce": "ROLLOUT_GCE_METADATA_URL",
           "azure": "ROLLOUT_AZURE_METADATA_URL"}


class ReportOutcome(Enum):
    DONE = "done"  # the manager took it
    RETRY = "retry"  # not now (unreachable, 5xx, not registered yet): again at the next poll
    REFUSED = "refused"  # a 4xx that asking again will not change


class Reporter(Protocol):
    """What the watch loop needs from the manager (:class:`ManagerReporter`; tests may pass their own)."""

    def evacuate(self, notice: Notice, deadline_s: float) -> tuple[ReportOutcome, str]: ...
    def cancel(self) -> tuple[ReportOutcome, str]: ...


@dataclass
class ManagerReporter:
    """Reports to the manager for one box (``endpoint``), authorised by the box token in ``state_file``."""

    manager: str
    endpoint: str
    state_file: str | None = None
    timeout_s: float = 5.0

    def post(self, path: str, body: dict[str, Any]) -> HTTPAnswer:
        """Raises :class:`Unreachable` when the manager does not answer; any status is returned."""
        token = read_box_token(self.state_file)
        answer = manager_call(self.manager, "POST", path, body, timeout=self.timeout_s, token=token)
        if answer.status == 401 and token is not None:  # a manager that does not know it: the shared token
            answer = manager_call(self.manager, "POST", path, body, timeout=self.timeout_s)
        return answer

    def _deliver(self, path: str, body: dict[str, Any]) -> tuple[ReportOutcome, str]:
        try:
            answer = self.post(path, body)
        except BoxError as exc:  # Unreachable, or the shared token refused
            return (ReportOutcome.RETRY if isinstance(exc, Unreachable) else ReportOutcome.REFUSED), str(exc)
        why = f"HTTP {answer.status} {error_message(answer.body)}"
        if answer.status == 200:
            return ReportOutcome.DONE, why
        if answer.status >= 500 or answer.status == 404:  # 404: not (yet, or again) registered there
            return ReportOutcome.RETRY, why
        return ReportOutcome.REFUSED, why

    def evacuate(self, notice: Notice, deadline_s: float) -> tuple[ReportOutcome, str]:
        return self._deliver(EVACUATE, {"endpoint": self.endpoint, "deadline_s": round(deadline_s, 3),
                                        "source": notice.source, "detail": notice.detail[:512]})

    def cancel(self) -> tuple[ReportOutcome, str]:
        return self._deliver(CANCEL_EVACUATION, {"endpoint": self.endpoint})


def watch(provider: Provider, reporter: Reporter, stop: threading.Event, *,
          outlive_s: float = 60.0, error_pause_s: float = 1.0, log: Callable[[str], None] = say) -> None:
    """Until ``stop`` is set: poll ``provider``; report a new notice (or one whose deadline moved earlier),
    cancel one that was withdrawn or outlived. A report the manager could not take is tried again at the
    next poll; the metadata service going quiet is said once and waited out."""
    held: Notice | None = None  # the notice reported last
    accepted = False  # whether the manager took it (a refused one has nothing to cancel)
    spent: set[str] = set()  # notices this box outlived: never reported again
    failing: str | None = None  # the last problem said, so it is said once
    quiet = False

    def trouble(what: str) -> None:
        nonlocal failing
        if what != failing:
            failing = what
            log(f"warning: {what}")

    while not stop.is_set():
        try:
            notice = provider.current()
        except MetadataUnavailable as exc:
            if not quiet:
                quiet = True
                log(f"{provider.name} metadata service does not answer ({exc}); still watching")
            stop.wait(max(provider.poll_interval_s, error_pause_s))
            continue
        if quiet:
            quiet = False
            log(f"{provider.name} metadata service answers again")
        now = time.time()
        if notice is not None and notice.key in spent:
            notice = None if held is None else held
        if notice is not None and (held is None or notice.deadline_at < held.deadline_at - 0.5):
            left = max(notice.seconds_left(now), MIN_DEADLINE_S)
            outcome, why = reporter.evacuate(notice, left)
            if outcome is ReportOutcome.DONE:
                held, accepted, failing = notice, True, None
                log(f"preemption notice ({notice.detail}): reported to the manager, {left:.1f}s left")
            elif outcome is ReportOutcome.REFUSED:
                held = notice  # asking again would be refused again (an earlier one was taken: still held)
                log(f"warning: the manager refused the preemption notice ({notice.detail}): {why}")
            else:
                trouble(f"preemption notice ({notice.detail}) not delivered yet: {why}; retrying")
        elif held is not None and (notice is None or now > held.deadline_at + outlive_s):
            outlived = notice is not None
            if not accepted:  # the manager never took it: nothing to take back
                held = None
                stop.wait(provider.poll_interval_s)
                continue
            outcome, why = reporter.cancel()
            if outcome is ReportOutcome.RETRY:
                trouble(f"cancelling the evacuation not delivered yet: {why}; retrying")
            else:
                reason = f"outlived its deadline by {outlive_s:g}s" if outlived else "the notice was withdrawn"
                if outcome is ReportOutcome.DONE:
                    log(f"{reason}: evacuation cancelled, the box is back in service")
                else:
                    log(f"{reason}, but the manager did not take the box back ({why}); restart the launcher "
                        f"to rejoin")
                if outlived:
                    spent.add(held.key)
                held, accepted, failing = None, False, None
        stop.wait(provider.poll_interval_s)


# ---------------------------------------------------------------- SIGTERM: evacuate, then wait


def removed(manager: str, endpoint: str, timeout_s: float) -> bool | None:
    """Whether the manager no longer serves ``endpoint`` (gone from its status, or dead); None when it
    does not answer."""
    try:
        status, answer = manager_call(manager, "GET", INSTANCES_STATUS, timeout=timeout_s).status_body
    except BoxError:
        return None
    if status != 200 or not isinstance(answer, dict):
        return None
    for inst in answer.get("instances") or []:
        if isinstance(inst, dict) and inst.get("endpoint") == endpoint:
            return inst.get("state") == "dead"
    return True


def evacuate_and_wait(reporter: ManagerReporter, source: str, grace_s: float, since: float,
                      wait: bool, interval_s: float = 0.25) -> bool:
    """Report the box as going ``grace_s`` after ``since`` (wall clock); with ``wait``, return once the
    manager has removed it or the grace is spent. False when the manager did not take the report (the
    launcher then deregisters as before)."""
    left = max(since + grace_s - time.time(), MIN_DEADLINE_S)
    notice = Notice(source, time.time() + left, f"{source}: the box stops within {grace_s:g}s", f"{source}:{since}")
    outcome, why = reporter.evacuate(notice, left)
    if outcome is not ReportOutcome.DONE:
        say(f"the manager did not take the evacuation ({why}); deregistering instead")
        return False
    say(f"evacuating {reporter.endpoint}: the manager moves its work elsewhere within {left:.1f}s; still serving")
    if not wait:
        return True
    end = since + grace_s
    while time.time() < end:
        if removed(reporter.manager, reporter.endpoint, min(2.0, max(end - time.time(), 0.1))):
            say(f"the manager has removed {reporter.endpoint}")
            return True
        time.sleep(min(interval_s, max(end - time.time(), 0.0)))
    say(f"grace period of {grace_s:g}s spent; stopping (the manager moves what is left)")
    return True


# ---------------------------------------------------------------- commands


def metadata_urls(args: argparse.Namespace) -> MetadataURLs:
    """From the flags, else ``$ROLLOUT_{AWS,GCE,AZURE}_METADATA_URL``, else the link-local default."""
    def pick(name: str) -> str:
        return getattr(args, f"{name}_url", None) or os.environ.get(URL_ENV[name]) or MetadataURLs().aws

    return MetadataURLs(aws=pick("aws"), gce=pick("gce"), azure=pick("azure"))


def add_metadata_args(p: argparse.ArgumentParser) -> None:
    for name in PROVIDERS:
        p.add_argument(f"--{name}-url", help=f"{name} metadata base URL (default ${URL_ENV[name]}, else "
                                             f"http://169.254.169.254)")
    p.add_argument("--timeout", type=float, default=1.0, help="seconds each metadata request may take")
    p.add_argument("--gce-notice-s", type=float, default=30.0, help="GCE's preemption notice (seconds)")


def cmd_notice_detect(args: argparse.Namespace) -> None:
    """Prints ``{"provider": name or null, "answered": bool, "preemptible": bool or null}``."""
    urls = metadata_urls(args)
    names = list(PROVIDERS) if args.mode == "auto" else [args.mode]
    candidates = [make_provider(n, urls, args.timeout, args.gce_notice_s) for n in names]
    found = detect(candidates)
    if found is None and args.mode != "auto":  # named by hand: watched even though it is quiet now
        print(json.dumps({"provider": args.mode, "answered": False, "preemptible": None}))
        return
    spot = found.preemptible() if found else None
    print(json.dumps({"provider": found.name if found else None, "answered": found is not None,
                      "preemptible": spot}))


def _endpoint_from_state(state_file: str) -> str:
    try:
        with open(state_file) as f:
            endpoint = json.load(f).get("endpoint")
    except (OSError, ValueError, AttributeError):
        endpoint = None
    if not isinstance(endpoint, str) or not endpoint:
        raise BoxError(f"no registered endpoint in {state_file}")
    return endpoint


def cmd_notice_watch(args: argparse.Namespace) -> None:
    provider = make_provider(args.provider, metadata_urls(args), max(args.timeout, 2.0), args.gce_notice_s)
    endpoint = args.endpoint or _endpoint_from_state(args.state_file)
    reporter = ManagerReporter(args.manager, endpoint, args.state_file)
    say(f"watching for preemption notices from the {provider.name} metadata service")
    watch(provider, reporter, threading.Event(), outlive_s=args.outlive_s)


def cmd_evacuate(args: argparse.Namespace) -> None:
    reporter = ManagerReporter(args.manager, args.endpoint, args.state_file)
    since = args.since if args.since else time.time()
    if not evacuate_and_wait(reporter, args.source, args.deadline_s, since, args.wait):
        raise SystemExit(1)
