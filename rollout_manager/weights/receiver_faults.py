"""Faults the receiver agent can be told to commit, for the tests that prove the manager survives them.

Runs in: box.

All off unless the agent's command line arms one (``--fault-*``). They live here, as one hook object the
agent calls at the five points where a real box can go wrong, so the agent's own code has no test branches
and no ``os._exit``; the CPU engine does the same in ``cpu_engine/faults.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass

import numpy as np


def _die() -> None:
    os._exit(1)  # as a SIGKILL would: no cleanup, no answer, sockets reset


@dataclass(frozen=True)
class ReceiverFaults:
    corrupt: bool = False  # flip a byte of what landed, before verifying
    die_after_prepare: bool = False  # exit just after /prepare answered (the sender may be writing)
    corrupt_delta: bool = False  # flip a byte of every delta before applying it
    die_mid_serve: bool = False  # serve a peer its first shard, then exit
    corrupt_serve: bool = False  # serve peers one wrong byte

    FLAGS = ("corrupt", "die_after_prepare", "corrupt_delta", "die_mid_serve", "corrupt_serve")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for name, what in (("corrupt", "corrupt every transfer"), ("die_after_prepare", "exit mid-transfer"),
                           ("corrupt_delta", "corrupt every delta that lands"),
                           ("die_mid_serve", "exit while serving a peer"),
                           ("corrupt_serve", "serve peers a wrong byte")):
            parser.add_argument("--fault-" + name.replace("_", "-"), dest="fault_" + name, action="store_true",
                                help="test: " + what)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReceiverFaults:
        return cls(**{name: getattr(args, "fault_" + name) for name in cls.FLAGS})

    def landed(self, buffer: np.ndarray, total: int) -> None:
        """A full push landed in ``buffer`` (``total`` bytes) and is about to be verified."""
        if self.corrupt and total:
            buffer[total // 2] ^= 0xFF

    def delta_landed(self, blob: np.ndarray) -> None:
        """A delta landed and is about to be applied."""
        if self.corrupt_delta and len(blob):
            blob[-1] ^= 0xFF

    def prepared(self) -> None:
        """``/prepare`` is answering: the sender may start writing."""
        if self.die_after_prepare:
            asyncio.get_running_loop().call_later(0.05, _die)

    def serving_stops_after_first_shard(self) -> bool:
        """Whether serving a peer ends, with this process, after its first shard."""
        return self.die_mid_serve

    @staticmethod
    def died_serving() -> None:
        _die()

    def serve_flip(self, total: int) -> int | None:
        """The byte to flip (and restore after) while serving a peer ``total`` bytes, or None."""
        return total // 2 if self.corrupt_serve and total else None


NO_FAULTS = ReceiverFaults()  # a box in production
