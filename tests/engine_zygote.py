"""Start CPU engines by forking one process that has already imported torch and the engine.

``python -m rollout_manager.cpu_engine`` spends about 2.5 s of CPU importing torch; a chaos test that
kills and replaces an engine every half second cannot afford that on a 2-core CI box. This helper
imports everything once and forks: each child runs the very same ``cpu_engine`` command line
(``rollout_manager.cpu_engine.__main__.main``), so a forked engine is the real engine, only with a
warm start. Nothing has run a torch op in this process before it forks, so no thread pool is
inherited half-initialised.

Protocol (one line each way): the test writes a JSON list ``[log_path, arg, arg, ...]`` on stdin, the
helper answers with the child's pid on stdout. Children stay in the helper's process group, so killing the group
leaves nothing behind; SIGCHLD is ignored so killed children are reaped at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

# The checkout under test, as ``python -m rollout_manager.cpu_engine`` run from the repository root sees it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch  # noqa: F401 - the expensive import, done once

    from rollout_manager.cpu_engine import __main__ as engine_main
    from rollout_manager.cpu_engine import engine, model, server  # noqa: F401 - warm the imports

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        log_path, *argv = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the engine
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.close(devnull)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                code = engine_main.main(argv) or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
