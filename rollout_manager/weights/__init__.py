"""Weights: the manager's side of a push (``sync``, ``groups``, ``peers``, ``protocol``), the sender and receiver
agents, and the byte layer under them (buffer layout, shards and checksums, transports).

Runs in: manager, box, trainer. Each module of the package says which of the three processes run it on such a
line: ``manager``, the daemon; ``box``, the receiver agent beside SGLang on each rollout box
(``receiver_agent``); ``trainer``, the sender agent inside the trainer's process on each node (``sender_agent``,
started by ``trainer_plugin.weight_push``). A module imports only modules that run wherever it runs
(``tests/test_weights_processes.py``).

The byte layer needs torch and, for Mooncake, its native library. The manager imports only
``groups``, ``peers``, ``sync`` and ``protocol``, so the names below load on first use (PEP 562): importing this
package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DEFAULT_ALIGNMENT": "layout", "HostBuffer": "layout", "TensorSpec": "layout", "WeightLayout": "layout",
    "as_byte_tensor": "layout", "build_layout": "layout", "stage": "layout", "unpack": "layout",
    "MooncakeEngine": "mooncake_engine", "TransferError": "mooncake_engine", "mooncake_available": "mooncake_engine",
    "PushResult": "pusher", "push_buffer": "pusher", "source_view": "pusher",
    "DEFAULT_ALGORITHM": "shards", "checksum": "shards", "shard_checksums": "shards", "split_shards": "shards",
    "verify": "shards", "verify_shards": "shards",
    "TcpEngine": "tcp_transport",
}

if TYPE_CHECKING:
    from rollout_manager.weights.layout import (
        DEFAULT_ALIGNMENT,
        HostBuffer,
        TensorSpec,
        WeightLayout,
        as_byte_tensor,
        build_layout,
        stage,
        unpack,
    )
    from rollout_manager.weights.mooncake_engine import MooncakeEngine, TransferError, mooncake_available
    from rollout_manager.weights.pusher import PushResult, push_buffer, source_view
    from rollout_manager.weights.shards import (
        DEFAULT_ALGORITHM,
        checksum,
        shard_checksums,
        split_shards,
        verify,
        verify_shards,
    )
    from rollout_manager.weights.tcp_transport import TcpEngine


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_ALGORITHM", "DEFAULT_ALIGNMENT", "HostBuffer", "MooncakeEngine", "PushResult", "TcpEngine",
    "TensorSpec", "TransferError", "WeightLayout", "as_byte_tensor", "build_layout", "checksum",
    "mooncake_available", "push_buffer", "shard_checksums", "source_view", "split_shards", "stage", "unpack",
    "verify", "verify_shards",
]
