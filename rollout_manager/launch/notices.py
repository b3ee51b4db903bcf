"""Preemption notices from the clouds' instance metadata services: AWS EC2 Spot, GCE, Azure.

A spot box is warned before its cloud takes it back (AWS: two minutes, GCE: about 30 seconds, Azure:
at least 30 seconds). Each provider here answers the launcher's three questions: does this metadata
service answer at all (``probe``, for ``--preemption-notice auto``), is this machine a spot one
(``preemptible``), and is a notice out now (``current``: a :class:`Notice` with the wall-clock time
the machine goes, or None). The watch loop (``notice_watch``) turns those answers into calls to the
manager. Every base URL is an argument, so tests point them at loopback fakes.

Standard library only: it runs in SGLang's environment beside the launcher. Requests bypass any
HTTP proxy of the environment (the metadata service is link-local: a proxy would answer for it).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

# All three clouds serve their metadata on this link-local address.
METADATA_URL = "http://169.254.169.254"
PROVIDERS = ("aws", "gce", "azure")


class MetadataUnavailable(Exception):
    """The metadata service gave no usable answer (nothing listens, a timeout, an unexpected status)."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice: which cloud said it, when (wall clock, ``time.time()``) the machine goes,
    and ``key``, equal for the same notice seen again (so a repeat is not reported twice)."""

    source: str
    deadline_at: float
    detail: str
    key: str

    def seconds_left(self, now: float | None = None) -> float:
        return self.deadline_at - (time.time() if now is None else now)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    text: str


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(method: str, url: str, headers: Mapping[str, str], timeout_s: float) -> Answer:
    """One request to a metadata service; any HTTP status is an answer, anything else raises
    :class:`MetadataUnavailable`."""
    data = b"" if method in ("PUT", "POST") else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            return Answer(r.status, dict(r.headers.items()), r.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read().decode(errors="replace")
        except OSError:
            body = ""
        return Answer(exc.code, dict(exc.headers.items()) if exc.headers else {}, body)
    except (OSError, http.client.HTTPException) as exc:
        raise MetadataUnavailable(f"{method} {url}: {exc}") from None


def parse_iso_utc(text: str) -> float:
    """``2017-09-18T08:22:00Z`` (AWS's ``time``) -> epoch seconds; a time without a zone is UTC."""
    t = text.strip()
    if t.endswith("Z"):
        t = t[:-1] + "+00:00"
    when = datetime.fromisoformat(t)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


class Provider(Protocol):
    """A metadata service that may announce this machine's preemption."""

    name: str
    poll_interval_s: float  # between calls of current(); 0 where current() itself waits (GCE)

    def probe(self) -> bool: ...
    def preemptible(self) -> bool | None: ...
    def current(self) -> Notice | None: ...


@dataclass
class AwsSpot:
    """EC2 Spot through IMDSv2: a session token (``PUT /latest/api/token``), then
    ``GET /latest/meta-data/spot/instance-action``: 404 while no interruption is planned, else
    ``{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}``. AWS recommends checking every 5 s.
    Falls back to IMDSv1 (no token) when the token call is refused."""

    base_url: str = METADATA_URL
    timeout_s: float = 2.0
    token_ttl_s: int = 21600
    poll_interval_s: float = 5.0
    name: str = "aws"
    _token: str | None = field(default=None, repr=False)
    _token_until: float = 0.0

    def _new_token(self) -> Answer:
        return fetch("PUT", self.base_url + "/latest/api/token",
                     {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)}, self.timeout_s)

    def _headers(self) -> dict[str, str]:
        if self._token is None or time.monotonic() >= self._token_until:
            answer = self._new_token()
            if answer.status == 200 and answer.text.strip():
                self._token = answer.text.strip()
                self._token_until = time.monotonic() + max(self.token_ttl_s - 60, 1)
            else:
                self._token = None  # IMDSv1
        return {"X-aws-ec2-metadata-token": self._token} if self._token else {}

    def _get(self, path: str) -> Answer:
        answer = fetch("GET", self.base_url + path, self._headers(), self.timeout_s)
        if answer.status == 401:  # the token expired early (or the service restarted): one new one
            self._token = None
            answer = fetch("GET", self.base_url + path, self._headers(), self.timeout_s)
        return answer

    def probe(self) -> bool:
        try:
            answer = self._new_token()
        except MetadataUnavailable:
            return False
        return answer.status == 200 and bool(answer.text.strip())

    def preemptible(self) -> bool | None:
        try:
            answer = self._get("/latest/meta-data/instance-life-cycle")
        except MetadataUnavailable:
            return None
        return answer.text.strip() == "spot" if answer.status == 200 else None

    def current(self) -> Notice | None:
        answer = self._get("/latest/meta-data/spot/instance-action")
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise MetadataUnavailable(f"spot/instance-action: HTTP {answer.status}")
        try:
            item = json.loads(answer.text)
            action, when = str(item["action"]), str(item["time"])
            deadline = parse_iso_utc(when)
        except (ValueError, KeyError, TypeError):
            raise MetadataUnavailable(f"spot/instance-action is not {{action, time}}: {answer.text[:200]!r}") from None
        return Notice("aws", deadline, f"spot instance-action {action} at {when}", f"aws:{action}:{when}")


@dataclass
class GceMetadata:
    """GCE through the metadata server (header ``Metadata-Flavor: Google``): ``instance/preempted`` turns
    ``TRUE`` when the VM is being preempted, about ``notice_s`` (30) seconds before it stops. Waited on
    with ``wait_for_change=true`` and the last ``ETag``, so a change is seen at once and none is missed
    between two requests."""

    base_url: str = METADATA_URL
    timeout_s: float = 2.0
    notice_s: float = 30.0
    wait_s: int = 60  # the server's timeout_sec for one hanging request
    poll_interval_s: float = 0.0
    name: str = "gce"
    _etag: str | None = None
    _since: float | None = None

    def _get(self, path: str, timeout_s: float | None = None) -> Answer:
        return fetch("GET", self.base_url + "/computeMetadata/v1/" + path, {"Metadata-Flavor": "Google"},
                     self.timeout_s if timeout_s is None else timeout_s)

    def probe(self) -> bool:
        try:
            answer = self._get("instance/id")
        except MetadataUnavailable:
            return False
        return answer.status == 200 and answer.headers.get("Metadata-Flavor") == "Google"

    def preemptible(self) -> bool | None:
        """``instance/scheduling/preemptible`` is ``TRUE`` for a preemptible VM; a Spot VM is the newer
        provisioning model, named by ``instance/scheduling/provisioning-model`` (``SPOT``), so both are asked."""
        seen: bool | None = None
        for path, yes in (("instance/scheduling/preemptible", "TRUE"),
                          ("instance/scheduling/provisioning-model", "SPOT")):
            try:
                answer = self._get(path)
            except MetadataUnavailable:
                continue
            if answer.status == 200:
                if answer.text.strip().upper() == yes:
                    return True
                seen = False
        return seen

    def current(self) -> Notice | None:
        path, timeout = "instance/preempted", self.timeout_s
        if self._etag:
            query = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag,
                                            "timeout_sec": self.wait_s})
            path, timeout = f"{path}?{query}", self.wait_s + self.timeout_s + 5
        try:
            answer = self._get(path, timeout)
        except MetadataUnavailable:
            self._etag = None  # ask plainly next time
            raise
        if answer.status != 200:
            self._etag = None
            raise MetadataUnavailable(f"instance/preempted: HTTP {answer.status}")
        self._etag = answer.headers.get("ETag") or None
        if answer.text.strip().upper() != "TRUE":
            self._since = None
            return None
        if self._since is None:
            self._since = time.time()
        return Notice("gce", self._since + self.notice_s, "instance/preempted is TRUE", f"gce:{self._since}")


@dataclass
class AzureScheduledEvents:
    """Azure through Scheduled Events (``/metadata/scheduledevents``, header ``Metadata: true``): an
    event of ``EventType`` ``Preempt`` (a Spot VM evicted; at least 30 s) or ``Terminate`` (the VM is
    deleted) whose ``Resources`` name this VM, going at ``NotBefore`` (blank once it has started).
    Microsoft recommends polling once a second. Events are not acknowledged: approving one lets Azure
    start it sooner, and the manager wants all the notice there is."""

    base_url: str = METADATA_URL
    timeout_s: float = 2.0
    api_version: str = "2020-07-01"
    instance_api_version: str = "2021-02-01"
    poll_interval_s: float = 1.0
    name: str = "azure"
    event_types: tuple[str, ...] = ("Preempt", "Terminate")
    vm_name: str | None = None
    _asked_name: bool = False

    def _get(self, path: str, api_version: str) -> Answer:
        return fetch("GET", f"{self.base_url}{path}?api-version={api_version}", {"Metadata": "true"}, self.timeout_s)

    def _compute(self) -> dict[str, Any] | None:
        answer = self._get("/metadata/instance/compute", self.instance_api_version)
        if answer.status != 200:
            return None
        try:
            compute = json.loads(answer.text)
        except ValueError:
            return None
        return compute if isinstance(compute, dict) else None

    def probe(self) -> bool:
        try:
            return self._compute() is not None
        except MetadataUnavailable:
            return False

    def preemptible(self) -> bool | None:
        try:
            compute = self._compute()
        except MetadataUnavailable:
            return None
        return None if compute is None else str(compute.get("priority", "")) in ("Spot", "Low")

    def _my_name(self) -> str | None:
        if not self._asked_name and self.vm_name is None:
            self._asked_name = True
            try:
                compute = self._compute()
            except MetadataUnavailable:
                compute = None
            if compute and compute.get("name"):
                self.vm_name = str(compute["name"])
        return self.vm_name

    def current(self) -> Notice | None:
        answer = self._get("/metadata/scheduledevents", self.api_version)
        if answer.status != 200:
            raise MetadataUnavailable(f"scheduledevents: HTTP {answer.status}")
        try:
            events = json.loads(answer.text).get("Events") or []
        except (ValueError, AttributeError):
            raise MetadataUnavailable(f"scheduledevents is not a document: {answer.text[:200]!r}") from None
        name = self._my_name()
        mine = [e for e in events if isinstance(e, dict) and e.get("EventType") in self.event_types
                and (name is None or not e.get("Resources") or name in e.get("Resources", []))]
        notices = [self._notice(e) for e in mine]
        return min(notices, key=lambda n: n.deadline_at) if notices else None

    def _notice(self, event: dict[str, Any]) -> Notice:
        not_before = str(event.get("NotBefore") or "").strip()
        try:
            deadline = email.utils.parsedate_to_datetime(not_before).timestamp() if not_before else time.time()
        except (TypeError, ValueError):
            deadline = time.time()  # unreadable: treat it as going now
        kind, status = event.get("EventType"), event.get("EventStatus")
        return Notice("azure", deadline, f"Scheduled Event {kind} ({status}), NotBefore {not_before or 'now'}",
                      f"azure:{event.get('EventId')}")


@dataclass(frozen=True)
class MetadataURLs:
    """Where each cloud's metadata service is (all link-local by default; tests give loopback fakes)."""

    aws: str = METADATA_URL
    gce: str = METADATA_URL
    azure: str = METADATA_URL


def make_provider(name: str, urls: MetadataURLs, timeout_s: float = 2.0, gce_notice_s: float = 30.0) -> Provider:
    if name == "aws":
        return AwsSpot(urls.aws.rstrip("/"), timeout_s)
    if name == "gce":
        return GceMetadata(urls.gce.rstrip("/"), timeout_s, notice_s=gce_notice_s)
    if name == "azure":
        return AzureScheduledEvents(urls.azure.rstrip("/"), timeout_s)
    raise ValueError(f"no metadata provider {name!r} (one of {', '.join(PROVIDERS)})")


def detect(candidates: Sequence[Provider]) -> Provider | None:
    """The first of ``candidates`` (in their order) whose metadata service answers; all are asked at
    once, so a box in no cloud waits one timeout, not one per cloud."""
    answered: dict[int, bool] = {}

    def ask(i: int, provider: Provider) -> None:
        answered[i] = provider.probe()

    threads = [threading.Thread(target=ask, args=(i, p), daemon=True) for i, p in enumerate(candidates)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return next((p for i, p in enumerate(candidates) if answered.get(i)), None)
