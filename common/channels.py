"""Channels to a peer that may restart on its old address: a node's to the router, the
router's to each node.

Owns the reconnect options those channels share. gRPC's default reconnect backoff grows
to two minutes, so a router that comes up late, or a node restarted on its address,
would stay unreachable through a cached channel long after it is back; these channels
retry within about a second instead. Must never cache channels or pick a peer: callers
own their channels' lifetimes.
"""

from __future__ import annotations

import grpc

from pdserve.common.auth import ChannelOptions, open_channel
from pdserve.common.tls import TlsConfig

RECONNECT_WITHIN_A_SECOND: ChannelOptions = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def reconnecting_channel(address: str, token: str | None = None, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to `address` that reconnects within about a second, its calls carrying the
    auth token when one is given (common/auth.py), over mutual TLS when `tls` is (common/tls.py)."""
    return open_channel(address, token, options=RECONNECT_WITHIN_A_SECOND, tls=tls)
