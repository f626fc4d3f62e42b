"""Which network interface holds an address, and which port: how the UCX transport keeps to
the address it is given.

Peers reach a UCX transport through its worker's address (pdserve/kv_transfer/ucx.py), whose only
socket is the TCP transport's listener, one per network interface UCX uses, on that
interface's address. Limiting UCX to the interface that holds the KV host (`UCX_NET_DEVICES`)
makes it bind that address only; `UCX_TCP_PORT_RANGE` pins its port to the node's --kv-port
(0: the OS picks it).

Must never: import torch or UCX, or guess: an address no interface holds gives None.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def net_devices(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The UCX option that keeps its TCP listeners on `host`'s interface: {"NET_DEVICES": name},
    or nothing when the user set UCX_NET_DEVICES (theirs wins) or no interface holds `host`."""
    if "UCX_NET_DEVICES" in environ:
        return {}
    interface = interface_of(host)
    return {"NET_DEVICES": interface} if interface is not None else {}


def tcp_port(port: int) -> dict[str, str]:
    """The option that pins UCX's TCP listener to `port` (over any UCX_TCP_PORT_RANGE); none
    for 0: the OS picks one as UCX binds (picking one here to pin would race other binds)."""
    return {"TCP_PORT_RANGE": f"{port}-{port}"} if port else {}


def interface_of(host: str) -> str | None:
    """The name of the interface whose IPv4 address is `host` (resolved once), or None: a
    wildcard, an IPv6 address, a name that does not resolve, or an address of no interface."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(address).is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # down, or no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])
