"""Unit tests of the weight buffer layout, shard split and checksums (no network)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rollout_manager.weights import (
    HostBuffer,
    WeightLayout,
    build_layout,
    checksum,
    shard_checksums,
    split_shards,
    stage,
    unpack,
    verify,
    verify_shards,
)
from rollout_manager.weights.shards import available_algorithms


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor as a flat uint8 tensor (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    nan_payloads = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000], dtype=torch.int64)
    return {
        "embed.weight": torch.randn(50, 33, generator=g).to(torch.bfloat16),
        "layer.0.fp16": torch.randn(7, 5, 3, generator=g).to(torch.float16),
        "layer.0.fp32": base,
        "layer.0.transposed": base.t(),                       # non-contiguous
        "layer.0.strided": base[::3, 1::2],                   # non-contiguous, offset storage
        "layer.0.bf16_t": torch.randn(9, 4, generator=g).to(torch.bfloat16).t(),
        "ids": torch.arange(-5, 12, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "small_int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "fp64": torch.randn(3, 3, generator=g, dtype=torch.float64),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "nan_bits": nan_payloads.to(torch.int32).view(torch.float32),   # NaNs with payloads, -0.0
        "expanded": torch.randn(1, 6, generator=g).expand(4, 6),         # stride 0
    }


def test_roundtrip_is_bit_exact_across_dtypes_and_strides():
    sd = _state_dict()
    layout = build_layout(sd)
    buf = HostBuffer.for_layout(layout)
    assert buf.fits(layout) and not buf.pinned  # no CUDA here
    staged = stage(sd, layout, buf)
    assert staged == sum(t.numel() * t.element_size() for t in sd.values())
    out = unpack(buf, layout)
    assert [n for n, _ in out] == list(sd)
    for name, t in out:
        src = sd[name]
        assert t.dtype == src.dtype and t.shape == src.shape, name
        assert torch.equal(_bits(t), _bits(src)), name
        assert t.is_contiguous()


def test_unpack_views_alias_the_buffer_and_copy_does_not():
    sd = {"w": torch.arange(16, dtype=torch.float32).to(torch.bfloat16)}
    layout = build_layout(sd)
    buf = HostBuffer.for_layout(layout)
    stage(sd, layout, buf)
    (_, view), = unpack(buf, layout)
    (_, copied), = unpack(buf, layout, copy=True)
    assert view.data_ptr() == buf.addr + layout["w"].offset
    buf.array[:] = 0
    assert float(view.float().sum()) == 0.0
    assert torch.equal(copied.float(), torch.arange(16, dtype=torch.float32))


def test_offsets_are_aligned_and_total_is_padded():
    sd = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(5, dtype=torch.bfloat16),
          "c": torch.zeros(300, dtype=torch.float32)}
    layout = build_layout(sd, alignment=256)
    assert [s.offset for s in layout] == [0, 256, 512]
    assert layout.total_bytes == 512 + 1200 + (256 - 1200 % 256)
    assert all(s.offset % 256 == 0 for s in layout)


def test_stage_into_numpy_bytearray_and_reused_buffer():
    sd = _state_dict()
    layout = build_layout(sd)
    for target in (np.zeros(layout.total_bytes, np.uint8), bytearray(layout.total_bytes)):
        stage(sd, layout, target)
        for name, t in unpack(target, layout):
            assert torch.equal(_bits(t), _bits(sd[name])), name
    # Reuse one buffer for the next "step": same layout, new values.
    buf = HostBuffer.for_layout(layout)
    addr = buf.addr
    stage(sd, layout, buf)
    sd2 = {k: (v + 1 if v.dtype not in (torch.bool,) else ~v) for k, v in sd.items()}
    stage(sd2, layout, buf)
    assert buf.addr == addr
    for name, t in unpack(buf, layout):
        assert torch.equal(_bits(t), _bits(sd2[name])), name


def test_stage_rejects_mismatches():
    sd = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    layout = build_layout(sd)
    buf = HostBuffer.for_layout(layout)
    with pytest.raises(ValueError):
        stage({"w": torch.zeros(4, 4, dtype=torch.float16), "b": torch.zeros(4)}, layout, buf)
    with pytest.raises(ValueError):
        stage({"w": torch.zeros(4, 5), "b": torch.zeros(4)}, layout, buf)
    with pytest.raises(KeyError):
        stage({"w": torch.zeros(4, 4)}, layout, buf)
    with pytest.raises(KeyError):
        stage({**sd, "extra": torch.zeros(1)}, layout, buf)
    stage({**sd, "extra": torch.zeros(1)}, layout, buf, strict=False)
    with pytest.raises(ValueError):
        stage(sd, layout, HostBuffer(layout.total_bytes - 1))


def test_layout_json_roundtrip_and_fingerprint():
    sd = _state_dict()
    layout = build_layout(sd)
    text = layout.to_json()
    again = WeightLayout.from_json(text)
    assert again == layout
    assert again.fingerprint() == layout.fingerprint()
    assert WeightLayout.from_json(json.loads(text)) == layout
    assert [s.shape for s in again] == [tuple(t.shape) for t in sd.values()]
    assert again["embed.weight"].dtype == "bfloat16"
    # Stable across processes/runs: depends only on the content.
    assert build_layout(_state_dict()).fingerprint() == layout.fingerprint()
    # Any change to a name, dtype, shape or alignment changes it.
    changed = dict(sd)
    changed["ids"] = torch.arange(-5, 13, dtype=torch.int64)
    assert build_layout(changed).fingerprint() != layout.fingerprint()
    assert build_layout(sd, alignment=512).fingerprint() != layout.fingerprint()
    with pytest.raises(ValueError):
        WeightLayout.from_json(text.replace('"format":1', '"format":99'))


def test_layout_validation():
    with pytest.raises(ValueError):  # overlapping
        WeightLayout.from_dict({"alignment": 256, "total_bytes": 1024, "tensors": [
            {"name": "a", "dtype": "float32", "shape": [100], "offset": 0, "nbytes": 400},
            {"name": "b", "dtype": "float32", "shape": [1], "offset": 256, "nbytes": 4}]})
    with pytest.raises(ValueError):  # wrong nbytes
        WeightLayout.from_dict({"alignment": 256, "total_bytes": 1024, "tensors": [
            {"name": "a", "dtype": "bfloat16", "shape": [10], "offset": 0, "nbytes": 40}]})
    with pytest.raises(ValueError):  # unknown dtype
        WeightLayout.from_dict({"alignment": 256, "total_bytes": 1024, "tensors": [
            {"name": "a", "dtype": "float99", "shape": [1], "offset": 0, "nbytes": 4}]})


def test_empty_state_dict():
    layout = build_layout({})
    assert layout.total_bytes == 0 and len(layout) == 0
    buf = HostBuffer.for_layout(layout)
    assert stage({}, layout, buf) == 0 and unpack(buf, layout) == []
    assert split_shards(layout.total_bytes, 4) == []


# -- shards ---------------------------------------------------------------------------------------
def _check_cover(shards, total, align):
    assert sum(n for _, n in shards) == total
    pos = 0
    for off, n in shards:
        assert off == pos and n > 0 and off % align == 0
        pos += n
    assert pos == total


@pytest.mark.parametrize("total,n,align", [
    (1 << 20, 4, 256), (1 << 20, 1, 256), (1000, 3, 256), (1000, 7, 1), (10_000_001, 8, 4096),
    (257, 2, 256), (255, 4, 256), (1, 16, 256), (4096 * 5 + 3, 4, 4096), (7, 7, 1), (7, 100, 1),
])
def test_split_shards_cover_aligned_and_nonempty(total, n, align):
    shards = split_shards(total, n, align)
    _check_cover(shards, total, align)
    assert len(shards) == min(n, -(-total // align))


def test_split_shards_edge_cases():
    assert split_shards(0, 4) == []
    assert split_shards(100, 1, 256) == [(0, 100)]
    assert split_shards(1 << 20, 1) == [(0, 1 << 20)]
    # n larger than the number of aligned units: fewer, non-empty shards.
    assert split_shards(600, 8, 256) == [(0, 256), (256, 256), (512, 88)]
    assert split_shards(3, 10, 1) == [(0, 1), (1, 1), (2, 1)]
    # uneven: sizes differ by at most one aligned unit
    shards = split_shards(10 * 256, 3, 256)
    assert [n for _, n in shards] == [4 * 256, 3 * 256, 3 * 256]
    with pytest.raises(ValueError):
        split_shards(100, 0)
    with pytest.raises(ValueError):
        split_shards(-1, 2)


# -- checksums ------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", available_algorithms())
def test_checksum_detects_a_flipped_byte(algo):
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    ref = checksum(data, algo)
    assert ref.startswith(algo + ":")
    assert checksum(memoryview(data), algo) == ref == checksum(data.tobytes(), algo)
    for pos in (0, 12345, len(data) - 1):
        flipped = data.copy()
        flipped[pos] ^= 0x01
        assert checksum(flipped, algo) != ref
        assert not verify(flipped, ref)
    assert verify(data, ref)


def test_default_checksum_is_xxhash_when_installed():
    pytest.importorskip("xxhash")
    assert checksum(b"abc").startswith("xxh3_64:")


def test_shard_checksums_and_verify_shards():
    data = np.random.default_rng(2).integers(0, 256, 3 * 1024 * 1024 + 17, dtype=np.uint8)
    shards = split_shards(len(data), 5, 256)
    sums = shard_checksums(data, shards)
    assert sums == [checksum(memoryview(data)[o:o + n]) for o, n in shards]
    assert verify_shards(data, shards, sums) == []
    data[shards[3][0] + 5] ^= 0xFF
    assert verify_shards(data, shards, sums) == [3]
    assert verify_shards(data, shards, sums, max_workers=1) == [3]
    with pytest.raises(ValueError):
        verify_shards(data, shards, sums[:-1])


def _streamed(agent, items, check_in_place: bool):
    """Yield ``items``; before each next one, check the previous one already sits in its slot."""
    prev = None
    for name, tensor in items:
        assert agent.version is None  # nothing in the buffer counts as a version while it is rewritten
        if check_in_place and prev is not None:
            spec = agent.layout[prev[0]]
            got = agent.buffer.tensor[spec.offset: spec.offset + spec.nbytes]
            assert torch.equal(got, _bits(prev[1]))
        prev = (name, tensor)
        yield name, tensor


def test_sender_stages_a_stream_in_place_and_relays_when_the_model_changes():
    from rollout_manager.weights.sender_agent import SenderAgent

    agent = SenderAgent(["127.0.0.1"], 0)  # staging only: no control API, no engines
    sd = _state_dict()
    layout = agent.stage_stream(_streamed(agent, sd.items(), False), 1)  # first version: laid out anew
    assert agent.version == 1 and layout.names == list(sd)
    buffer = agent.buffer

    sd2 = {k: (v + 1 if v.is_floating_point() else v) for k, v in sd.items()}
    assert agent.stage_stream(_streamed(agent, sd2.items(), True), 2) == layout  # each tensor lands as it comes
    assert agent.buffer is buffer and agent.version == 2
    for name, t in unpack(agent.buffer, agent.layout):
        assert torch.equal(_bits(t), _bits(sd2[name])), name

    # a shape change half-way: what was already written is kept, the rest re-laid around the change
    sd3 = dict(sd2)
    sd3["layer.0.fp32"] = torch.randn(80, 48)
    layout3 = agent.stage_stream(iter(sd3.items()), 3)
    assert layout3 != layout and agent.version == 3
    for name, t in unpack(agent.buffer, agent.layout):
        assert torch.equal(_bits(t), _bits(sd3[name])), name

    # fewer tensors than last time: the layout shrinks to them
    fewer = {k: sd3[k] for k in list(sd3)[:4]}
    assert agent.stage_stream(iter(fewer.items()), 4).names == list(fewer)
    for name, t in unpack(agent.buffer, agent.layout):
        assert torch.equal(_bits(t), _bits(fewer[name])), name
