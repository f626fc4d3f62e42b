"""Admission control at the router: how much work the cluster may hold at once.

A request's life through it:

    check_room() ─▶ refused at once when full, before the request is even validated
    admit(prompt tokens, n) ─▶ refused at once (Overloaded → RESOURCE_EXHAUSTED)
       │                       when the limits would be passed: the router has no queue
       ▼ ticket
    every sample's first response ─▶ that sample's prompt tokens stop counting as queued
       ▼
    release (finish, error, cancel, deadline: the `with` block's exit) ─▶ slots free

Two limits, both counted in sequences (a request with n samples is n sequences, since
each holds a decode reservation and needs a prefill of its own):
- in-flight sequences: bounds the decode work and the reservations held;
- queued prompt tokens (sequences admitted but not yet at token 1): bounds the prefill
  work ahead of a new request, i.e. its time to first token.
A request bigger than a whole limit is admitted only when nothing else holds that
limit, so it waits for room instead of being refused forever. A draining router `close`s
its admission: every new request is refused (`RouterDraining`, UNAVAILABLE) while the
admitted ones run to their end, which `idle` tells.

Must never: queue a request, pick a status code (it raises `Overloaded`), or let a
ticket outlive its request — every ticket is released exactly once.
"""

from __future__ import annotations

import asyncio

from pdserve.router.config import AdmissionLimits
from pdserve.router.errors import Overloaded, RouterDraining


class Admission:
    """The router's counts of admitted work; one per router, used from its event loop only."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.inflight = 0
        self.queued_tokens = 0
        self.rejected = 0
        self.closed_because: str | None = None  # set by `close`: why no request is admitted any more
        self.idle = asyncio.Event()  # set while no sequence is in flight
        self.idle.set()

    def close(self, because: str) -> None:
        """Admit nothing more (a draining router); what is admitted runs on."""
        self.closed_because = because

    def check_room(self) -> None:
        """Overloaded when not even one more sequence fits (RouterDraining once closed): refuse
        before paying for validation."""
        if self.closed_because is not None:
            self.rejected += 1
            raise RouterDraining(f"the router is {self.closed_because} and takes no new request; retry on "
                                 "another router")
        if self.inflight >= self.limits.max_inflight_requests:
            self.rejected += 1
            raise Overloaded(f"the router is at capacity ({self.inflight} sequences in flight, "
                             f"limit {self.limits.max_inflight_requests}); retry later")

    def admit(self, num_prompt_tokens: int, n: int) -> AdmissionTicket:
        """A ticket for the request, or Overloaded naming the limit it would pass."""
        reason = self._refusal(num_prompt_tokens * n, n)
        if reason is not None:
            self.rejected += 1
            raise Overloaded(f"the router is at capacity ({reason}); retry later")
        self.inflight += n
        self.queued_tokens += num_prompt_tokens * n
        self.idle.clear()
        return AdmissionTicket(self, num_prompt_tokens, n)

    def _refusal(self, tokens: int, n: int) -> str | None:
        limits = self.limits
        if self.inflight > 0 and self.inflight + n > limits.max_inflight_requests:
            return (f"{self.inflight} sequences in flight, this request adds {n}, "
                    f"limit {limits.max_inflight_requests}")
        if self.queued_tokens > 0 and self.queued_tokens + tokens > limits.max_queued_tokens:
            return (f"{self.queued_tokens} prompt tokens waiting for prefill, this request adds {tokens}, "
                    f"limit {limits.max_queued_tokens}")
        return None

    def _give_back(self, sequences: int, tokens: int) -> None:
        self.inflight -= sequences
        self.queued_tokens -= tokens
        if self.inflight == 0:
            self.idle.set()


class AdmissionTicket:
    """One admitted request's share of the limits; a context manager that releases it on exit."""

    def __init__(self, admission: Admission, num_prompt_tokens: int, n: int) -> None:
        self._admission = admission
        self._num_prompt_tokens = num_prompt_tokens
        self._waiting_samples = set(range(n))  # samples whose prompt still counts as queued
        self._sequences = n
        self._released = False

    def responded(self, index: int) -> None:
        """Sample `index` produced a response: its prefill is over, its prompt no longer queued."""
        if self._released or index not in self._waiting_samples:
            return
        self._waiting_samples.discard(index)
        self._admission._give_back(0, self._num_prompt_tokens)

    def release(self) -> None:
        """Idempotent: the second call (and any after) does nothing."""
        if self._released:
            return
        self._released = True
        self._admission._give_back(self._sequences, self._num_prompt_tokens * len(self._waiting_samples))
        self._waiting_samples.clear()

    def __enter__(self) -> AdmissionTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
