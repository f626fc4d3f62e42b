"""The lease clock of a KV hand-off (pdserve/node/core/lease.py): it runs only while something is outstanding."""

from __future__ import annotations

import pytest

from pdserve.node.core.lease import RENEWALS_PER_LEASE, LeaseClock


def test_a_stopped_lease_never_expires_and_a_running_one_expires_a_lease_after_its_last_renewal():
    lease = LeaseClock(2.0)
    assert not lease.running and not lease.expired(1e12)  # nothing outstanding: a queue may be deep
    lease.renew(10.0)
    assert lease.running and not lease.expired(11.9) and lease.expired(12.0)
    lease.renew(11.5)  # progress: an ack landed
    assert not lease.expired(13.4) and lease.expired(13.5)
    lease.stop()  # every push acknowledged
    assert not lease.expired(1e12)


def test_renewals_are_due_a_fraction_of_a_lease_apart():
    lease = LeaseClock(3.0)
    assert lease.renewal_due(None, 0.0)
    step = 3.0 / RENEWALS_PER_LEASE
    assert not lease.renewal_due(5.0, 5.0 + step - 0.01) and lease.renewal_due(5.0, 5.0 + step)


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_s must be > 0, got 0"):
        LeaseClock(0.0)
