"""The weight agents' control API, typed: one pydantic model per request and answer body.

Runs in: manager, box, trainer.

The manager (:mod:`rollout_manager.weights.agent_client`, :mod:`rollout_manager.weights.sync`) builds
requests and reads answers with these models; the agents validate requests and build answers with
them, so both ends agree on every field by construction. The manager imports this module, so it
must not import torch (nor the byte layer that does).

- sender ``GET /layout`` -> :class:`LayoutAnswer`
- sender ``POST /push`` :class:`PushRequest` -> :class:`PushAnswer`
- receiver ``POST /prepare`` :class:`PrepareRequest` -> :class:`PrepareAnswer`
- receiver ``POST /commit`` :class:`CommitRequest` -> :class:`CommitAnswer`
- receiver ``POST /activate`` :class:`ActivateRequest` -> :class:`ActivateAnswer` (load the staged version
  inside a short pause of generation; see :mod:`rollout_manager.weights.activation`)
- receiver ``GET /layout`` -> :class:`LayoutAnswer` (the verified version its buffer holds)
- receiver ``POST /serve`` :class:`ServeRequest` -> :class:`PushAnswer` (a peer bootstrap: the mirror of
  the sender's ``/push``, answering the trainer's checksums of that version)
- any refusal -> :class:`ErrorAnswer` with a 4xx/5xx status

Delta pushes (:mod:`rollout_manager.weights.delta`) add optional fields, None when unused, which the
manager leaves out of the bodies it sends: a full push's bodies are what they were before deltas.

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
PushMode = Literal["auto", "full", "delta"]  # as config.weight_push_mode
PUSH_MODES: tuple[str, ...] = get_args(PushMode)
# SGLang's PauseGenerationReqInput modes that keep the requests ("abort" would lose them).
PauseMode = Literal["retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)

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


class DeltaOffer(_Answer):
    """The sender can send the staged version as a delta of ``bytes`` bytes from ``base_version``."""

    base_version: Version
    bytes: NonNegInt


class LayoutAnswer(_Answer):
    """``GET /layout``: what the sender has staged. ``version`` is None while a restage is writing
    the buffer (the layout is then the previous one). ``GET /layout?delta_base=V`` adds ``delta`` when
    the sender still holds version V of the same layout (it encodes the delta then, once per version)."""

    version: Version | None
    layout: LayoutBody
    fingerprint: NonEmptyText
    delta: DeltaOffer | None = None


class PushRequest(_Request):
    """``POST /push``: write the staged ``version`` through group ``ip`` to one receiver's buffer."""

    version: Version
    ip: NonEmptyText
    num_engines: PosInt
    session_ids: Annotated[list[NonEmptyText], Field(min_length=1)]
    buffer_addr: NonNegInt
    transport: TransportName = "mooncake"
    # A delta push: write the delta from ``delta_base`` to the receiver's ``delta_addr`` instead.
    delta_base: Version | None = None
    delta_addr: NonNegInt | None = None
    # A repair: write only these shards (indices into the push's shards), in full.
    only_shards: list[NonNegInt] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PushRequest:
        if (self.delta_base is None) != (self.delta_addr is None):
            raise ValueError("delta_base and delta_addr go together")
        if self.delta_base is not None and self.only_shards is not None:
            raise ValueError("a push is a delta or a shard repair, not both")
        return self


class PushAnswer(_Answer):
    """``POST /push`` done: the bytes landed; ``shards``/``checksums`` go on to the receiver's commit."""

    version: Version
    bytes: NonNegInt
    seconds: NonNegFloat
    gbps: NonNegFloat
    shards: list[Shard]
    checksums: list[NonEmptyText]
    fingerprint: NonEmptyText
    delta_base: Version | None = None  # set when a delta was sent (``bytes`` is then its size)

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
    # The sender offers a delta of ``delta_bytes`` from ``delta_base``: take it if the buffer holds that.
    delta_base: Version | None = None
    delta_bytes: NonNegInt | None = None

    @model_validator(mode="after")
    def _paired(self) -> PrepareRequest:
        if (self.delta_base is None) != (self.delta_bytes is None):
            raise ValueError("delta_base and delta_bytes go together")
        return self


class PrepareAnswer(_Answer):
    """Where the sender writes: the receiver's session ids (one per engine) and buffer address.

    ``held_version``: the version the buffer holds, verified, for this layout (None: none, or it is about
    to be overwritten). ``delta_addr``: set when the offered delta was taken (the buffer holds its base):
    the sender writes the delta there."""

    session_ids: Annotated[list[NonEmptyText], Field(min_length=1)]
    buffer_addr: NonNegInt
    buffer_bytes: NonNegInt
    fingerprint: NonEmptyText
    held_version: Version | None = None
    delta_addr: NonNegInt | None = None


class CommitRequest(_Request):
    """``POST /commit``: verify every shard against its checksum, then load ``version`` into SGLang."""

    version: Version
    fingerprint: NonEmptyText
    shards: list[Shard]
    checksums: list[NonEmptyText]
    # A delta of ``delta_bytes`` from ``delta_base`` landed at the prepared ``delta_addr``: apply it first.
    delta_base: Version | None = None
    delta_bytes: NonNegInt | None = None
    # True: verify and hold the version staged beside the one SGLang serves; load it on ``/activate``.
    stage: Annotated[bool, Field(strict=True)] | None = None

    @model_validator(mode="after")
    def _paired(self) -> CommitRequest:
        _check_checksums(self.shards, self.checksums)
        if (self.delta_base is None) != (self.delta_bytes is None):
            raise ValueError("delta_base and delta_bytes go together")
        return self


class CommitAnswer(_Answer):
    """The version is verified and loaded."""

    ok: Annotated[bool, Field(strict=True)]
    version: Version
    verify_s: NonNegFloat
    load_s: NonNegFloat
    buckets: NonNegInt
    reloaded: NonNegInt | None = None  # tensors loaded into SGLang (only the changed ones after a delta)
    apply_s: NonNegFloat | None = None  # decoding and applying a delta
    readback: NonNegInt | None = None  # tensors read back from SGLang after the load and found equal
    staged: Annotated[bool, Field(strict=True)] | None = None  # verified and held, not loaded (``stage``)


class ActivateRequest(_Request):
    """``POST /activate``: load the staged ``version`` into SGLang inside a pause in ``mode``."""

    version: Version
    mode: PauseMode = "retract"


class ActivateAnswer(_Answer):
    """The staged version is loaded, recorded and served; ``paused_s``: how long generation was paused."""

    version: Version
    mode: PauseMode
    paused_s: NonNegFloat
    load_s: NonNegFloat
    buckets: NonNegInt
    reloaded: NonNegInt
    readback: NonNegInt


class ServeRequest(_Request):
    """``POST /serve`` on a peer's receiver: write the verified ``version`` its buffer holds (layout
    ``fingerprint``) into another receiver's prepared buffer, as the sender's ``/push`` does."""

    version: Version
    fingerprint: NonEmptyText
    num_engines: PosInt
    session_ids: Annotated[list[NonEmptyText], Field(min_length=1)]
    buffer_addr: NonNegInt
    transport: TransportName = "mooncake"


class ErrorAnswer(_Answer):
    """Any refusal or failure, with the HTTP status saying whose it is (see the agents)."""

    error: Text
    bad_shards: list[NonNegInt] | None = None  # a commit whose bytes did not verify: which shards


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
