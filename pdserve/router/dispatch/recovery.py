"""How a sample recovers from a lost node: which failures count as a loss, how many new
attempts it may start, and the node request id of each.

Owns `NODE_LOST_CODES`, `NodeLost` (what ends an attempt that may succeed elsewhere,
which nodes it implicates, and why: a `LossReason`), `RecoveryBudget`, `ResumeCounts` (every
new attempt after a loss, by reason: what `pdserve_resumes_total` shows) and `attempt_ids`. The driver
(pdserve/router/dispatch/driver.py) raises and handles them; the routes (pdserve/router/dispatch/routes.py) say which
nodes a loss implicates. Never calls a node and never touches the registry.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from pdserve.common.enum_counts import EnumCounts
from pdserve.router.errors import DeadlineExceeded, RequestKillsNodes, RouterError
from pdserve.router.cluster.registry import NodeEntry

# Codes of a call whose node may be gone (killed, unreachable, its core dead): another
# node may succeed. Every other code is an answer about the request itself.
NODE_LOST_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                             grpc.StatusCode.CANCELLED})


class LossReason(enum.Enum):
    """Why a sample had to be computed again elsewhere: the `reason` label of `pdserve_resumes_total`."""

    NODE_FAILED = "node_failed"  # a call failed the way a dead node's does, or its stream ended unfinished
    NODE_GONE = "node_gone"  # the node went silent past the heartbeat timeout, or was replaced
    KV_LOST = "kv_lost"  # the KV transfer into the decode node never came
    # A draining node still held the sample when its --drain-timeout-s ran out. A drain that
    # finishes in time counts nothing: it is not a failover.
    DRAIN_TIMEOUT = "drain_timeout"


class NodeLost(Exception):
    """An attempt ended because a node call failed the way a lost node's does; `error` is
    what the client gets if no recovery is left."""

    def __init__(self, error: RouterError, probe: Sequence[NodeEntry], decoding: bool,
                 exclude: Sequence[NodeEntry] = (), reason: LossReason = LossReason.NODE_FAILED) -> None:
        super().__init__(str(error))
        self.error = error
        self.reason = reason
        self.probe = list(probe)  # any of them may be the one that died: each gets a GetStats probe
        self.exclude = list(exclude)  # never asked again for this sample, whatever its probe says
        self.decoding = decoding  # lost while decoding (a resume) or before the attempt's next token (a retry)


    def cause(self) -> LossReason:
        """The reason to count: a loss on a node that was draining is its drain running out of time."""
        if any(entry.draining for entry in (*self.exclude, *self.probe)):
            return LossReason.DRAIN_TIMEOUT
        return self.reason


class ResumeCounts(EnumCounts[LossReason]):
    """Samples computed again on another node after a loss (resumes and retries), by reason; one
    per router, read by its metrics at scrape time."""

    def __init__(self) -> None:
        super().__init__(LossReason)


@dataclass(slots=True)
class RecoveryBudget:
    """How many more attempts a sample may start after losing a node: per kind (resumes while
    decoding, retries before the next token), and in all (`max_node_failures`, the bound on how
    many nodes one request can take down)."""

    max_resumes: int
    max_retries: int
    max_node_failures: int
    resumes: int = 0
    retries: int = 0

    def spend(self, decoding: bool) -> bool:
        """Count one recovery; False once the kind's budget is spent."""
        if decoding:
            self.resumes += 1
            return self.resumes <= self.max_resumes
        self.retries += 1
        return self.retries <= self.max_retries

    def allow(self, decoding: bool, error: RouterError, remaining_s: float | None, cause: BaseException) -> str:
        """Count one recovery and name it ("resume" or "retry"); raise `error`'s kind once
        the budget is spent, or DeadlineExceeded once the deadline has passed."""
        what = "resume" if decoding else "retry"
        check_node_failures(self.resumes + self.retries + 1, self.max_node_failures, error, cause)
        if not self.spend(decoding):
            raise type(error)(f"{error} (no {what} left for this sample)") from cause
        if remaining_s is not None and remaining_s <= 0:
            raise DeadlineExceeded(f"the deadline passed while recovering from: {error}") from cause
        return what


def check_node_failures(num_failures: int, max_failures: int, error: RouterError, cause: BaseException) -> None:
    """Raise RequestKillsNodes once a request's node attempts have failed `max_failures` times."""
    if num_failures >= max_failures:
        raise RequestKillsNodes(f"{num_failures} of this request's node attempts failed, the last: {error}; not sent "
                                f"to another node (--max-node-failures-per-request {max_failures}): the request "
                                "itself may be what fails them") from cause


def attempt_ids(node_req_id: str) -> Iterator[str]:
    """The node request id of each attempt: the sample's own, then "<id>~<n>". Ids never
    repeat on a node (a decode node refuses a retired id for a while)."""
    yield node_req_id
    for n in itertools.count(1):
        yield f"{node_req_id}~{n}"
