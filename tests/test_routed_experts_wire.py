"""Routed experts (R3) on the wire: a final chunk's ``meta_info.routed_experts`` cut out of its bytes before the
chunk is parsed, checked in place, and spliced into the manager's answer as the engine sent it.

What must hold: the decoder gives exactly what a full parse gives (the same chunk, the same experts, the same
fault for a value that is not SGLang's base64), wherever the value stands in ``meta_info``, whatever escaped text
the chunk carries elsewhere, however the frame is split over reads; only the JSON parser's work changes.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from rollout_manager import jsonutil
from rollout_manager.rollout.progress import BadChunk, SequenceProgress
from rollout_manager.sglang import routed_experts as routed
from rollout_manager.sglang import sse
from rollout_manager.sglang.routed_experts import Base64Rows, RoutedExperts
from rollout_manager.sglang.sse import ChunkDecoder, FrameTooLarge, sse_frame
from rollout_manager.sglang.wire import GenerateChunk

ROW = 2 * 4 * 4  # 2 layers x top-4, int32
PROMPT, TOKENS = 2, 3
TRICKY = 'say "routed_experts":"QUJD" \\ \u00e9 \n'  # the key inside a string: escaped on the wire


def rows(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 256 for i in range(n * ROW))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


EXPERTS = b64(rows(200))  # 200 positions: 8,536 characters, past EXPERTS_CUT_FROM


def final(experts: Any, *, before: dict[str, Any] | None = None, after: dict[str, Any] | None = None,
          text: str | None = "hi") -> bytes:
    meta = {"id": "r", "finish_reason": {"type": "length", "length": TOKENS}, "prompt_tokens": PROMPT,
            "completion_tokens": TOKENS, **(before or {}), "routed_experts": experts, **(after or {})}
    return sse_frame({"text": text, "output_ids": [5, 6, 7], "meta_info": meta})


def full(frame: bytes) -> GenerateChunk:
    """What a full parse of the frame gives."""
    return GenerateChunk.of(jsonutil.loads(frame[len(b"data: "):-2]))


def decode(frame: bytes, step: int | None = None) -> GenerateChunk:
    dec = ChunkDecoder()
    step = step or len(frame)
    out = [c for at in range(0, len(frame), step) for c in dec.feed(frame[at:at + step])]
    assert len(out) == 1 and dec.pending == 0
    return out[0]


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of what the decoder hands the JSON parser."""
    seen: list[int] = []
    loads = jsonutil.loads

    def recording(data: Any) -> Any:
        seen.append(len(data))
        return loads(data)

    monkeypatch.setattr(sse.jsonutil, "loads", recording)
    return seen


@pytest.mark.parametrize("where", ["end", "middle", "first"])
def test_the_experts_are_cut_out_wherever_they_stand_in_meta_info(where: str, parsed: list[int]) -> None:
    around = {"note": TRICKY, "weight_version": "3", "cached_tokens": 0}
    before, after = {"end": (around, None), "middle": ({"note": TRICKY}, {"weight_version": "3"}),
                     "first": (None, around)}[where]
    frame = final(EXPERTS, before=before, after=after, text=TRICKY)
    chunk = decode(frame)
    assert parsed and max(parsed) < 1000  # the parser never saw the value
    assert chunk.meta.experts == Base64Rows(b'"' + EXPERTS.encode() + b'"') == full(frame).meta.experts
    assert chunk.meta.experts.size == 200 * ROW
    assert (chunk.ids, chunk.text, chunk.finish, chunk.meta.final) == \
        (full(frame).ids, TRICKY, full(frame).finish, full(frame).meta.final)


def test_a_frame_split_over_many_reads_is_joined_once_and_gives_the_same_chunk(parsed: list[int]) -> None:
    frame = final(EXPERTS, before={"note": TRICKY})
    whole = decode(frame)
    for step in (1, 5, 6, 7, 4096, len(frame) - 1, len(frame) - 2):  # the prefix and the boundary split too
        assert decode(frame, step) == whole
    key = frame.index(b'"routed_experts"')
    for cut in (key + 1, key + 17, key + 18, key + 19, frame.index(b'"', key + 19) + 1):  # in and around the key
        dec = ChunkDecoder()
        del parsed[:]
        assert dec.feed(frame[:cut]) + dec.feed(frame[cut:]) == [whole]
        assert max(parsed) < 1000  # cut out of the reads, or out of the joined bytes when the key was split


def test_a_truncated_frame_gives_nothing_until_its_end() -> None:
    frame = final(EXPERTS)
    cut = frame.index(b'"routed_experts"') + 2000  # in the middle of the value
    dec = ChunkDecoder()
    assert dec.feed(frame[:cut]) == [] and dec.feed(frame[cut:-1]) == [] and dec.pending == len(frame) - 1
    (chunk,) = dec.feed(frame[-1:])
    assert chunk.meta.experts == full(frame).meta.experts and dec.pending == 0
    bounded = ChunkDecoder(max_frame=len(frame) - 100)  # the bound counts the reads held
    with pytest.raises(FrameTooLarge, match="without a frame boundary"):
        bounded.feed(frame[:cut])
        bounded.feed(frame[cut:-1])


@pytest.mark.parametrize("bad", [
    "AB!D" * 3000,  # a character outside the alphabet
    "A=BC" * 3000,  # padding inside
    EXPERTS[:-1],  # not a whole number of quanta
    "AAA\u00e9" * 3000,  # not ASCII
])
def test_a_value_that_is_not_base64_is_the_same_fault_as_before(bad: str) -> None:
    frame = final(bad)
    chunk, whole = decode(frame), full(frame)
    assert chunk.fault is not None and chunk.fault == whole.fault and "routed_experts is not base64" in chunk.fault
    with pytest.raises(BadChunk, match="routed_experts is not base64"):
        SequenceProgress(experts=RoutedExperts(0), prompt=PROMPT).apply(chunk)


def test_an_escaped_value_or_a_key_twice_is_parsed_whole_as_before(parsed: list[int]) -> None:
    escaped = final("").replace(b'"routed_experts":""', b'"routed_experts":"' + EXPERTS.replace("/", "\\/").encode()
                                + b'"')
    assert b"\\/" in escaped
    assert decode(escaped).meta.experts == full(escaped).meta.experts == routed.checked(EXPERTS)
    twice = final(EXPERTS, before={"extra": {"routed_experts": "QUJD"}})
    assert decode(twice).meta.experts == full(twice).meta.experts == routed.checked(EXPERTS)
    assert max(parsed) > len(EXPERTS)  # both parsed whole: the decoder could not say which value is the chunk's
    wrong_type = final(list(range(3000)))
    assert decode(wrong_type).fault == full(wrong_type).fault == "routed_experts is list, not a base64 string"


def test_experts_on_a_chunk_that_is_not_final_are_ignored_as_before() -> None:
    frame = sse_frame({"text": "", "output_ids": [5], "meta_info": {
        "id": "r", "finish_reason": None, "completion_tokens": 1, "routed_experts": EXPERTS}})
    assert decode(frame).meta.experts is None is full(frame).meta.experts


def test_a_short_value_is_parsed_with_its_chunk_and_checked_alike(parsed: list[int]) -> None:
    short = b64(rows(TOKENS + PROMPT - 1))
    frame = final(short)
    assert len(frame) < sse.EXPERTS_CUT_FROM
    assert decode(frame).meta.experts == Base64Rows(b'"' + short.encode() + b'"')
    assert max(parsed) > len(short)


def test_base64_rows_are_checked_in_one_pass() -> None:
    for raw in (b"", b"a", b"ab", b"abc", rows(3)):
        quoted = b'"' + base64.b64encode(raw) + b'"'
        assert Base64Rows.of_json(quoted).size == len(raw)
        assert jsonutil.dumps({"x": Base64Rows.of_json(quoted).to_json()}) == jsonutil.dumps({"x": b64(raw)})
    for bad in (b'"QUJ"', b'"QU=D"', b'"Q==="', b'"QUJ\\"', b'"QUJ\xff"', b"QUJD", b'"'):
        with pytest.raises(ValueError, match="routed_experts is not base64"):
            Base64Rows.of_json(bad)
    escaped = b'{"a":"\\"routed_experts\\":\\"QUJD\\""}'
    assert routed.locate_in_reads([(escaped, 0, len(escaped))]) is None  # escaped: not a key
    unclosed = b'{"routed_experts":"QUJD'
    assert routed.locate_in_reads([(unclosed, 0, len(unclosed))]) is None


def test_parts_of_several_engines_are_joined_as_bytes_or_encoded_once() -> None:
    whole = rows(9)
    aligned = RoutedExperts(start=0)
    aligned.add(routed.checked(b64(whole[:3 * ROW])), seqlen=4)  # 96 bytes: whole base64 quanta
    aligned.add(whole[3 * ROW:], seqlen=10)  # raw rows handed in are encoded once
    assert aligned.to_json() == routed.checked(b64(whole)) and aligned.rows == whole
    ragged = RoutedExperts(start=0, row_bytes=0)
    ragged.add(routed.checked(b64(whole[:ROW])), seqlen=2)  # 32 bytes: not a multiple of 3
    ragged.add(routed.checked(b64(whole[ROW:])), seqlen=10)
    assert ragged.to_json() == routed.checked(b64(whole))
    assert RoutedExperts(start=4).to_json() == routed.EMPTY
    assert jsonutil.loads(jsonutil.dumps({"e": aligned.to_json().to_json()})) == {"e": b64(whole)}


def test_the_value_is_found_across_reads_or_given_up_on_when_its_key_is_split() -> None:
    frame = b'{"a":[1,2],"meta_info":{"routed_experts":"QUJDRA==","x":"y"}}'
    start = frame.index(b'"QUJD')
    for cuts in ([], [start + 3], [start + 1, start + 6], [2, start + 2, start + 10]):  # reads around the value
        bounds = [0, *cuts, len(frame)]
        spans = [(frame[a:b], 0, b - a) for a, b in zip(bounds, bounds[1:])]
        before, value, after = routed.locate_in_reads(spans) or ([], [], [])
        assert b"".join(buf[a:b] for buf, a, b in value) == b'"QUJDRA=="'
        assert b"".join(buf[a:b] for buf, a, b in before + after) == frame.replace(b"QUJDRA==", b"")
    key = frame.index(b'"routed_experts"')
    split = [(frame[:key + 5], 0, key + 5), (frame[key + 5:], 0, len(frame) - key - 5)]
    assert routed.locate_in_reads(split) is None  # the key split over two reads: joined and looked at again
    twice = [(frame, 0, len(frame)), (frame, 0, len(frame))]
    assert routed.locate_in_reads(twice) is None
