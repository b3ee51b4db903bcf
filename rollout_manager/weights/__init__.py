"""Weight-transfer byte layer: buffer layout, shards and checksums, and the transports that move them.

No HTTP and no manager logic here; both the sender and the receiver agents build on these pieces.
Mooncake is imported lazily, so this package imports where it is not installed.
"""

from .layout import (DEFAULT_ALIGNMENT, HostBuffer, TensorSpec, WeightLayout, as_byte_tensor, build_layout,
                     stage, unpack)
from .mooncake_engine import MooncakeEngine, TransferError, mooncake_available
from .pusher import PushResult, push_buffer, source_view
from .shards import (DEFAULT_ALGORITHM, checksum, shard_checksums, split_shards, verify, verify_shards)
from .tcp_transport import TcpEngine

__all__ = [
    "DEFAULT_ALGORITHM", "DEFAULT_ALIGNMENT", "HostBuffer", "MooncakeEngine", "PushResult", "TcpEngine",
    "TensorSpec", "TransferError", "WeightLayout", "as_byte_tensor", "build_layout", "checksum",
    "mooncake_available", "push_buffer", "shard_checksums", "source_view", "split_shards", "stage", "unpack",
    "verify", "verify_shards",
]
