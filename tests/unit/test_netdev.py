"""UCX kept to the interface that holds the KV host and to --kv-port (its TCP listener binds that
address, and that port when one is given)."""

from __future__ import annotations

from pdserve.kv_transfer.netdev import interface_of, net_devices, tcp_port


def test_the_loopback_address_is_on_lo_and_unknown_addresses_on_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("0.0.0.0") is None  # a wildcard: UCX keeps every interface
    assert interface_of("203.0.113.77") is None  # no interface here holds it
    assert interface_of("no-such-host.invalid") is None


def test_the_users_ucx_net_devices_wins():
    assert net_devices("127.0.0.1", {}) == {"NET_DEVICES": "lo"}
    assert net_devices("127.0.0.1", {"UCX_NET_DEVICES": "eth1"}) == {}
    assert net_devices("203.0.113.77", {}) == {}


def test_the_kv_port_is_pinned_and_0_leaves_the_pick_to_the_os_as_ucx_binds():
    assert tcp_port(45123) == {"TCP_PORT_RANGE": "45123-45123"}
    assert tcp_port(0) == {}
