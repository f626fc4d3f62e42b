"""Channels to a peer that may restart on its old address: a node's to the router, the
router's to each node, and the one-shot probes that watch a process come up.

Owns the reconnect options those channels share. gRPC's default reconnect backoff grows
to two minutes, so a router that comes up late, or a node restarted on its address,
would stay unreachable through a cached channel long after it is back; these channels
retry within about a second instead.

A probe (the launcher's readiness check, a health check, a stats poll) opens a new channel
each time, but gRPC keeps connection state per address for all of a process's channels: a
probe that found nothing listening leaves the next one waiting out that shared backoff, and
it saw a started cluster seconds late. `FRESH_CONNECTION` gives a probe its own connection
state: every probe tries the address now. Must never cache channels or pick a peer: callers
own their channels' lifetimes.
"""

from __future__ import annotations

import grpc

from pdserve.common.auth import ChannelOptions, open_channel
from pdserve.common.tls import TlsConfig, sync_channel

RECONNECT_WITHIN_A_SECOND: ChannelOptions = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Despite its name, how long one connection attempt may take to its HTTP/2 handshake, not a
    # wait between attempts (those follow the two above). At 100 ms, a router's first connection
    # to a node that had just started, on two busy cores, timed out before the node's SETTINGS
    # frame, and the router took a healthy node for a lost one. A node that refuses fails at once
    # whatever this is; a frozen one costs each call its own deadline, as before.
    ("grpc.min_reconnect_backoff_ms", 2000),
)
FRESH_CONNECTION: ChannelOptions = (("grpc.use_local_subchannel_pool", 1),)


def reconnecting_channel(address: str, token: str | None = None, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to `address` that reconnects within about a second, its calls carrying the
    auth token when one is given (pdserve/common/auth.py), over mutual TLS when `tls` is (pdserve/common/tls.py)."""
    return open_channel(address, token, options=RECONNECT_WITHIN_A_SECOND, tls=tls)


def probe_channel(address: str, token: str | None = None, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel for one probe of `address`, which tries it now whatever earlier probes found."""
    return open_channel(address, token, options=FRESH_CONNECTION, tls=tls)


def sync_probe_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """`probe_channel`, blocking (no token: callers send their own metadata)."""
    return sync_channel(address, tls, options=FRESH_CONNECTION)
