"""Request bodies of the manager's API, as pydantic models.

The same models validate requests and (later) describe the API in OpenAPI, so the document cannot
drift from what the server accepts. Models are strict: ``"5000"`` is not a port, ``true`` is not 1.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Strict,
    Tag,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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


# Unions are tagged by the JSON type of the value, so a mistake is reported once, against the shape the
# caller evidently meant, instead of once per branch ("Input should be a valid list" for an int item).
# Tags contain a space, so ``validation.format_loc`` never mistakes one for a field name.
ONE, MANY = "one value", "a list"


def _one_or_list(value: Any) -> str:
    return MANY if isinstance(value, list) else ONE


def _sequence_or_batch(value: Any) -> str:
    """``[1, 2]`` is one sequence, ``[[1, 2], [3]]`` a batch: the first item says which."""
    return MANY if isinstance(value, list) and value and isinstance(value[0], list) else ONE


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


class UpdateWeightSenders(StrictModel):
    """The trainer's nodes and their IPs; each node runs one weight sender."""

    weight_sender_ips: Annotated[
        list[Annotated[list[IP], Field(min_length=1, max_length=64)]], Field(min_length=1, max_length=1024)
    ]
    num_mooncake_groups_per_sender: PositiveCount | None = None
    num_mooncake_engines_per_group: PositiveCount | None = None


TokenId = Annotated[int, Strict(), Field(ge=0)]
_MSGSPEC_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def _fast_token_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of token ids checked by msgspec, in C, at about a seventh of pydantic's cost per id: a
    prompt of 4,096 ids took pydantic ~200 us, more than the rest of a short request. msgspec accepts
    only what pydantic does (strict ints >= 0: no bools, floats or strings); anything it refuses goes
    to pydantic's own validation, so errors name the item as before."""
    if type(value) is list and len(value) > 64:  # below that, pydantic is as quick (msgspec reads the type per call)
        try:
            return msgspec.convert(value, _MSGSPEC_TOKEN_IDS, strict=True)
        except msgspec.ValidationError:
            pass
    return handler(value)


TokenIds = Annotated[list[TokenId], Field(min_length=1), WrapValidator(_fast_token_ids)]
InputIds = Annotated[
    Annotated[TokenIds, Tag(ONE)] | Annotated[Annotated[list[TokenIds], Field(min_length=1)], Tag(MANY)],
    Discriminator(_sequence_or_batch),
]
StrictBool = Annotated[bool, Strict()]
TrajectoryKey = Annotated[str, Strict(), Field(min_length=1, max_length=512)]


class SamplingParams(BaseModel):
    """The sampling fields the manager itself relies on; SGLang's other fields pass through."""

    model_config = ConfigDict(extra="allow")
    max_new_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    min_new_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None


_PER_ITEM_FIELDS = (*wire.PER_ITEM_KEYS, "trajectory_key")


class GenerateRequest(BaseModel):
    """An SGLang ``/generate`` body. ``input_ids`` is required: continuation works on tokens, so the
    trainer tokenizes (verl always does). Other SGLang fields pass through unchanged."""

    model_config = ConfigDict(extra="allow")
    input_ids: InputIds
    sampling_params: Annotated[Annotated[SamplingParams, Tag(ONE)] | Annotated[list[SamplingParams], Tag(MANY)],
                               Discriminator(_one_or_list)] | None = None
    return_logprob: Annotated[Annotated[StrictBool, Tag(ONE)] | Annotated[list[StrictBool], Tag(MANY)],
                              Discriminator(_one_or_list)] | None = None
    rid: Annotated[Annotated[str, Tag(ONE)] | Annotated[list[str], Tag(MANY)],
                   Discriminator(_one_or_list)] | None = None
    stream: Annotated[bool, Strict()] = False
    # The manager's own key (stripped before the engine sees the body): requests with one key, e.g. the
    # turns of one agent trajectory, go to the instance whose prefix cache holds their context.
    trajectory_key: Annotated[Annotated[TrajectoryKey, Tag(ONE)] | Annotated[list[TrajectoryKey | None], Tag(MANY)],
                              Discriminator(_one_or_list)] | None = None

    # The manager's own (never sent to SGLang): place the sequences only on instances at this weight
    # version or newer; none such: they wait as for capacity (wait_timeout_s), then 503.
    min_weight_version: Annotated[int, Strict(), Field(ge=0)] | None = None

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
        for name in _PER_ITEM_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list):
                if not batched:
                    raise ValueError(f"'{name}' is a list but input_ids is a single sequence")
                if len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} items for {n} sequences")
        return self


_Count = Annotated[int, msgspec.Meta(ge=0)]


class _PlainSampling(msgspec.Struct):
    max_new_tokens: _Count | None = None
    min_new_tokens: _Count | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None


class _PlainGenerate(msgspec.Struct):
    input_ids: Annotated[list[_Count], msgspec.Meta(min_length=1)]
    sampling_params: _PlainSampling | None = None
    return_logprob: bool | None = None
    rid: str | None = None
    stream: bool = False
    trajectory_key: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    min_weight_version: _Count | None = None


def plain_generate(data: Any) -> bool:
    """Whether ``data`` is a single-sequence ``/generate`` body that :class:`GenerateRequest` accepts,
    told by msgspec in C at a fraction of pydantic's cost (the commonest request, thousands a second).

    The check is never more lenient than pydantic's (strict types: no ints for bools, no strings or
    bools for numbers; no ``text``, no batch); False says nothing, and the caller validates with
    :class:`GenerateRequest`, which refuses with its message or accepts what only it accepts."""
    if type(data) is not dict or "text" in data:
        return False
    try:
        msgspec.convert(data, _PlainGenerate, strict=True)
    except msgspec.ValidationError:
        return False
    return True


RequestId = Annotated[
    Annotated[str, Strict(), Field(max_length=512), Tag("a string")] | Annotated[int, Strict(), Tag("an integer")],
    Discriminator(_int_or_str, custom_error_type="request_id_type",
                  custom_error_message="Input should be a string or an integer"),
    Field(description="the caller's id for the request, echoed in its result line; compared as a JSON value, "
                      "so 1 and \"1\" are two different ids"),
]


class BatchGenerateRequests(RootModel[list[tuple[RequestId, GenerateRequest]]]):
    """``[[id, generate_body], ...]``; ids must be unique within the batch. Ids are compared as JSON
    values: the integer 1 and the string "1" are two requests, each answered with its id as sent."""

    root: Annotated[list[tuple[RequestId, GenerateRequest]], Field(min_length=1, max_length=100_000)]

    @model_validator(mode="before")
    @classmethod
    def _is_list(cls, data: Any) -> Any:
        return _list_body(data, "[id, request] pairs")

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
