"""Who may register: only configured networks, and a caller registers itself, not someone else.

The same rule holds for a rollout box (``/register_rollout_instance``) and for the trainer's own
instances (``/register_local_rollout_instances``): every host named must be the caller's address. A
caller on the manager's own machine may also name that machine's other addresses (a trainer that
reaches a manager beside it through 127.0.0.1 and registers its SGLang by the node's IP).
Other callers need ``allow_registration_host_mismatch`` (a trainer driver that registers the
instances of several nodes, a box behind NAT).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence

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

    async def check(self, source: str | None, hosts: Iterable[str] = ()) -> None:
        """Raise Forbidden (or BadRequest for a host that does not resolve) unless ``source`` may register.

        ``source`` is the request's peer address (None for in-process calls). Every one of ``hosts``
        must resolve to that address (or, for a caller on this machine, to this machine) unless
        ``allow_registration_host_mismatch``.
        """
        if source is None:
            return
        addr = plain_ip(source)
        if not any(addr in net for net in self.networks if net.version == addr.version):
            raise Forbidden(f"registration from {source} refused: not in registration_allowed_networks "
                            f"({self.networks_text})")
        if self.allow_host_mismatch:
            return
        for host in dict.fromkeys(hosts):
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
                resolved = {plain_ip(str(info[4][0])) for info in infos}
            except (OSError, ValueError):
                raise BadRequest(f"host {host!r} does not resolve") from None
            if addr in resolved or (is_this_machine(addr) and all(own_lan_address(a) for a in resolved)):
                continue
            raise Forbidden(f"registration of host {host} refused: the request came from {source}; a box "
                            f"registers itself (set allow_registration_host_mismatch to allow this)")


def own_lan_address(addr: Address) -> bool:
    """One of this machine's addresses other than loopback: what a caller on this machine may name
    besides its own source address (loopback addresses stay distinct, as tests use them as hosts)."""
    if addr.is_loopback or addr.is_unspecified or addr.is_multicast:  # 0.0.0.0 binds, but is nobody's
        return False
    return is_this_machine(addr)


def is_this_machine(addr: Address) -> bool:
    """Whether ``addr`` is one of this machine's own addresses: only those can be bound."""
    if addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(addr), 0))
    except OSError:  # EADDRNOTAVAIL: someone else's
        return False
    return True
