"""Exact sparse delta pushes: the codec in process, then manager -> sender -> receivers -> CPU engines."""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np
import pytest
import torch
from weight_fleet import engine_checksums, expected_checksums, weight_fleet
from weight_fleet import publish as publish_weights

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.weights import delta
from rollout_manager.weights.layout import HostBuffer, build_layout, stage

FP = hashlib.sha256(b"layout").hexdigest()


# ---------------------------------------------------------------- the codec


def _flip(words: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A copy with ``fraction`` of the 16-bit words nudged by one unit in the last place, as a small
    optimizer step does to bf16 values."""
    rng = np.random.default_rng(seed)
    out = words.copy()
    idx = rng.choice(len(words), int(len(words) * fraction), replace=False)
    out[idx] += 1
    return out


def test_a_delta_rebuilds_the_new_bytes_exactly_and_is_small_when_few_values_change() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, 3_000_000, dtype=np.uint16)
    new = _flip(base, 0.02, 1)
    new[-1000:] = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)  # the unaligned tail block changes too
    blob = delta.encode(base.view(np.uint8), new.view(np.uint8), base_version=4, version=5, fingerprint=FP,
                        block_bytes=1 << 20)
    assert len(blob) * 10 < new.nbytes
    got = base.copy()
    applied = delta.apply(blob, got.view(np.uint8), fingerprint=FP, base_version=4)
    assert np.array_equal(got, new) and not applied.failed_blocks
    assert applied.changed_words == int((base != new).sum())


def test_dense_changes_fall_back_to_raw_blocks_and_equal_buffers_give_an_empty_delta() -> None:
    rng = np.random.default_rng(2)
    base = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    new = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    blob = delta.encode(base.view(np.uint8), new.view(np.uint8), base_version=0, version=1, fingerprint=FP)
    header = delta.read_header(blob)
    assert set(header.kinds) == {delta.RAW} and len(blob) < new.nbytes + 200
    got = base.copy()
    delta.apply(blob, got.view(np.uint8), fingerprint=FP, base_version=0)
    assert np.array_equal(got, new)
    same = delta.encode(base.view(np.uint8), base.view(np.uint8), base_version=0, version=1, fingerprint=FP)
    assert set(delta.read_header(same).kinds) == {delta.SAME} and len(same) < 200


def test_a_delta_for_another_base_or_layout_changes_nothing_and_a_mangled_block_is_left_alone() -> None:
    base = np.zeros(1 << 20, dtype=np.uint16)
    new = _flip(base, 0.05, 3)
    blob = bytearray(delta.encode(base.view(np.uint8), new.view(np.uint8), base_version=1, version=2,
                                  fingerprint=FP, block_bytes=1 << 19))
    got = base.copy()
    for kwargs in ({"fingerprint": FP, "base_version": 0}, {"fingerprint": "00" * 32, "base_version": 1}):
        with pytest.raises(delta.DeltaError):
            delta.apply(bytes(blob), got.view(np.uint8), **kwargs)  # type: ignore[arg-type]
        assert not got.any()
    blob[-5] ^= 0xFF  # inside the last block's payload
    applied = delta.apply(bytes(blob), got.view(np.uint8), fingerprint=FP, base_version=1)
    assert applied.failed_blocks == [3] or not np.array_equal(got, new)  # never silently "right"


def test_touched_tensors_are_the_ones_holding_a_changed_word() -> None:
    state = {"a": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(1000, dtype=torch.bfloat16),
             "c": torch.zeros(10, dtype=torch.float32)}
    layout = build_layout(state)
    before, after = HostBuffer.for_layout(layout, pin=False), HostBuffer.for_layout(layout, pin=False)
    stage(state, layout, before)
    state["b"][7] = 1.0
    stage(state, layout, after)
    blob = delta.encode(before.array, after.array, base_version=0, version=1, fingerprint=FP)
    applied = delta.apply(blob, before.array, fingerprint=FP, base_version=0)
    specs = layout.specs
    hit = delta.touched_tensors([s.offset for s in specs], [s.offset + s.nbytes for s in specs], applied)
    assert {specs[i].name for i in hit} == {"b"}
    assert np.array_equal(before.array, after.array)


# ---------------------------------------------------------------- end to end, through the manager

MODEL = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2}  # 17 MB in bf16: 5 blocks
CHANGED = ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]


def weights(step: int) -> dict[str, torch.Tensor]:
    """Step 1: a model in bf16; each later step nudges 2% of the values of the CHANGED tensors."""
    out = {n: t.to(torch.bfloat16).contiguous() for n, t in build_model(7, **MODEL).state_dict().items()}
    for s in range(2, step + 1):
        for i, name in enumerate(CHANGED):
            bits = out[name].view(torch.int16).reshape(-1).numpy()
            out[name] = torch.from_numpy(_flip(bits.view(np.uint16), 0.02, 10 * s + i).view(np.int16)).view(
                torch.bfloat16).reshape(out[name].shape)
    return out


publish = partial(publish_weights, make=weights)


def pushes_of(st: dict, version: int) -> dict[str, dict]:
    return {p["endpoint"]: p for p in st["recent_weight_pushes"] if p["version"] == version}


@pytest.fixture
async def fleet(start_manager, tmp_path, request):
    transport, mode, *below = request.param  # below: auto's link threshold in GB/s (default: every link)
    async with weight_fleet(start_manager, tmp_path, MODEL, transport, weight_push_mode=mode,
                            weight_delta_below_gbps=str(below[0] if below else 1e6)) as f:
        yield f


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", "auto"), ("mooncake", "delta")], indirect=True)
async def test_delta_pushes_are_bit_exact_reload_only_changed_tensors_and_repair_a_corrupt_delta(fleet) -> None:
    m, sender, add_box = fleet
    good, corrupt = await add_box(), await add_box("--fault-corrupt-delta")
    ws = await publish(m, sender, 1)  # the first version: nothing to diff against, a full push
    first = pushes_of(await m.status(), 1)
    total = sender.layout.total_bytes
    assert {p["mode"] for p in first.values()} == {"full"} and {p["bytes"] for p in first.values()} == {total}
    for step in (2, 3):
        ws = await publish(m, sender, step)
        for box in (good, corrupt):
            assert await engine_checksums(box.url) == expected_checksums(ws)  # bit-exact, repaired one included
        got = pushes_of(await m.status(), step)
        assert got[good.endpoint]["mode"] == "delta" and got[good.endpoint]["bytes"] * 10 < total
        assert got[good.endpoint]["reloaded"] == len(CHANGED)  # only the changed tensors went to the engine
        assert got[corrupt.endpoint]["mode"] == "delta+repair"  # caught by the checksums, shard resent in full
        assert got[corrupt.endpoint]["bytes"] < total  # one shard of four, plus the delta
    # A box that joins now holds version 0, three versions behind: it gets the full bytes.
    late = await add_box()
    assert await engine_checksums(late.url) == expected_checksums(ws)
    boot = pushes_of(await m.status(), 3)[late.endpoint]
    assert boot["mode"] == "full" and boot["bytes"] == total


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", "auto", 1e-9)], indirect=True)
async def test_auto_mode_pushes_full_bytes_over_a_link_faster_than_a_delta_pays_for(fleet) -> None:
    """Every link here is 'fast' (threshold 1 byte/s): a delta would cost more to encode and apply than
    the bytes it saves, so auto never asks the sender for one."""
    m, sender, add_box = fleet
    box = await add_box()
    for step in (1, 2, 3):
        ws = await publish(m, sender, step)
        assert await engine_checksums(box.url) == expected_checksums(ws)
        push = pushes_of(await m.status(), step)[box.endpoint]
        assert push["mode"] == "full" and push["bytes"] == sender.layout.total_bytes


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", "full")], indirect=True)
async def test_full_mode_pushes_every_byte_and_reloads_every_tensor(fleet) -> None:
    m, sender, add_box = fleet
    box = await add_box()
    for step in (1, 2):
        ws = await publish(m, sender, step)
        assert await engine_checksums(box.url) == expected_checksums(ws)
        push = pushes_of(await m.status(), step)[box.endpoint]
        assert push["mode"] == "full" and push["bytes"] == sender.layout.total_bytes
        assert push["reloaded"] == len(ws)


def test_delta_fields_come_in_pairs_and_stay_out_of_full_push_bodies() -> None:
    from pydantic import ValidationError

    from rollout_manager.weights.protocol import CommitRequest, LayoutBody, PrepareRequest, PushRequest

    base = dict(version=2, ip="127.0.0.1", num_engines=1, session_ids=["h:1"], buffer_addr=0)
    for extra in ({"delta_base": 1}, {"delta_addr": 5}, {"delta_base": 1, "delta_addr": 5, "only_shards": [0]}):
        with pytest.raises(ValidationError):
            PushRequest.model_validate({**base, **extra})
    with pytest.raises(ValidationError):
        PrepareRequest(version=2, layout=LayoutBody(alignment=1, total_bytes=0, tensors=[]), delta_base=1)
    with pytest.raises(ValidationError):
        CommitRequest(version=2, fingerprint="f", shards=[], checksums=[], delta_bytes=3)
    assert PushRequest.model_validate(base).model_dump(exclude_none=True) == {**base, "transport": "mooncake"}
