"""Who may register: only configured networks, and a box registers itself, not someone else."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence

from rollout_manager.errors import BadRequest, Forbidden

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def plain_ip(text: str) -> Address:
    """An address, with IPv4-mapped IPv6 (``::ffff:1.2.3.4``) taken as the IPv4 it is."""
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class Admission:
    def __init__(self, networks: Sequence[Network], networks_text: str, allow_host_mismatch: bool) -> None:
        self.networks = networks
        self.networks_text = networks_text  # as configured, for messages
        self.allow_host_mismatch = allow_host_mismatch

    async def check(self, source: str | None, host: str | None) -> None:
        """Raise Forbidden (or BadRequest for a host that does not resolve) unless ``source`` may register.

        ``source`` is the request's peer address (None for in-process calls). With ``host``, the
        registered host must resolve to that address unless ``allow_registration_host_mismatch``.
        """
        if source is None:
            return
        addr = plain_ip(source)
        if not any(addr in net for net in self.networks if net.version == addr.version):
            raise Forbidden(f"registration from {source} refused: not in registration_allowed_networks "
                            f"({self.networks_text})")
        if host is None or self.allow_host_mismatch:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            resolved = {plain_ip(str(info[4][0])) for info in infos}
        except (OSError, ValueError):
            raise BadRequest(f"host {host!r} does not resolve") from None
        if addr not in resolved:
            raise Forbidden(f"registration of host {host} refused: the request came from {source}; a box "
                            f"registers itself (set allow_registration_host_mismatch to allow this)")
