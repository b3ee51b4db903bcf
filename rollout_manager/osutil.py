"""Process and network helpers shared by the manager, the rollout-box launcher and the trainer plugin.

Standard library only: ``launch.box`` runs in SGLang's environment before anything heavy is imported,
and the trainer plugin imports this without pulling in the manager.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_host(bind_host: str) -> str:
    """The host to put in a URL that reaches a server bound to ``bind_host`` from this machine."""
    if bind_host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_host == "::":
        return "[::1]"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_bindable(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (TIME_WAIT is no obstacle, as for aiohttp)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def route_source(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host:port`` (a UDP connect sends nothing).

    Raises OSError (``socket.gaierror`` when ``host`` does not resolve) when there is no route.
    """
    last: OSError | None = None
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
            except OSError as exc:
                last = exc
    raise last or OSError(f"no address for {host}")


def host_port(addr: str) -> tuple[str, int]:
    """``host:port`` or ``http(s)://host:port[/...]`` -> ``(host, port)``; without a port, the scheme's.

    Raises ValueError when ``addr`` has no host or a bad port.
    """
    parsed = urllib.parse.urlsplit(addr if "://" in addr else "http://" + addr)
    port = parsed.port  # ValueError for a bad one
    if not parsed.hostname:
        raise ValueError(f"no host in {addr!r}")
    return parsed.hostname, port or (443 if parsed.scheme == "https" else 80)


def source_address_toward(addr: str) -> str:
    """This machine's address on the route to ``addr`` (``host:port`` or a URL): what a peer there sees.

    Raises ValueError for a malformed ``addr``, OSError (``socket.gaierror`` when the host does not
    resolve) when there is no route.
    """
    return route_source(*host_port(addr))


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc; none elsewhere than Linux)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    Returns False when ``parent_pid`` is given and is no longer the parent: it died before the
    request took effect, so the caller should exit. Elsewhere than Linux this does nothing.
    """
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return parent_pid is None or os.getppid() == parent_pid


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``subprocess`` ``preexec_fn`` doing :func:`die_with_parent` for the calling process (Linux).

    libc is resolved here, in the parent, so nothing is loaded between fork and exec. The kernel ties
    the signal to the *thread* that forks, so fork from a thread that lives as long as the process.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # an exotic libc
        return None
    return prctl


def raise_open_file_limit() -> tuple[int, int, int]:
    """Raise this process's soft open-file limit to its hard limit: ``(soft before, soft now, hard)``.

    Every sequence in flight holds one connection, so the common soft default of 1024 caps a manager
    far below what a fleet needs, while the hard limit is usually much higher. Where the limit cannot
    be read or raised (not Unix; a hard limit of 'unlimited' the kernel refuses), it is left as is.
    """
    try:
        import resource
    except ImportError:  # not Unix
        return (-1, -1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = max(soft, 1 << 20)  # Linux refuses more than fs.nr_open (1048576 by default)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return (soft, soft, hard)
        return (soft, target, hard)
    return (soft, soft, hard)


def tune_gc(young_threshold: int) -> str:
    """Set the cyclic garbage collector up for a long-running server; returns what was done, for the log.

    Everything alive now (modules, classes, the configuration) is frozen: a full collection no longer
    walks it, and with tens of thousands of such objects each full collection took tens of ms. The
    young generation is collected every ``young_threshold`` new container objects instead of every
    700: a request makes dozens and drops nearly all of them by reference counting, so collecting
    that often was mostly rescanning live requests. Cycles are still collected. 0 changes nothing.
    Call once, after the imports, before serving.
    """
    if young_threshold <= 0:
        return f"garbage collector: Python's defaults {gc.get_threshold()}"
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
    return f"garbage collector: {gc.get_freeze_count()} objects frozen at start, thresholds {gc.get_threshold()}"


def open_file_limit() -> tuple[int, int]:
    """This process's (soft, hard) open-file limit; (-1, -1) where it cannot be read."""
    try:
        import resource
    except ImportError:
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (int(soft), int(hard))
