"""Request bodies of the manager's API, as pydantic models.

The same models validate requests and (later) describe the API in OpenAPI, so the document cannot
drift from what the server accepts. Models are strict: ``"5000"`` is not a port, ``true`` is not 1.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, Strict

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def _check_host(value: str) -> str:
    value = value.strip()
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise ValueError(f"{value!r} is not an IP address or host name (no scheme, no port)")
    return value


def _check_ip(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address") from None
    return value


def _check_endpoint(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    _check_host(host.strip("[]"))
    return value


Host = Annotated[str, Strict(), Field(min_length=1, max_length=253), AfterValidator(_check_host)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
IP = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_check_ip)]
Endpoint = Annotated[str, Field(min_length=3, max_length=300), AfterValidator(_check_endpoint)]
PositiveCount = Annotated[int, Field(gt=0, le=1024)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class RegisterRolloutInstance(StrictModel):
    """A rollout box announcing its SGLang server (and its weight receiver's Mooncake handshake port)."""

    host: Host
    port: Port
    mooncake_handshake_port: Optional[Port] = None


class RegisterLocalRolloutInstances(RootModel[list[tuple[Host, Port]]]):
    """Trainer-side instances as ``[[host, port], ...]``; the trainer updates their weights itself."""

    root: Annotated[list[tuple[Host, Port]], Field(min_length=1, max_length=1024)]


class ShutdownInstances(StrictModel):
    """Drain and remove instances; with ``check_weight_update`` never cut a weight push short."""

    endpoints: Annotated[list[Endpoint], Field(min_length=1, max_length=4096)]
    check_weight_update: bool = False


class UpdateWeightSenders(StrictModel):
    """The trainer's nodes and their IPs; each node runs one weight sender."""

    weight_sender_ips: Annotated[
        list[Annotated[list[IP], Field(min_length=1, max_length=64)]], Field(min_length=1, max_length=1024)
    ]
    num_mooncake_groups_per_sender: Optional[PositiveCount] = None
    num_mooncake_engines_per_group: Optional[PositiveCount] = None
