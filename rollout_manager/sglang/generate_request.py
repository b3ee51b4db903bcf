"""SGLang's ``/generate`` request as the manager holds it: one typed body per sequence.

A caller's body is decoded once, at the door, by msgspec into :class:`GenerateFields` (SGLang's fields
the manager checks; ``rollout.request`` adds the manager's own), whose values become :class:`SequenceBody`
values (:func:`split`: a batch becomes one per item, split as SGLang splits it); it is turned back into
JSON once, for the engine (:func:`encode`, :func:`encode_batch`). In between the rollout flow reads
attributes, never SGLang's keys: only this module spells them. The fields the manager reads or rewrites
are typed; every other field goes to the engine as the caller sent it (``rest``, at the top level and
inside ``sampling_params``), so what an engine receives means what the caller asked, plus the manager's
changes (seed, budget, interval, rid).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Annotated, Any, Generic, NamedTuple, TypeVar, cast

import msgspec

from rollout_manager import jsonutil
from rollout_manager.sglang.wire import DEFAULT_MAX_NEW_TOKENS, PER_ITEM_LIST_KEYS, per_item

_NONE: dict[str, Any] = {}  # the shared ``rest`` of a body with no other fields (never written to)
_SAMPLING_KEYS = frozenset({"max_new_tokens", "min_new_tokens", "sampling_seed", "stream_interval"})
# sampling_params and body fields whose effect (or answer) is one engine request's own, not a sequence's
# continued over several requests (Sampling.divisible, SequenceBody.divisible).
_PER_REQUEST_SAMPLING = ("stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "custom_params")
_PER_REQUEST_BODY = ("custom_logit_processor", "session_id", "session_params", "input_embeds", "image_data",
                     "video_data", "audio_data", "return_hidden_states", "return_indexer_topk", "return_entropy",
                     "max_thinking_tokens", "watermark", "positional_embed_overrides")

# ------------------------------------------------------------------ the body as a caller sends it (the schema)

Count = Annotated[int, msgspec.Meta(ge=0)]
TokenIds = Annotated[list[Count], msgspec.Meta(min_length=1)]  # one sequence's prompt
BatchIds = Annotated[list[TokenIds], msgspec.Meta(min_length=1)]  # a batch's prompts
Ids = TypeVar("Ids")


class SamplingFields(msgspec.Struct, kw_only=True):
    """``sampling_params``: the fields the manager reads, checked; SGLang's others pass through as sent."""

    max_new_tokens: Count | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: Count | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    sampling_seed: Any = None
    stream_interval: Any = None


class GenerateFields(msgspec.Struct, Generic[Ids], kw_only=True):
    """An SGLang ``/generate`` body. ``input_ids`` is required: continuation works on tokens, so the
    trainer tokenizes (verl always does). A list of prompts is a batch, whose per-item fields may be
    lists (one value per prompt); other SGLang fields pass through unchanged."""

    input_ids: Ids
    sampling_params: SamplingFields | list[SamplingFields] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # Routed-expert replay (R3): one value for the whole body, a batch included, as SGLang takes them.
    return_routed_experts: bool = False
    routed_experts_start_len: Count = 0


def is_batch(ids: Any) -> bool:
    """``[1, 2]`` is one sequence, ``[[1, 2], [3]]`` a batch: the first item says which."""
    return type(ids) is list and bool(ids) and type(ids[0]) is list


class Sampling(msgspec.Struct, frozen=True, gc=False):
    """A sequence's ``sampling_params``: what the manager reads or rewrites, and the rest as sent."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: no limit (the engine stops at its context)
    min_new_tokens: int | None = None  # None: not given
    sampling_seed: Any = None  # None: not given (the rollout flow gives each sequence one)
    stream_interval: Any = None  # the caller's; None: not given
    rest: dict[str, Any] = _NONE

    @property
    def output_penalties(self) -> bool:
        """Whether a penalty that SGLang counts over output tokens only is on (frequency, presence, repetition):
        a continuation, whose earlier output is prompt to the next engine, then samples differently."""
        get = self.rest.get
        return bool(get("frequency_penalty") or get("presence_penalty")) or get("repetition_penalty") not in (1, None)

    @property
    def divisible(self) -> bool:
        """Whether a sequence sampled with these may be generated in pieces, each continued exactly from the
        tokens before it: not under an output-only penalty (:attr:`output_penalties`), nor a stop string or
        regex (SGLang matches them on one request's output: one across a piece boundary would be missed), a
        grammar (it would restart at each piece), a custom logit processor's parameters (its state is the
        request's), or parallel sampling."""
        get = self.rest.get
        return not (self.output_penalties or self.parallel or any(get(k) for k in _PER_REQUEST_SAMPLING))

    @property
    def parallel(self) -> bool:
        """Whether SGLang expands this into several samples (``n`` > 1), per batch rather than per item."""
        return bool(self.rest.get("n", 1) != 1)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.rest)
        out["max_new_tokens"] = self.max_new_tokens
        if self.min_new_tokens is not None:
            out["min_new_tokens"] = self.min_new_tokens
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        if self.stream_interval is not None:
            out["stream_interval"] = self.stream_interval
        return out


_DEFAULT_SAMPLING = Sampling()
_BODY_KEYS = frozenset(GenerateFields.__struct_fields__)


class KnownIds(NamedTuple):
    """What a caller already knows of a prompt's ids, so the rollout path does not pass over them all again:
    a chat session's ledger keeps these turn to turn and works out only the new ids' part."""

    ids: list[int]  # the list they were made for: valid only while a body's ``input_ids`` is that very list
    max_id: int  # max(ids), -1 for none
    block: int  # the affinity block size ``hashes`` were cut by (0: none made)
    hashes: Sequence[int]  # ``placement.affinity.block_hashes(ids, block)``


class SequenceBody(msgspec.Struct, frozen=True, gc=False):
    """One sequence's ``/generate`` body (a caller's, or one the manager sends an engine)."""

    input_ids: list[int]
    sampling: Sampling = _DEFAULT_SAMPLING
    rid: str | None = None  # None: not given (the rollout flow names the sequence)
    stream: bool = False
    return_logprob: bool | None = None  # None: not given
    rest: dict[str, Any] = _NONE  # every other field, passed through as sent
    # R3: whether the engine returns the experts each token was routed to (``return_routed_experts``), and
    # from which position (``routed_experts_start_len``; a continuation asks only for the rows it lacks).
    routed_experts: bool = False
    experts_from: int = 0
    # ``input_ids`` already encoded by a caller that sends the same ids elsewhere too (a chat turn's answer
    # returns its prompt): (that list, its JSON), used by :func:`encode` only while ``input_ids`` is that very
    # list (a continuation's body has a list of its own)
    ids_json: tuple[list[int], bytes] | None = None
    known_ids: KnownIds | None = None  # what the caller knows of ``input_ids`` (:meth:`known`)

    def known(self) -> KnownIds | None:
        """The caller's :class:`KnownIds` while ``input_ids`` is the list they were made for (a
        continuation's body has a list of its own), else None."""
        k = self.known_ids
        return k if k is not None and k.ids is self.input_ids else None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.return_logprob)

    @property
    def divisible(self) -> bool:
        """Whether this sequence may be generated in pieces with no change to its tokens or its answer: its
        sampling allows it (:attr:`Sampling.divisible`), it has a budget (without one SGLang refuses a piece
        that would pass the context, where the whole request stops there), it asks for no prompt log-probs
        (``logprob_start_len``: a later piece's prompt holds the earlier pieces' tokens), and no field makes
        it one request's (a session, multimodal or embedded input, hidden states, a thinking budget, ...)."""
        get = self.rest.get
        start = get("logprob_start_len")
        return (self.sampling.divisible and self.sampling.max_new_tokens is not None
                and not any(get(k) for k in _PER_REQUEST_BODY)
                and not (self.return_logprob and isinstance(start, int) and start >= 0))

    @classmethod
    def of(cls, data: dict[str, Any]) -> SequenceBody:
        """A single-sequence body as typed (see :func:`sequences`)."""
        (body,), _ = sequences(data)
        return body

    def to_json(self) -> dict[str, Any]:
        out = dict(self.rest)
        out["input_ids"] = self.input_ids
        out["sampling_params"] = self.sampling.to_json()
        out["stream"] = self.stream
        if self.rid is not None:
            out["rid"] = self.rid
        if self.return_logprob is not None:
            out["return_logprob"] = self.return_logprob
        if self.routed_experts:
            out["return_routed_experts"] = True
            out["routed_experts_start_len"] = self.experts_from
        return out


def sequences(data: dict[str, Any]) -> tuple[list[SequenceBody], bool]:
    """An SGLang ``/generate`` body (decoded JSON, valid) -> one body per sequence, and whether it was a
    batch (see :func:`split`); raises ``msgspec.ValidationError`` for an invalid one."""
    typ = GenerateFields[BatchIds] if is_batch(data.get("input_ids")) else GenerateFields[TokenIds]
    return split(msgspec.convert(data, typ, strict=True), data)


def split(body: GenerateFields[Any], data: dict[str, Any], known: Collection[str] = ()) -> tuple[
        list[SequenceBody], bool]:
    """A decoded body (and the JSON it was decoded from, for the fields passed through) -> one body per
    sequence, and whether it was a batch.

    ``known`` names the fields of ``body``'s type, which are not passed through (the manager's own
    among them). A batch is split as SGLang splits it: per-item lists give each item its own value, a
    single string ``rid`` names item ``i`` ``f"{rid}_{i}"``, and every other field applies to every item.
    """
    rest = {k: v for k, v in data.items() if k not in known and k not in _BODY_KEYS} or _NONE
    ids, params, rid, logprob = body.input_ids, body.sampling_params, body.rid, body.return_logprob
    experts, experts_from = body.return_routed_experts, body.routed_experts_start_len
    raw_params: Any = data.get("sampling_params")
    if not is_batch(ids):  # its per-item fields are single values (the caller's decode checked)
        return [SequenceBody(ids, _sampling(params, raw_params), cast("str | None", rid), body.stream,
                             cast("bool | None", logprob), rest, experts, experts_from)], False
    items = params if isinstance(params, list) else None
    shared = _sampling(params, raw_params) if items is None else _DEFAULT_SAMPLING
    lists = [k for k in PER_ITEM_LIST_KEYS if k in rest and per_item(k, rest[k])]  # SGLang's other per-item fields
    return [SequenceBody(
        item, shared if items is None else _sampling(items[i], raw_params[i]),
        rid[i] if isinstance(rid, list) else (None if rid is None else f"{rid}_{i}"), body.stream,
        logprob[i] if isinstance(logprob, list) else logprob,
        {**rest, **{k: rest[k][i] for k in lists}} if lists else rest, experts, experts_from)
        for i, item in enumerate(ids)], True


def _sampling(params: Any, raw: Any) -> Sampling:
    """Decoded ``sampling_params`` (and their JSON, for the fields passed through) as a sequence's."""
    if not raw:
        return _DEFAULT_SAMPLING
    rest = {k: v for k, v in raw.items() if k not in _SAMPLING_KEYS}
    return Sampling(params.max_new_tokens, params.min_new_tokens, params.sampling_seed, params.stream_interval,
                    rest or _NONE)


def continuation(body: SequenceBody, made: Sequence[int], *, rid: str, stream_interval: int | None = None,
                 keep_caller_interval: bool = False, stream: bool = True, seed: Any = None,
                 experts_from: int | None = None, piece: int | None = None) -> SequenceBody:
    """The body that continues a single sequence on an engine from the tokens already made.

    ``input_ids`` grows by ``made`` and ``max_new_tokens`` shrinks by ``len(made)``, never past the
    original budget, so the context never overflows and no token is produced twice. A null
    ``max_new_tokens`` (no limit) stays null: SGLang then stops where the context ends, which is the
    same place for the continued request as for the original one.

    ``stream_interval`` (when given) becomes ``sampling_params.stream_interval``, which SGLang 0.5.23
    uses before its server-wide ``--stream-interval``: the engine then sends a chunk every that many
    tokens, so the manager parses that many times fewer frames. ``keep_caller_interval`` leaves a
    caller's own value in place (a streaming caller chose how often it wants chunks). With
    ``stream=False`` the engine answers once, at the end (no interval is set). ``seed`` (when given)
    becomes ``sampling_params.sampling_seed``. ``experts_from`` (when given) becomes
    ``routed_experts_start_len``: the first position whose routed experts the sequence does not hold yet.
    ``piece`` (when given) caps ``max_new_tokens`` further: the request is one piece of a divided sequence
    (``rollout.pieces``), and ``min_new_tokens`` is capped with it (SGLang refuses a minimum above the
    maximum; every position of the piece is below either way, so the end-of-sequence ban is the same).
    """
    s = body.sampling
    n = len(made)
    interval = s.stream_interval
    if stream and stream_interval is not None and not (keep_caller_interval and interval is not None):
        interval = int(stream_interval)
    most = None if s.max_new_tokens is None else max(s.max_new_tokens - n, 0)
    least = None if s.min_new_tokens is None else max(s.min_new_tokens - n, 0)
    if piece is not None:
        most = piece if most is None else min(most, piece)
        least = None if least is None else min(least, most)
    sampling = msgspec.structs.replace(
        s, max_new_tokens=most, min_new_tokens=least, stream_interval=interval,
        sampling_seed=s.sampling_seed if seed is None else seed)
    return msgspec.structs.replace(body, input_ids=[*body.input_ids, *made] if n else body.input_ids,
                                   sampling=sampling, rid=rid, stream=stream,
                                   experts_from=body.experts_from if experts_from is None else experts_from)


def encode(body: SequenceBody | Sequence[SequenceBody]) -> bytes:
    """The JSON an engine is sent: for one sequence, or for several as one batch (:func:`encode_batch`)."""
    if not isinstance(body, SequenceBody):
        return encode_batch(body)
    out = body.to_json()
    if body.ids_json is not None and body.ids_json[0] is body.input_ids:
        out["input_ids"] = jsonutil.fragment(body.ids_json[1])
    return jsonutil.dumps(out)


def joinable(body: SequenceBody) -> bool:
    """Whether a non-streaming engine body may join a batch (:func:`encode`): SGLang expands
    ``n`` > 1 (parallel sampling) per batch, not per item, so such a body goes alone."""
    return not body.stream and not body.sampling.parallel and body.rid is not None


def join_key(body: SequenceBody) -> tuple[Any, ...]:
    """What bodies must share to join one batch: everything but ``input_ids``, ``sampling_params``
    and ``rid`` (which SGLang takes as one value per item; the routed-expert fields it takes once)."""
    return (body.stream, body.return_logprob, body.rest, body.routed_experts, body.experts_from)


def encode_batch(bodies: Sequence[SequenceBody]) -> bytes:
    """One batched ``/generate`` body for bodies with the same :func:`join_key`: ``input_ids``,
    ``sampling_params`` and ``rid`` become per-item lists (the inverse of :func:`sequences`)."""
    out = bodies[0].to_json()
    out["input_ids"] = [b.input_ids for b in bodies]
    out["sampling_params"] = [b.sampling.to_json() for b in bodies]
    out["rid"] = [b.rid for b in bodies]
    return jsonutil.dumps(out)
