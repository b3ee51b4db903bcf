"""Real transfers over loopback: Mooncake TCP between 127.0.0.1 and 127.0.0.2, and the plain TCP engine."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_manager.weights import (
    HostBuffer,
    MooncakeEngine,
    TcpEngine,
    TransferError,
    mooncake_available,
    push_buffer,
    shard_checksums,
    split_shards,
    verify_shards,
)

SIZE = 32 * 1024 * 1024 + 4096 + 100  # ~32 MB, not a multiple of the alignment
SHARDS = 4

needs_mooncake = pytest.mark.skipif(not mooncake_available(), reason="mooncake transfer engine not installed")


@pytest.fixture(scope="module")
def source() -> HostBuffer:
    buf = HostBuffer(SIZE)
    buf.array[:] = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    return buf


@pytest.fixture(scope="module")
def sink() -> HostBuffer:
    return HostBuffer(SIZE)


@pytest.fixture(autouse=True)
def _clear_sink(sink):
    sink.array[:] = 0


# Engines live for the whole module: a Mooncake engine's destructor blocks for up to ~1 s (its
# handshake listener wakes about once a second), so starting one per test would dominate the runtime.
@pytest.fixture(scope="module")
def mooncake_pair(source, sink):
    sender = MooncakeEngine("127.0.0.1").start()
    receiver = MooncakeEngine("127.0.0.2").start()
    sender.register(source.addr, source.nbytes)
    receiver.register(sink.addr, sink.nbytes)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture(scope="module")
def tcp_pair(source, sink):
    sender = TcpEngine("127.0.0.1", listen=False).start()
    receiver = TcpEngine("127.0.0.2").start()
    sender.register(source.addr, source.nbytes)
    receiver.register(sink.addr, sink.nbytes)
    yield sender, receiver
    sender.close()
    receiver.close()


def _assert_arrived(source: HostBuffer, sink: HostBuffer, result) -> None:
    assert result.bytes == SIZE and result.seconds > 0
    assert len(result.shards) == SHARDS == len(result.checksums)
    assert result.shards == split_shards(SIZE, SHARDS, 256)
    assert np.array_equal(source.array, sink.array)
    assert verify_shards(sink.array, result.shards, result.checksums) == []
    assert shard_checksums(sink.array, result.shards) == result.checksums


@needs_mooncake
def test_mooncake_push_arrives_bit_identical(mooncake_pair, source, sink):
    sender, receiver = mooncake_pair
    assert receiver.session_id == f"127.0.0.2:{receiver.rpc_port}"
    result = push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr, SHARDS)
    _assert_arrived(source, sink, result)
    # A corrupted byte on the receiving side is caught by the shard checksums.
    sink.array[result.shards[2][0] + 1] ^= 0x40
    assert verify_shards(sink.array, result.shards, result.checksums) == [2]


@needs_mooncake
@pytest.mark.parametrize("mode", ["batch", "async_batch", "threads"])
def test_mooncake_other_write_modes(mooncake_pair, source, sink, mode):
    sender, receiver = mooncake_pair
    result = push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr, SHARDS, mode=mode,
                         checksums=shard_checksums(source.array, split_shards(SIZE, SHARDS, 256)))
    _assert_arrived(source, sink, result)


@needs_mooncake
def test_mooncake_engine_per_shard(mooncake_pair, source, sink):
    """Two engines on the sender (shards dealt round-robin), two engines (same buffer) on the receiver."""
    sender, receiver = mooncake_pair
    extra_sender = MooncakeEngine("127.0.0.1").start()
    extra_receiver = MooncakeEngine("127.0.0.2").start()
    try:
        extra_sender.register(source.addr, source.nbytes)
        extra_receiver.register(sink.addr, sink.nbytes)
        result = push_buffer([sender, extra_sender], source.addr, SIZE,
                             [receiver.session_id, extra_receiver.session_id], sink.addr, SHARDS)
        _assert_arrived(source, sink, result)
    finally:
        extra_sender.close()
        extra_receiver.close()


@needs_mooncake
def test_mooncake_unregistered_remote_address_raises(mooncake_pair, source, sink):
    sender, receiver = mooncake_pair
    with pytest.raises(TransferError) as err:
        sender.write(receiver.session_id, source.addr, 0x1000, 4096)
    assert err.value.code < 0 and err.value.target == receiver.session_id
    with pytest.raises(TransferError):  # runs past the end of the registered range
        push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr + 4096, SHARDS)
    # The engine still works afterwards.
    push_buffer(sender, source.addr, 1 << 20, receiver.session_id, sink.addr, 2, compute_checksums=False)
    assert np.array_equal(source.array[: 1 << 20], sink.array[: 1 << 20])


@needs_mooncake
def test_mooncake_start_failure_is_a_clear_runtime_error():
    engine = MooncakeEngine("127.0.0.1", metadata_server="http://127.0.0.1:1/metadata")
    with pytest.raises(RuntimeError, match="initialize"):
        engine.start()
    assert not engine.started


def test_tcp_push_arrives_bit_identical(tcp_pair, source, sink):
    sender, receiver = tcp_pair
    result = push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr, SHARDS)
    _assert_arrived(source, sink, result)
    # Connections are reused on the next push.
    sink.array[:] = 0
    result = push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr, SHARDS,
                         checksums=result.checksums)
    _assert_arrived(source, sink, result)


def test_tcp_unregistered_remote_address_raises(tcp_pair, source, sink):
    sender, receiver = tcp_pair
    with pytest.raises(TransferError):
        sender.write(receiver.session_id, source.addr, 0x1000, 4096)
    with pytest.raises(TransferError):
        push_buffer(sender, source.addr, SIZE, receiver.session_id, sink.addr + 4096, SHARDS)
    with pytest.raises(TransferError):  # local range not registered with the sender
        sender.write(receiver.session_id, 0x1000, sink.addr, 16)
    push_buffer(sender, source.addr, 1 << 20, receiver.session_id, sink.addr, 2, compute_checksums=False)
    assert np.array_equal(source.array[: 1 << 20], sink.array[: 1 << 20])


def test_tcp_unreachable_target_raises(source):
    with TcpEngine("127.0.0.1", listen=False, connect_timeout_s=1) as sender:
        sender.register(source.addr, source.nbytes)
        probe = TcpEngine("127.0.0.3").start()
        dead = probe.session_id
        probe.close()
        with pytest.raises(TransferError):
            sender.write(dead, source.addr, 0x1000, 16)
