"""The lease clock both ends of a KV hand-off keep: it bounds an unacknowledged transfer, nothing else.

A lease runs only while something it bounds is outstanding, counts from when that began, and
starts afresh at every sign of progress (an acknowledged push on the prefill node; a renewal
or the done message landing on the decode node, each behind the pushes sent before it). A
request waiting in a deep prefill queue, or a long prompt whose pushes keep landing, never
expires one; a peer that stops answering does, `lease_s` after it was last heard from.

Must never: read the clock itself (callers pass `now`, so tests drive it), or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# A prefill node renews each decode reservation it holds this many times per lease, so one
# late renewal does not expire it.
RENEWALS_PER_LEASE = 3


@dataclass(slots=True)
class LeaseClock:
    lease_s: float
    since: float | None = None  # None: nothing outstanding, nothing to bound

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")

    def renew(self, now: float) -> None:
        """Progress (or the start of what the lease bounds): the lease runs from `now`."""
        self.since = now

    def stop(self) -> None:
        """Nothing outstanding any more: no deadline until something starts again."""
        self.since = None

    @property
    def running(self) -> bool:
        return self.since is not None

    def expired(self, now: float) -> bool:
        return self.since is not None and now - self.since >= self.lease_s

    def renewal_due(self, last_renewal: float | None, now: float) -> bool:
        """Whether a renewal sent at `last_renewal` (None: never) wants another by `now`."""
        return last_renewal is None or now - last_renewal >= self.lease_s / RENEWALS_PER_LEASE
