"""Request bodies of the manager's API, as pydantic models.

The same models validate requests and (later) describe the API in OpenAPI, so the document cannot
drift from what the server accepts. Models are strict: ``"5000"`` is not a port, ``true`` is not 1.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, Strict, model_validator

from rollout_manager.sglang import wire

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


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
    mooncake_handshake_port: Port | None = None
    weight_receiver_port: Port | None = Field(
        default=None, description="control port of the box's weight receiver agent (needed after version 0)")


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
    num_mooncake_groups_per_sender: PositiveCount | None = None
    num_mooncake_engines_per_group: PositiveCount | None = None


TokenId = Annotated[int, Strict(), Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class SamplingParams(BaseModel):
    """The sampling fields the manager itself relies on; SGLang's other fields pass through."""

    model_config = ConfigDict(extra="allow")
    max_new_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    min_new_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None


class GenerateRequest(BaseModel):
    """An SGLang ``/generate`` body. ``input_ids`` is required: continuation works on tokens, so the
    trainer tokenizes (verl always does). Other SGLang fields pass through unchanged."""

    model_config = ConfigDict(extra="allow")
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: Annotated[bool, Strict()] | list[Annotated[bool, Strict()]] | None = None
    rid: str | list[str] | None = None
    stream: Annotated[bool, Strict()] = False

    @model_validator(mode="before")
    @classmethod
    def _no_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and "text" in data:
            raise ValueError("'text' input is not supported: the manager continues sequences token by "
                             "token, so send 'input_ids' (tokenize on the trainer side)")
        return data

    @model_validator(mode="after")
    def _per_item_lists_match_batch(self) -> GenerateRequest:
        batched = isinstance(self.input_ids[0], list)
        n = len(self.input_ids)
        for name in wire.PER_ITEM_KEYS:
            value = getattr(self, name, None)
            if isinstance(value, list):
                if not batched:
                    raise ValueError(f"'{name}' is a list but input_ids is a single sequence")
                if len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} items for {n} sequences")
        return self


RequestId = Annotated[str, Strict(), Field(max_length=512)] | Annotated[int, Strict()]


class BatchGenerateRequests(RootModel[list[tuple[RequestId, GenerateRequest]]]):
    """``[[id, generate_body], ...]``; ids must be unique within the batch."""

    root: Annotated[list[tuple[RequestId, GenerateRequest]], Field(min_length=1, max_length=100_000)]

    @model_validator(mode="after")
    def _unique_ids(self) -> BatchGenerateRequests:
        seen: set[Any] = set()
        for rid, _ in self.root:
            key = (type(rid).__name__, rid)
            if key in seen:
                raise ValueError(f"request id {rid!r} appears more than once")
            seen.add(key)
        return self


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class UpdateMetrics(StrictModel):
    """What the trainer measured in the step that just ended."""

    step_time_s: Seconds
    trainer_bubble_time_s: Seconds
    step_throughput: Seconds


class Empty(StrictModel):
    """A body with no fields (``{}``); an absent body is accepted too."""


class UpdateWeightVersion(StrictModel):
    """The trainer finished a step and staged new weights; optionally wait until instances have them."""

    new_version: Annotated[int, Strict(), Field(ge=1)] | None = None
    wait_for_instances: Annotated[int, Strict(), Field(ge=0)] | Literal["all"] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = 600.0
