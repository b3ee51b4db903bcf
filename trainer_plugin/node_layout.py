"""Which training ranks share a node, and which one of them runs the node's weight sender.

verl 0.9.1 cannot tell a rank where it sits on its node: its ``RayWorkerGroup`` never sets
``LOCAL_RANK``, so ``Worker.__init__`` (``single_controller/base/worker.py``) stores ``LOCAL_RANK=0``
in every actor's environment (``utils/distributed.py`` says "in current ray environment, LOCAL_RANK is
always zero"). A node leader taken from ``LOCAL_RANK`` would make every rank a leader, and eight
senders on one node would race for one port. So the layout is read from where the ranks really run:
each rank names its node (Ray's node id inside a Ray worker, else the host name), the names are
gathered across the training ranks, and the lowest rank on each node leads it. Rank zero is always a
leader, so the rank that publishes a version also holds a sender.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Protocol


class Gather(Protocol):
    def all_gather(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True)
class NodeLayout:
    """Every training rank's node (indexed by rank) seen from ``rank``."""

    rank: int
    node_ids: tuple[str, ...]

    @property
    def node_id(self) -> str:
        return self.node_ids[self.rank]

    @property
    def leader_rank(self) -> int:
        """The lowest rank on this rank's node."""
        return self.node_ids.index(self.node_id)

    @property
    def is_leader(self) -> bool:
        return self.leader_rank == self.rank

    @property
    def node_ranks(self) -> list[int]:
        """The ranks on this rank's node (its leader first)."""
        return [r for r, n in enumerate(self.node_ids) if n == self.node_id]

    @property
    def leaders(self) -> list[int]:
        """One rank per node, in rank order."""
        return [r for r, n in enumerate(self.node_ids) if self.node_ids.index(n) == r]


def this_node_id() -> str:
    """Ray's id of the node this process runs on (inside Ray), else the host name."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    return socket.gethostname()


def this_node_ip() -> str | None:
    """The address Ray knows this node by (inside Ray), else None."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return None


def gather_layout(comm: Gather, rank: int, node_id: str | None = None) -> NodeLayout:
    """Collective: every rank must call it. ``node_id`` None: :func:`this_node_id`."""
    ids = comm.all_gather(node_id or this_node_id())
    if not 0 <= rank < len(ids):
        raise ValueError(f"rank {rank} is outside the {len(ids)} rank(s) of the training group")
    return NodeLayout(rank=rank, node_ids=tuple(str(i) for i in ids))
