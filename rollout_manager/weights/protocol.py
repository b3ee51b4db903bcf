"""The weight agents' control API, typed: one pydantic model per request and answer body.

The manager (:mod:`rollout_manager.weights.agent_client`, :mod:`rollout_manager.weights.sync`) builds
requests and reads answers with these models; the agents validate requests and build answers with
them, so both ends agree on every field by construction. The manager imports this module, so it
must not import torch (nor the byte layer that does).

- sender ``GET /layout`` -> :class:`LayoutAnswer`
- sender ``POST /push`` :class:`PushRequest` -> :class:`PushAnswer`
- receiver ``POST /prepare`` :class:`PrepareRequest` -> :class:`PrepareAnswer`
- receiver ``POST /commit`` :class:`CommitRequest` -> :class:`CommitAnswer`
- any refusal -> :class:`ErrorAnswer` with a 4xx/5xx status

Numbers and strings are strict (``"1"`` is not a version, ``true`` is not a count): every sender of
these bodies is our own code, so a loose value is a bug worth a 400 rather than a guess.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout_manager.validation import describe_validation_error

TransportName = Literal["mooncake", "tcp"]  # as config.weight_transport
TRANSPORTS: tuple[str, ...] = get_args(TransportName)

NonNegInt = Annotated[int, Field(strict=True, ge=0)]
PosInt = Annotated[int, Field(strict=True, ge=1)]
NonNegFloat = Annotated[float, Field(strict=True, ge=0)]
Text = Annotated[str, Field(strict=True)]
NonEmptyText = Annotated[str, Field(strict=True, min_length=1)]
Shard = tuple[NonNegInt, NonNegInt]  # (offset, length) in the buffer, as weights.shards.Shard
Version = NonNegInt


class _Request(BaseModel):
    """Requests refuse unknown keys: a misspelt field is an error, not a silently used default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Answer(BaseModel):
    """Answers ignore unknown keys, so an agent may add a field before the manager reads it."""

    model_config = ConfigDict(extra="ignore", frozen=True)


def _check_checksums(shards: list[Shard], checksums: list[str]) -> None:
    if len(shards) != len(checksums):
        raise ValueError(f"{len(shards)} shards but {len(checksums)} checksums")


# ---------------------------------------------------------------- the layout, as WeightLayout.to_dict


class TensorEntry(BaseModel):
    """One tensor's slot (``TensorSpec.to_dict``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NonEmptyText
    dtype: NonEmptyText
    shape: list[NonNegInt]
    offset: NonNegInt
    nbytes: NonNegInt


class LayoutBody(BaseModel):
    """The buffer layout (``WeightLayout.to_dict``). Its consistency (slots inside the buffer, no
    overlaps, known dtypes, supported format) is checked where it is used, by ``WeightLayout.from_dict``
    in the receiver, which has torch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Annotated[int, Field(strict=True)] = 1
    alignment: PosInt
    total_bytes: NonNegInt
    tensors: list[TensorEntry]


# ---------------------------------------------------------------- sender


class LayoutAnswer(_Answer):
    """``GET /layout``: what the sender has staged. ``version`` is None while a restage is writing
    the buffer (the layout is then the previous one)."""

    version: Version | None
    layout: LayoutBody
    fingerprint: NonEmptyText


class PushRequest(_Request):
    """``POST /push``: write the staged ``version`` through group ``ip`` to one receiver's buffer."""

    version: Version
    ip: NonEmptyText
    num_engines: PosInt
    session_ids: Annotated[list[NonEmptyText], Field(min_length=1)]
    buffer_addr: NonNegInt
    transport: TransportName = "mooncake"


class PushAnswer(_Answer):
    """``POST /push`` done: the bytes landed; ``shards``/``checksums`` go on to the receiver's commit."""

    version: Version
    bytes: NonNegInt
    seconds: NonNegFloat
    gbps: NonNegFloat
    shards: list[Shard]
    checksums: list[NonEmptyText]
    fingerprint: NonEmptyText

    @model_validator(mode="after")
    def _paired(self) -> PushAnswer:
        _check_checksums(self.shards, self.checksums)
        return self


# ---------------------------------------------------------------- receiver


class PrepareRequest(_Request):
    """``POST /prepare``: have a registered buffer for ``layout`` ready for ``transport``."""

    version: Version
    layout: LayoutBody
    transport: TransportName = "mooncake"


class PrepareAnswer(_Answer):
    """Where the sender writes: the receiver's session ids (one per engine) and buffer address."""

    session_ids: Annotated[list[NonEmptyText], Field(min_length=1)]
    buffer_addr: NonNegInt
    buffer_bytes: NonNegInt
    fingerprint: NonEmptyText


class CommitRequest(_Request):
    """``POST /commit``: verify every shard against its checksum, then load ``version`` into SGLang."""

    version: Version
    fingerprint: NonEmptyText
    shards: list[Shard]
    checksums: list[NonEmptyText]

    @model_validator(mode="after")
    def _paired(self) -> CommitRequest:
        _check_checksums(self.shards, self.checksums)
        return self


class CommitAnswer(_Answer):
    """The version is verified and loaded."""

    ok: Annotated[bool, Field(strict=True)]
    version: Version
    verify_s: NonNegFloat
    load_s: NonNegFloat
    buckets: NonNegInt


class ErrorAnswer(_Answer):
    """Any refusal or failure, with the HTTP status saying whose it is (see the agents)."""

    error: Text


# ---------------------------------------------------------------- parsing

Body = TypeVar("Body", bound=BaseModel)


class BadBody(ValueError):
    """A body that is not JSON, not an object, or not what the model says; the message names the field."""


def parse_body(raw: bytes | str, model: type[Body]) -> Body:
    """Decode and validate one body (a request in an agent, an answer in the manager)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise BadBody("body is not JSON") from None
    if not isinstance(data, dict):
        raise BadBody("body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadBody(describe_validation_error(exc)) from None
