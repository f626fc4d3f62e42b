"""Where network namespaces cannot be made, the several-hosts test is told why, in one line."""

from __future__ import annotations

from pdserve.testing import netns


def test_no_ip_command_or_no_root_says_so(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert netns.unavailable() == "the `ip` command (iproute2) is not installed"
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "making network namespaces needs root"
