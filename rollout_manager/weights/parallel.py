"""Blocking transfer calls run side by side on threads (the transfer engines release the GIL).

Runs in: box, trainer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


def run_in_threads(calls: Sequence[Callable[[], None]], name: str = "worker") -> None:
    """Run every call on its own thread and wait for all of them; then re-raise the first failure
    (never earlier, so no transfer is left running into a buffer the caller is about to reuse)."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(c,), name=f"{name}-{i}") for i, c in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
