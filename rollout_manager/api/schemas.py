"""Request bodies of the manager's admin API, as pydantic models.

The same models validate requests and describe the API in OpenAPI, so the document cannot drift from
what the server accepts. Models are strict: ``"5000"`` is not a port, ``true`` is not 1. Generation
bodies (``/generate``, ``/batch_generate_requests``) are msgspec types decoded straight into the request
the rollout flow runs (``rollout.request``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Strict,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

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


# Unions are tagged by the JSON type of the value, so a mistake is reported once, against the shape the
# caller evidently meant, instead of once per branch. Tags contain a space, so ``validation.format_loc``
# never mistakes one for a field name.


def _int_or_str(value: Any) -> str | None:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int) and not isinstance(value, bool):
        return "an integer"
    return None  # neither: one message naming both


def _list_body(data: Any, items: str) -> Any:
    """A root model's check that the body is a list at all, worded as what the body must be."""
    if not isinstance(data, list):
        raise PydanticCustomError("list_type", "the body must be a JSON list of {items}", {"items": items})
    return data


class RegisterRolloutInstance(StrictModel):
    """A rollout box announcing its SGLang server (and its weight receiver's Mooncake handshake port)."""

    host: Host
    port: Port
    mooncake_handshake_port: Port | None = None
    weight_receiver_port: Port | None = Field(
        default=None, description="control port of the box's weight receiver agent (needed after version 0)")
    vocab_size: Annotated[int, Field(ge=1, le=2**31)] | None = Field(
        default=None, description="the served model's vocabulary size (its config.json); input ids at or "
                                  "above it are refused before they reach the box (SGLang does not report it)")
    vocab_source: Literal["declared", "model_config"] = Field(
        default="declared", description="where vocab_size comes from: 'model_config' when it was read from the "
        "config.json of the files the box serves (scripts/launch_sglang.sh does), so the manager's own requests "
        "(the trust probe) may use ids below it; 'declared' (by hand) only bounds what callers may send, and "
        "the manager's own requests use ids the box has been seen to take")
    preemptible: bool = Field(default=False, description="its cloud may take the box back (spot, preemptible): "
                              "placement keeps the sequences predicted longest off it when it has the choice")
    price_per_hour: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] | None = Field(
        default=None, description="what the box costs per hour (any currency, the same for every box), for the "
                                  "status and the scaling signal")


class RegisterLocalRolloutInstances(RootModel[list[tuple[Host, Port]]]):
    """Trainer-side instances as ``[[host, port], ...]``; the trainer updates their weights itself."""

    root: Annotated[list[tuple[Host, Port]], Field(min_length=1, max_length=1024)]

    @model_validator(mode="before")
    @classmethod
    def _is_list(cls, data: Any) -> Any:
        return _list_body(data, "[host, port] pairs")


class ShutdownInstances(StrictModel):
    """Drain and remove instances; with ``check_weight_update`` never cut a weight push short."""

    endpoints: Annotated[list[Endpoint], Field(min_length=1, max_length=4096)]
    check_weight_update: bool = False


def _box_endpoint(value: str) -> str:
    """``http://host:port`` (as a box names itself) or ``host:port``, as the registry keys it: ``host:port``."""
    for scheme in ("http://", "https://"):
        if value.startswith(scheme):
            value = value[len(scheme):]
    return _check_endpoint(value.rstrip("/"))


BoxEndpoint = Annotated[str, Strict(), Field(min_length=3, max_length=300), AfterValidator(_box_endpoint)]


class EvacuateInstance(StrictModel):
    """A preemption notice for a box: evacuate it before ``deadline_s`` (a second notice only brings it forward)."""

    endpoint: BoxEndpoint = Field(description="the box's SGLang endpoint as registered (http://host:port or "
                                              "host:port)")
    deadline_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = Field(
        description="seconds from when the manager receives the notice until the box is gone (relative, so the "
                    "box's and the manager's clocks need not agree)")
    source: Literal["aws", "gce", "azure", "sigterm", "manual"] = "manual"
    detail: Annotated[str, Field(max_length=512)] | None = None


class CancelEvacuation(StrictModel):
    """The notice was cancelled, or the box outlived its deadline: it serves again."""

    endpoint: BoxEndpoint


class UpdateWeightSenders(StrictModel):
    """The trainer's nodes and their IPs; each node runs one weight sender."""

    weight_sender_ips: Annotated[
        list[Annotated[list[IP], Field(min_length=1, max_length=64)]], Field(min_length=1, max_length=1024)
    ]
    num_mooncake_groups_per_sender: PositiveCount | None = None
    num_mooncake_engines_per_group: PositiveCount | None = None


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
    wait_for_instances: Annotated[
        Annotated[int, Strict(), Field(ge=0), Tag("an integer")] | Annotated[Literal["all"], Tag("a string")],
        Discriminator(_int_or_str, custom_error_type="wait_for_type",
                      custom_error_message="Input should be a non-negative integer or 'all'"),
    ] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = 600.0
    # "serving": wait until the instances serve the version; "staged": until they hold it verified (staged
    # beside the version they serve, or serving it), which with weight_activation = "staged" comes before
    # the short activation pause.
    wait_until: Literal["serving", "staged"] = "serving"


Gap = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class BoxMismatch(StrictModel):
    """One instance's share of a step's trainer/rollout log-prob gap (the tokens it made)."""

    instance: Annotated[str, Field(min_length=1, max_length=200, description="the manager's instance id (a segment's "
                                                                              "`instance`)")]
    endpoint: Annotated[str, Field(max_length=300)] = ""
    tokens: Annotated[int, Field(ge=1)]
    mean_abs_diff: Gap = Field(description="mean |trainer - rollout| log-prob over its tokens")
    k3_kl: Gap = Field(description="mean of exp(r) - r - 1, r = trainer - rollout log-prob (k3 estimate of "
                                   "KL(rollout || trainer))")


class UpdateProbeReference(StrictModel):
    """The trust probe prompt's log-probs computed with the trainer's own model at a weight version."""

    weight_version: Annotated[int, Field(ge=0)]
    input_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=4096,
                                                                  description="the probe prompt (GET /probe_prompt)")]
    logprobs: Annotated[list[Annotated[float, Field(le=0, allow_inf_nan=False)]],
                        Field(max_length=4096, description="the log-prob of each prompt token after the first")]


class UpdateMismatch(StrictModel):
    """The trainer's log-prob mismatch of one step, split by the instance that made each token."""

    step: Annotated[int, Field(ge=0)]
    boxes: Annotated[list[BoxMismatch], Field(max_length=4096)]
    unattributed_tokens: Annotated[int, Field(ge=0)] = 0
